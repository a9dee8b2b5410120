"""Attention-input post-processing in ONE Triton launch: Q/K RMSNorm + RoPE and the paged K/V write.

After the QKV projection of an attention layer, ``qkv [T, >= (nh + 2 * nkv) * hd]`` holds per
token the ``nh`` Q heads, then the ``nkv`` K heads, then the ``nkv`` V heads, each ``hd`` wide
(columns past the V heads, e.g. a fused gate projection, are not read). What follows in
``Attention.forward`` is elementwise per (token, head) and runs as four kernels eagerly
(``rms_norm_rope`` of Q, of K, and the two ``index_copy_`` of ``write_kv``). Here, with ``x`` one
head row of Q (weight ``w = q_weight``) or K (``w = k_weight``) in dtype ``T``:

1. RMSNorm, statistic in fp32 (``fusion.rms_normalize``)::

       y = T(w * T(x / sqrt(mean(x^2) + eps)))

2. RoPE at ``p = positions[t]``, NeoX rotate-half on the first ``rot`` dims (``fusion._rope``;
   ``half = rot / 2``, the remaining ``hd - rot`` dims pass through)::

       c, s   = T(cos_table[p, d]), T(sin_table[p, d])      # fp32 tables, cast to T
       y'[d]  = T( T(y[d] * c) + T(-y[d + half] * s) )      for d <  half
       y'[d]  = T( T(y[d] * c) + T( y[d - half] * s) )      for half <= d < rot
       y'[d]  = y[d]                                        for d >= rot

3. outputs, ``slot = slot_mapping[t]``, kv head ``g``::

       q[t, h, :]            = y'(Q head h)                # returned, [T, nh, hd] in T
       k_cache[slot, g, :]   = C(y'(K head g))              # C: cast to the cache dtype
       v_cache[slot, g, :]   = C(V head g)

Everything is computed in fp32 without FMA contraction and rounded to ``T`` where torch's eager
ops round, so in fp32 the result differs from ``fusion.rms_norm_rope.eager`` only through the
reduction order of ``mean(x^2)`` (about one ulp), and in bf16 / fp16 by at most one ulp where that
flips a rounding.

Grid ``(T, nh + nkv)``: program ``(t, h)`` handles one head row; ``h < nh`` is Q head ``h``,
otherwise K head ``g = h - nh``, which also copies V head ``g``. The rotate-half partner of each
dim is loaded a second time with shifted offsets (the row is L1-resident). The launch depends only
on shapes and no value is read back on the host, so the call is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import pdl
from .availability import interpret_mode, triton_can_run
from .jit import DTYPE_CODE, _round_to, jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["is_available", "qk_norm_rope_cache"]

# With PDL, a program reads its position, slot, norm weight and cos / sin rows before it waits
# for the QKV GEMM (only the head row itself is that GEMM's output): the position -> table row
# chain no longer follows the wait. False: the wait comes first (the A/B switch).
PRELOAD_PARAMS = True


def is_available(device: torch.device | str) -> bool:
    """Whether :func:`qk_norm_rope_cache` can run on ``device``: triton importable and a CUDA
    device of compute capability >= 8.0, or a CPU under ``TRITON_INTERPRET=1``."""
    return triton_can_run(device, min_major=8)


# ---- Triton kernel --------------------------------------------------------------------------------
#
# Plain Python here; :func:`_kernels` decorates copies bound to a fresh globals dict (as in
# kernels/context_kv.py): triton stays an optional import, and the helpers resolve through that
# dict both compiled and in the CPU interpreter. Triton picks the interpreter from
# ``TRITON_INTERPRET`` when it decorates (and at ``import triton``), so the variable must be set
# before the process imports triton.


def _rope_partner(d, ROT_DIM: tl.constexpr):
    # rotate-half partner of column d: d + half for d < half, d - half for half <= d < rot
    half: tl.constexpr = ROT_DIM // 2
    return tl.where(d < half, d + half, d - half)


def _norm_rope_params(
    w_ptr, stride_wd, cos_rows, sin_rows, rows_ok, d,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, DTYPE: tl.constexpr,
):
    # what RMSNorm + RoPE reads besides the head rows: the norm weight w and its rotate-half
    # partner wp ([1, BLOCK_D]), and the rows' cos / sin rounded to DTYPE ([R, BLOCK_D]; cos_rows /
    # sin_rows point at each row's table row, rows_ok masks rows without a position); fp32. No
    # kernel of the forward writes them (kernels/pdl.py rule 3). d: the columns, [1, BLOCK_D].
    is_rot = d < ROT_DIM
    w = tl.load(w_ptr + d * stride_wd, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + _rope_partner(d, ROT_DIM) * stride_wd, mask=is_rot, other=0.0).to(tl.float32)
    c = _round_to(tl.load(cos_rows + d, mask=is_rot & rows_ok, other=0.0).to(tl.float32), DTYPE)
    s = _round_to(tl.load(sin_rows + d, mask=is_rot & rows_ok, other=0.0).to(tl.float32), DTYPE)
    return w, wp, c, s


def _norm_rope(x, xp, w, wp, c, s, d, eps,
               HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, DTYPE: tl.constexpr):
    # RMSNorm + RoPE (steps 1 and 2 of the module docstring) of head rows x [R, BLOCK_D] (fp32,
    # 0 past HEAD_DIM) whose rotate-half partners are xp (x at _rope_partner(d), 0 past ROT_DIM),
    # with the parameters of _norm_rope_params; fp32 values that are exact in dtype DTYPE.
    half: tl.constexpr = ROT_DIM // 2
    # inv = 1 / sqrt(mean(x^2) + eps), sqrt and division correctly rounded (torch's CPU rsqrt)
    mean_sq = tl.sum(x * x, axis=1)[:, None] * (1.0 / HEAD_DIM)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    y = _round_to(w * _round_to(x * inv, DTYPE), DTYPE)
    sign = tl.where(d < half, -1.0, 1.0)
    yp = _round_to(wp * _round_to(xp * inv, DTYPE), DTYPE)
    y_rot = _round_to(_round_to(y * c, DTYPE) + _round_to(sign * yp * s, DTYPE), DTYPE)
    return tl.where(d < ROT_DIM, y_rot, y)


def _qk_norm_rope_cache_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr,
    stride_xt, stride_xd, stride_qw, stride_kw, stride_cos, stride_sin, stride_pos, stride_slot,
    stride_qt, stride_qh,
    stride_kcs, stride_kch, stride_kcd, stride_vcs, stride_vch, stride_vcd,
    eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr, CACHE_DTYPE: tl.constexpr,
    PDL: tl.constexpr, PRELOAD: tl.constexpr,
):
    # program (t, h): Q head h (h < NUM_HEADS) or K head g = h - NUM_HEADS plus V head g, as one
    # [1, BLOCK_D] row. Q head h and K head g both start at column h * HEAD_DIM; V head g at
    # (h + NUM_KV_HEADS) * HEAD_DIM.
    if PDL and not PRELOAD:  # kernels/pdl.py: wait for the QKV GEMM, then let attention launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)[None, :]
    in_row = d < HEAD_DIM
    is_q = h < NUM_HEADS
    # position, slot, norm weight and cos / sin are no kernel's output in the forward: with
    # PRELOAD read before the wait (through L2, kernels/pdl.py rule 3), the row only after it
    pos = tl.load(pos_ptr + t * stride_pos, cache_modifier=".cg").to(tl.int64)
    slot = tl.load(slot_ptr + t * stride_slot, mask=h >= NUM_HEADS, other=0, cache_modifier=".cg").to(tl.int64)
    w, wp, c, s = _norm_rope_params(tl.where(is_q, qw_ptr, kw_ptr), tl.where(is_q, stride_qw, stride_kw),
                                    cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, True, d,
                                    HEAD_DIM, ROT_DIM, DTYPE)
    if PDL and PRELOAD:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    head_row = qkv_ptr + t * stride_xt + (h * HEAD_DIM) * stride_xd
    x = tl.load(head_row + d * stride_xd, mask=in_row, other=0.0).to(tl.float32)
    xp = tl.load(head_row + _rope_partner(d, ROT_DIM) * stride_xd, mask=d < ROT_DIM,
                 other=0.0).to(tl.float32)
    out = _norm_rope(x, xp, w, wp, c, s, d, eps, HEAD_DIM, ROT_DIM, DTYPE)
    if is_q:
        # exact in the output dtype: the store's implicit cast is exact (interpreter included)
        tl.store(q_ptr + t * stride_qt + h * stride_qh + d, out, mask=in_row)
    else:
        g = h - NUM_HEADS
        out = _round_to(out, CACHE_DTYPE)
        tl.store(kc_ptr + slot * stride_kcs + g * stride_kch + d * stride_kcd, out, mask=in_row)
        v = tl.load(qkv_ptr + t * stride_xt + ((h + NUM_KV_HEADS) * HEAD_DIM + d) * stride_xd,
                    mask=in_row, other=0.0).to(tl.float32)
        v = _round_to(v, CACHE_DTYPE)
        tl.store(vc_ptr + slot * stride_vcs + g * stride_vch + d * stride_vcd, v, mask=in_row)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key; triton reads the environment)."""
    del interpret
    namespace = jit_functions(__name__, (_round_to, _rope_partner, _norm_rope_params, _norm_rope,
                                         _qk_norm_rope_cache_kernel))
    return namespace["_qk_norm_rope_cache_kernel"]




def _check(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, rot: int, slot_mapping: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> None:
    """ValueError naming the argument for every input the kernel cannot take."""
    _check_heads(num_heads, num_kv_heads, head_dim)
    if qkv.dtype not in DTYPE_CODE:
        raise ValueError(f"qkv must be float32, bfloat16 or float16, got {qkv.dtype}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] < width:
        raise ValueError(f"qkv must be [T, >= (num_heads + 2 * num_kv_heads) * head_dim = {width}], "
                         f"got {tuple(qkv.shape)}")
    _check_norm_rope_cache("qkv", qkv, num_kv_heads, head_dim, q_weight, k_weight, cos_table,
                           sin_table, positions, rot, slot_mapping, k_cache, v_cache)


def _check_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_norm_rope_cache(
    src_name: str, src: torch.Tensor, num_kv_heads: int, head_dim: int,
    q_weight: torch.Tensor, k_weight: torch.Tensor, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, rot: int, slot_mapping: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
) -> None:
    # everything but the head rows' source src ([T, ...], the kernel's dtype and device), whose
    # name the messages use
    t = src.shape[0]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}], got {tuple(w.shape)}")
        if w.dtype != src.dtype:
            raise ValueError(f"{name} dtype {w.dtype} must equal {src_name}'s {src.dtype}")
    if not isinstance(rot, int) or rot <= 0 or rot % 2 or rot > head_dim:
        raise ValueError(f"rot must be an even int in (0, head_dim={head_dim}], got {rot!r}")
    for name, tab in (("cos_table", cos_table), ("sin_table", sin_table)):
        if tab.dim() != 2 or tab.shape[1] != rot or tab.dtype != torch.float32:
            raise ValueError(f"{name} must be [max_pos, rot={rot}] float32, got "
                             f"{tuple(tab.shape)} {tab.dtype}")
        if tab.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if tuple(idx.shape) != (t,) or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be [T={t}] int64 (or int32), got "
                             f"{tuple(idx.shape)} {idx.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or tuple(cache.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_slots, num_kv_heads={num_kv_heads}, "
                             f"head_dim={head_dim}], got {tuple(cache.shape)}")
        if cache.dtype not in DTYPE_CODE:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {cache.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} differs from v_cache dtype {v_cache.dtype}")
    tensors = (src, q_weight, k_weight, cos_table, sin_table, positions, slot_mapping, k_cache,
               v_cache)
    if len({x.device for x in tensors}) != 1:
        raise ValueError(f"{src_name}, weights, tables, positions, slot_mapping and caches must be "
                         "on one device")


def qk_norm_rope_cache(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    rot: int,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Q/K per-head RMSNorm + RoPE and the K/V cache write in one launch (module docstring math).

    Args:
        qkv: ``[T, >= (num_heads + 2 * num_kv_heads) * head_dim]`` fp32 / bf16 / fp16, any
            strides (e.g. a column slice of a wider GEMM output); columns Q heads, K heads,
            V heads, each ``head_dim`` wide; later columns are ignored.
        num_heads, num_kv_heads, head_dim: head layout of ``qkv``.
        q_weight, k_weight: ``[head_dim]`` RMSNorm weights, ``qkv``'s dtype.
        eps: RMSNorm epsilon.
        cos_table, sin_table: ``[max_pos, rot]`` fp32 (``RotaryEmbedding.cos/sin``), last dim
            contiguous. Positions must lie inside them (not checked on the device: no sync).
        positions: ``[T]`` int64 (or int32) token positions.
        rot: rotary dims, even, ``0 < rot <= head_dim``; dims ``>= rot`` pass through.
        slot_mapping: ``[T]`` int64 (or int32) cache slots, in range (not checked on the device).
        k_cache, v_cache: ``[num_slots, num_kv_heads, head_dim]`` fp32 / bf16 / fp16 (one dtype,
            any strides); values are cast to it on store.

    Returns:
        ``q [T, num_heads, head_dim]`` contiguous in ``qkv.dtype`` (= ``fusion.rms_norm_rope`` of
        the Q heads). Writes ``k_cache[slot_mapping[t], g]`` (normed, rotated K) and
        ``v_cache[slot_mapping[t], g]`` (V) for every token ``t`` and kv head ``g``; nothing else.

    Raises:
        ValueError: on a shape, dtype, ``rot`` or device the kernel does not take.
    """
    _check(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, cos_table, sin_table,
           positions, rot, slot_mapping, k_cache, v_cache)
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    import triton

    block_d = triton.next_power_of_2(head_dim)
    interpret = interpret_mode()
    use_pdl = pdl.active(qkv.device, interpret)
    kernel = _kernels(interpret)
    kernel[(t, num_heads + num_kv_heads)](
        qkv, q_weight, k_weight, cos_table, sin_table, positions, slot_mapping, q,
        k_cache, v_cache,
        qkv.stride(0), qkv.stride(1), q_weight.stride(0), k_weight.stride(0),
        cos_table.stride(0), sin_table.stride(0), positions.stride(0), slot_mapping.stride(0),
        q.stride(0), q.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        float(eps),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROT_DIM=rot,
        BLOCK_D=block_d, DTYPE=DTYPE_CODE[qkv.dtype], CACHE_DTYPE=DTYPE_CODE[k_cache.dtype],
        PDL=use_pdl, PRELOAD=PRELOAD_PARAMS, num_warps=max(1, min(4, block_d // 128)),
        enable_fp_fusion=False,  # no FMA contraction: products and sums round as torch's do
        **pdl.launch_options(use_pdl),
    )
    return q
