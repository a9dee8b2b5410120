"""Drafter context K/V after the fused GEMM: grouped K-RMSNorm + RoPE + paged-cache writes.

``DFlashDraftModel._project_context_kv`` produces K and V for ALL drafter layers with one GEMM,
as views ``[L, N, kv_heads, head_dim]`` of its ``[N, L * 2 * kv_heads * head_dim]`` output. What
follows is elementwise per (layer, row, head), with ``x = K[l, n, h, :]`` of dtype ``T``:

1. grouped K-RMSNorm, statistic in fp32, one weight row per layer (``rms_norm_grouped``)::

       y = w[l] * T(x / sqrt(mean(x^2) + eps))            # dtype R = promote(w.dtype, T)

2. RoPE at ``p = positions[n]`` (NeoX rotate-half layout of ``models/rope.py``; ``rot`` =
   ``cos.shape[1]`` <= head_dim channels rotate, the rest pass through; ``half = rot / 2``)::

       c, s   = R(cos[p, d]), R(sin[p, d])             # tables are fp32, cast to y's dtype
       y'[d]  = R( R(y[d] * c) + R(-y[d + half] * s) )  for d <  half
       y'[d]  = R( R(y[d] * c) + R( y[d - half] * s) )  for half <= d < rot
       y'[d]  = y[d]                                   for d >= rot

3. writes, ``slot = slots[n]``::

       k_cache_l[slot, h, :] = C(y')      v_cache_l[slot, h, :] = C(V[l, n, h, :])

``R(.)`` / ``C(.)`` round to the norm dtype / the cache dtype. Every product and sum above is
computed in fp32 (no FMA contraction) and rounded where torch's eager ops round, so in fp32 the
kernel differs from the reference only through ``1 / sqrt(mean(x^2) + eps)`` (reduction order;
torch's CUDA rsqrt), about one fp32 ulp, and in bf16 by at most one bf16 ulp where that flips a
rounding.

:func:`context_kv_reference` is the torch path the model ran before this kernel (the test checks
it bit for bit against the model); :func:`fused_context_kv_` does the three steps in ONE Triton
launch, a program per (row, layer) holding that row's ``[kv_heads, head_dim]`` tile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from . import pdl
from .availability import interpret_mode, triton_can_run
from .jit import DTYPE_CODE, _round_to, jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["context_kv_reference", "fused_context_kv_", "is_available"]

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


# ---- availability ---------------------------------------------------------------------------------


def is_available(device: torch.device | str) -> bool:
    """Whether :func:`fused_context_kv_` can run on ``device``: triton importable and either a
    CUDA device, or ``TRITON_INTERPRET=1`` (the interpreter runs on CPU tensors)."""
    return triton_can_run(device)


# ---- torch reference ------------------------------------------------------------------------------


def context_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    kv_caches: KVCaches,
) -> None:
    """Grouped K-RMSNorm, RoPE and cache writes in eager torch (the model's original path).

    Args:
        k, v: ``[L, N, kv_heads, head_dim]``, any strides (views of the context GEMM output),
            dtype ``T``.
        k_norm_weight: ``[L, head_dim]``, row ``l`` is layer ``l``'s ``k_norm`` weight.
        eps: RMSNorm epsilon.
        cos, sin: ``[max_positions, rotary_dim]`` fp32 tables (``RotaryEmbedding.cos/sin``; any
            YaRN magnitude already folded in), ``rotary_dim`` even and ``<= head_dim``.
        positions: ``[N]`` int64 absolute positions of the context rows.
        slots: ``[N]`` int64 cache slots (``block * block_size + offset``), any stride.
        kv_caches: ``L`` pairs ``(k_cache, v_cache)``, each ``[num_slots, kv_heads, head_dim]``.

    Writes ``kv_caches[l][0][slots]`` and ``kv_caches[l][1][slots]`` in place; nothing else.
    """
    num_layers, n = k.shape[0], k.shape[1]
    # 1. y = w_l * T(x * rsqrt(mean(x^2) + eps)), statistic in fp32
    kf = k.float()
    normed = (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps)).to(k.dtype)
    y = k_norm_weight.view(num_layers, 1, 1, -1) * normed
    # 2. RoPE over the first rot channels; pairs (d, d + rot/2); tables cast to y's dtype
    rot = cos.shape[-1]
    half = rot // 2
    c = cos[positions].view(1, n, 1, rot).to(y.dtype)
    s = sin[positions].view(1, n, 1, rot).to(y.dtype)
    y_rot, y_pass = y[..., :rot], y[..., rot:]
    rotated = torch.cat([-y_rot[..., half:], y_rot[..., :half]], dim=-1)
    out = y_rot * c + rotated * s
    if y_pass.shape[-1]:
        out = torch.cat([out, y_pass], dim=-1)
    # 3. cache writes, cast to the cache dtype
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        k_cache.index_copy_(0, slots, out[layer].to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v[layer].to(v_cache.dtype))


# ---- Triton kernel --------------------------------------------------------------------------------
#
# The two functions below are plain Python here and become Triton JIT functions in
# :func:`_kernels`, which decorates copies of them bound to a fresh globals dict: triton stays
# optional (imported only there), and the helper resolves through that dict in both the compiled
# build and the CPU interpreter (which looks names up in the kernel's globals and writes into them).
# Triton picks the interpreter from ``TRITON_INTERPRET`` when it decorates, its own ``tl.sum`` &c.
# included at ``import triton``: set the variable before the process imports triton.


def _context_kv_kernel(
    k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    k_caches, v_caches,  # tuples of NUM_LAYERS cache tensors (separate allocations)
    stride_kl, stride_kn, stride_kh, stride_kd,
    stride_vl, stride_vn, stride_vh, stride_vd,
    stride_wl, stride_wd, stride_tab, stride_pos, stride_slot,
    stride_kcs, stride_kch, stride_kcd,
    stride_vcs, stride_vch, stride_vcd,
    eps,
    NUM_LAYERS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IN_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr, CACHE_DTYPE: tl.constexpr, PDL: tl.constexpr,
):
    # program (row, layer) owns the [NUM_HEADS, HEAD_DIM] tile of one context row in one layer
    if PDL:  # kernels/pdl.py: k and v are the fused K|V GEMM's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    half: tl.constexpr = ROT_DIM // 2
    pos = tl.load(pos_ptr + row * stride_pos).to(tl.int64)
    slot = tl.load(slot_ptr + row * stride_slot).to(tl.int64)

    # 1. grouped K-RMSNorm: inv = 1 / sqrt(mean(x^2) + eps) per head in fp32 (sqrt and division
    # correctly rounded, as torch's CPU rsqrt), n = T(x * inv), y = R(w_l * n)
    k_row = k_ptr + layer * stride_kl + row * stride_kn + h * stride_kh
    x = tl.load(k_row + d * stride_kd, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) * (1.0 / HEAD_DIM)
    inv = tl.math.div_rn(tl.full([BLOCK_H], 1.0, tl.float32), tl.math.sqrt_rn(mean_sq + eps))[:, None]
    w_row = w_ptr + layer * stride_wl
    w = tl.load(w_row + d * stride_wd, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    y = _round_to(w * _round_to(x * inv, IN_DTYPE), NORM_DTYPE)

    # 2. RoPE: the rotate-half partner of channel d is d + half (negated) for d < half and d - half
    # for half <= d < rot; reload it (L1-resident) and normalise it the same way. Channels
    # d >= rot pass through.
    is_rot = d < ROT_DIM
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    xp = tl.load(k_row + partner * stride_kd, mask=mask & is_rot, other=0.0).to(tl.float32)
    wp = tl.load(w_row + partner * stride_wd, mask=is_rot, other=0.0).to(tl.float32)
    yp = _round_to(wp * _round_to(xp * inv, IN_DTYPE), NORM_DTYPE)
    c = _round_to(tl.load(cos_ptr + pos * stride_tab + d, mask=is_rot, other=0.0), NORM_DTYPE)
    s = _round_to(tl.load(sin_ptr + pos * stride_tab + d, mask=is_rot, other=0.0), NORM_DTYPE)
    y_rot = _round_to(_round_to(y * c, NORM_DTYPE) + _round_to(sign * yp * s, NORM_DTYPE), NORM_DTYPE)
    out = _round_to(tl.where(is_rot, y_rot, y), CACHE_DTYPE)  # exact in the cache dtype: the
    # store's implicit cast below is exact (the interpreter's truncating cast included)

    # V rows are only copied (cast to the cache dtype)
    vv = tl.load(v_ptr + layer * stride_vl + row * stride_vn + h * stride_vh + d * stride_vd,
                 mask=mask, other=0.0).to(tl.float32)
    vv = _round_to(vv, CACHE_DTYPE)

    # 3. writes at the row's slot of this layer's caches (the static unroll picks the layer's
    # tensor out of the tuple; one branch is taken)
    for i in tl.static_range(NUM_LAYERS):
        if layer == i:
            tl.store(k_caches[i] + slot * stride_kcs + h * stride_kch + d * stride_kcd, out, mask=mask)
            tl.store(v_caches[i] + slot * stride_vcs + h * stride_vch + d * stride_vcd, vv, mask=mask)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key; triton reads the environment)."""
    del interpret
    namespace = jit_functions(__name__, (_round_to, _context_kv_kernel))
    return namespace["_context_kv_kernel"]




def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODE:
        raise TypeError(f"fused_context_kv_ supports float32, bfloat16 and float16, got {dtype}")
    return DTYPE_CODE[dtype]


def _check(k, v, k_norm_weight, cos, sin, positions, slots, kv_caches) -> None:
    num_layers, n, heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if tuple(k_norm_weight.shape) != (num_layers, head_dim):
        raise ValueError(f"k_norm_weight is {tuple(k_norm_weight.shape)}, expected {(num_layers, head_dim)}")
    rot = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"cos/sin must be [positions, rotary_dim] with rotary_dim even and <= "
                         f"{head_dim}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("cos/sin tables must be contiguous along rotary_dim with equal strides")
    if positions.shape != (n,) or slots.shape != (n,):
        raise ValueError(f"positions {tuple(positions.shape)} / slots {tuple(slots.shape)} must be [{n}]")
    if len(kv_caches) != num_layers:
        raise ValueError(f"{len(kv_caches)} cache layers for {num_layers} drafter layers")
    k0, v0 = kv_caches[0]
    if k0.dtype != v0.dtype:
        raise ValueError(f"K cache dtype {k0.dtype} differs from V cache dtype {v0.dtype}")
    for kc, vc in kv_caches:
        for cache, ref in ((kc, k0), (vc, v0)):
            if (cache.dim() != 3 or tuple(cache.shape[1:]) != (heads, head_dim) or cache.dtype != ref.dtype
                    or cache.stride() != ref.stride() or cache.shape != ref.shape):
                raise ValueError("every layer's K (and V) cache must be [num_slots, kv_heads, head_dim] "
                                 "with one shape, dtype and stride")
    tensors = [k, v, k_norm_weight, cos, sin, positions, slots, *(t for pair in kv_caches for t in pair)]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all inputs of fused_context_kv_ must be on one device")


def fused_context_kv_(
    k: torch.Tensor,
    v: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    kv_caches: KVCaches,
) -> None:
    """:func:`context_kv_reference` in ONE Triton launch (same arguments, same in-place writes).

    Grid ``(N, L)``: program ``(n, l)`` loads ``K[l, n]`` ``[kv_heads, head_dim]``, normalises
    each head, rotates it, and stores it and ``V[l, n]`` at ``slots[n]`` of layer ``l``'s caches.
    ``k``/``v``/``slots``/``positions`` may be strided (no copies are made); the caches of all
    layers must share shape, dtype and strides. Supported dtypes: fp32, bf16, fp16. Positions
    must lie inside the tables (not checked on the device, to stay sync-free).
    """
    _check(k, v, k_norm_weight, cos, sin, positions, slots, kv_caches)
    num_layers, n, heads, head_dim = k.shape
    if n == 0 or num_layers == 0:
        return
    import triton

    norm_dtype = torch.promote_types(k_norm_weight.dtype, k.dtype)
    k_caches = tuple(kc for kc, _ in kv_caches)
    v_caches = tuple(vc for _, vc in kv_caches)
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    num_warps = max(1, min(8, block_h * block_d // 256))
    interpret = interpret_mode()
    use_pdl = pdl.active(k.device, interpret)
    kernel = _kernels(interpret)
    kernel[(n, num_layers)](
        k, v, k_norm_weight, cos, sin, positions, slots, k_caches, v_caches,
        *k.stride(), *v.stride(), *k_norm_weight.stride(), cos.stride(0),
        positions.stride(0), slots.stride(0), *k_caches[0].stride(), *v_caches[0].stride(),
        float(eps),
        NUM_LAYERS=num_layers, NUM_HEADS=heads, HEAD_DIM=head_dim, ROT_DIM=cos.shape[-1],
        BLOCK_H=block_h, BLOCK_D=block_d, IN_DTYPE=_dtype_code(k.dtype),
        NORM_DTYPE=_dtype_code(norm_dtype), CACHE_DTYPE=_dtype_code(k_caches[0].dtype),
        PDL=use_pdl, num_warps=num_warps,
        enable_fp_fusion=False,  # no FMA contraction: products and sums round as torch's do
        **pdl.launch_options(use_pdl),
    )
