"""MoE router post-GEMM in one Triton launch: scores, biased top-k, gather, renormalise, scale.

For router logits ``z [T, E]`` (the router GEMM's output), per token ``t``, all in fp32::

    z   = logits[t].float()
    z   = tanh(z / softcap) * softcap               if softcap > 0
    s   = sigmoid(z)          or  sqrt(softplus(z))  (torch softplus: beta 1, threshold 20)
    ids = top_k of (s + bias), in descending order (ties: the lower expert index first)
    w   = s[ids]                                    (the UNBIASED scores)
    w   = w / sum(w)                                if norm_topk_prob
    w   = w * scale

``weights = w.to(logits.dtype)`` and ``ids`` (int64) come back as ``[T, top_k]``; with
``num_shared=1`` one more column per token holds id ``E`` (where a caller stacks the shared
expert after the routed ones) with weight exactly 1.0, so ``[T, top_k + 1]``. This is
``fusion.moe_route`` (the torch reference), plus the routed scaling factor and the shared column.

Why: eagerly the torch chain is about five kernels (sigmoid, ``torch.topk`` = gatherTopK and a
bitonic sort, gather, renormalise) and more for the scale and the shared column; at decode each
costs a few microseconds of GPU time whatever its size. Here it is ONE launch, grid ``(T,)``:

* program ``t`` loads its ``E`` logits as a vector padded to ``BLOCK_E = next_pow2(E)`` (masked;
  ``E <= 1024``) and computes ``s`` and the selection key ``s + bias``;
* selection packs each key into one int64, ``(monotone int32 of the fp32 key) << 32 |
  (BLOCK_E - 1 - e)``, so ONE max-reduction per step yields the largest key and, among equal
  keys, the lowest index; ``top_k`` (a constexpr) steps of "max, decode the index, mask that
  lane out". Padding and taken lanes hold a sentinel below every real key (``-inf`` included,
  so an expert whose bias is ``-inf`` is still picked before a padding lane). A NaN key is
  treated as ``+inf`` (torch.topk ranks NaN first);
* the ``top_k`` chosen logits are re-read (cache-hot) and their scores recomputed, then
  normalised, scaled, rounded to the output dtype and stored with the ids in one vector store.

No host synchronisation, and the launch depends only on the shapes and flags (CUDA-graph
capturable); ``softcap`` and ``scale`` are runtime arguments, not compile-time constants.

Precision: tanh is computed from ``exp`` (libdevice's tanh returns None under Triton's CPU
interpreter in triton 3.6), as Cephes' ``tanhf`` does: an odd polynomial for ``|x| < 0.625``,
``1 - 2 / (exp(2|x|) + 1)`` above (within 2 fp32 ulp of torch.tanh, measured). ``log1p(u)`` for softplus is
``log(1 + u) * u / ((1 + u) - 1)`` (exact to a few ulp with an accurate ``log``, which ``tl.log``
is). Divisions and the square root are correctly rounded (``div_rn``, ``sqrt_rn``) as torch's
(plain ``/`` and ``tl.sqrt`` compile to approximate PTX instructions).
bf16 results are rounded to nearest even on the bits before the store, because the interpreter's
fp32 -> bf16 cast truncates (compiled, the store's cast would round the same way).
With ``kernels.pdl.USE_PDL`` (on by default) the kernel uses programmatic dependent launch:
the bias is loaded before it waits for the router GEMM's logits (kernels/pdl.py).
"""

from __future__ import annotations

import torch

from . import pdl
from .availability import interpret_mode, triton_can_run

try:  # the package must import without triton (CPU-only installs)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["MAX_EXPERTS", "SCORE_FUNCS", "fused_moe_route", "is_available"]

MAX_EXPERTS = 1024
SCORE_FUNCS = ("sigmoid", "sqrtsoftplus")
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_available(device: torch.device | str) -> bool:
    """Whether :func:`fused_moe_route` can run on ``device``: triton importable and either a CUDA
    device of compute capability >= 8.0, or a CPU under ``TRITON_INTERPRET=1``."""
    return triton_can_run(device, min_major=8)


if HAS_TRITON:

    @triton.jit
    def _tanh(x):
        # Cephes tanhf: odd polynomial below 0.625, 1 - 2 / (e^{2|x|} + 1) above (1.0 in fp32 from
        # |x| ~ 9.1 on, so clamping at 20 only keeps exp finite); the sign restored last. NaN stays
        # NaN.
        a = tl.abs(x)
        e2a = tl.exp(2.0 * tl.where(a > 20.0, 20.0, a))  # NaN kept
        big = 1.0 - tl.math.div_rn(tl.full(a.shape, 2.0, tl.float32), e2a + 1.0)
        s = a * a
        p = (((-5.70498872745e-3 * s + 2.06390887954e-2) * s - 5.37397155531e-2) * s
             + 1.33314422036e-1) * s - 3.33332819422e-1
        small = p * s * a + a
        t = tl.where(a < 0.625, small, big)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _scores(z, softcap, HAS_SOFTCAP: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr):
        # fp32 logits -> router scores s (see the module docstring)
        if HAS_SOFTCAP:
            cap = tl.full(z.shape, 1.0, tl.float32) * softcap
            z = _tanh(tl.math.div_rn(z, cap)) * softcap
        if SQRT_SOFTPLUS:
            u = tl.exp(tl.where(z > 20.0, 20.0, z))  # softplus(z) = z above 20: exp stays finite
            w = 1.0 + u
            # log1p(u) = log(w) * u / (w - 1); u / 0 when w == 1 is dropped by the where()
            log1p = tl.where(w == 1.0, u, tl.log(w) * tl.math.div_rn(u, w - 1.0))
            s = tl.math.sqrt_rn(tl.where(z > 20.0, z, log1p))
        else:
            s = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))
        return s

    @triton.jit
    def _round_bf16(x):
        # fp32 -> nearest-even bf16 value, kept in fp32 (torch's cast; exact for the store after)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _moe_route_kernel(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr,
        stride_lt, stride_le, stride_b,
        softcap, scale,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
        NUM_SHARED: tl.constexpr, K_PAD: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr, NORM: tl.constexpr,
        OUT_BF16: tl.constexpr, PDL: tl.constexpr,
    ):
        # program t routes token t; outputs are contiguous [T, TOP_K + NUM_SHARED]
        row = tl.program_id(0).to(tl.int64)
        logits_row = logits_ptr + row * stride_lt
        offs = tl.arange(0, BLOCK_E)
        valid = offs < NUM_EXPERTS
        # the bias is a parameter (no kernel writes it): loaded before the PDL wait
        bias = tl.load(bias_ptr + offs * stride_b, mask=valid, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()  # the logits are the router GEMM's output
        z = tl.load(logits_row + offs * stride_le, mask=valid, other=0.0).to(tl.float32)
        s = _scores(z, softcap, HAS_SOFTCAP, SQRT_SOFTPLUS)
        key = s + bias
        key = tl.where(key != key, float("inf"), key)  # NaN ranks first, as in torch.topk

        # order-preserving int32 of the fp32 key (negative floats: flip the magnitude bits), in
        # the high half; BLOCK_E - 1 - e in the low half, so max() prefers the lower index on
        # ties. The sentinel is below (monotone(-inf) << 32): padding and taken lanes.
        bits = key.to(tl.int32, bitcast=True)
        mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        packed = (mono << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
        packed = tl.where(valid, packed, -9223372036854775807)

        kk = tl.arange(0, K_PAD)
        ids = tl.zeros([K_PAD], dtype=tl.int32)
        for i in range(TOP_K):
            best = tl.max(packed, axis=0)
            idx = BLOCK_E - 1 - (best & (BLOCK_E - 1)).to(tl.int32)
            ids = tl.where(kk == i, idx, ids)
            packed = tl.where(offs == idx, -9223372036854775807, packed)

        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # weights: the unbiased scores of the chosen experts (re-read logits, same math)
        routed = kk < TOP_K
        z_sel = tl.load(logits_row + ids * stride_le, mask=routed, other=0.0).to(tl.float32)
        w = tl.where(routed, _scores(z_sel, softcap, HAS_SOFTCAP, SQRT_SOFTPLUS), 0.0)
        if NORM:
            total = tl.full([K_PAD], 1.0, tl.float32) * tl.sum(w, axis=0)
            w = tl.math.div_rn(w, total)
        w = w * scale
        if NUM_SHARED > 0:  # one shared column: id E, weight 1 (not scaled)
            shared = kk == TOP_K
            w = tl.where(shared, 1.0, w)
            ids = tl.where(shared, NUM_EXPERTS, ids)
        if OUT_BF16:
            w = _round_bf16(w)
        out = row * (TOP_K + NUM_SHARED) + kk
        keep = kk < TOP_K + NUM_SHARED
        tl.store(weights_ptr + out, w, mask=keep)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=keep)


def _check(logits: torch.Tensor, bias: torch.Tensor, top_k: int, softcap: float,
           score_func: str, num_shared: int) -> None:
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r} is not supported; use one of {SCORE_FUNCS}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if logits.dtype not in _OUT_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    e = logits.shape[1]
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"logits has E={e} experts; fused_moe_route supports 1..{MAX_EXPERTS}")
    if tuple(bias.shape) != (e,):
        raise ValueError(f"bias must be [E]=[{e}], got shape {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise ValueError(f"bias must be a float tensor, got {bias.dtype}")
    if bias.device != logits.device:
        raise ValueError(f"bias is on {bias.device}, logits on {logits.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, E={e}], got {top_k!r}")
    if not softcap >= 0:  # also rejects NaN
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap!r}")
    if num_shared not in (0, 1):
        raise ValueError(f"num_shared must be 0 or 1, got {num_shared!r}")


def fused_moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    softcap: float,
    score_func: str,
    norm_topk_prob: bool,
    scale: float = 1.0,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits -> (weights, expert ids) in one Triton launch (math in the module docstring).

    Args:
        logits: ``[T, E]`` router logits, fp32 / bf16 / fp16, any strides; ``1 <= E <= 1024``.
        bias: ``[E]`` selection bias (``e_score_correction_bias``), any float dtype, used in fp32.
        top_k: experts per token, ``1 <= top_k <= E``.
        softcap: logit soft-capping ``tanh(z / softcap) * softcap``; 0 turns it off.
        score_func: ``"sigmoid"`` or ``"sqrtsoftplus"``.
        norm_topk_prob: divide the chosen weights by their sum.
        scale: multiplies the routed weights (the routed scaling factor), after the division.
        num_shared: 0, or 1 to append a shared-expert column (id ``E``, weight 1.0).

    Returns:
        ``(weights [T, top_k + num_shared] in logits.dtype, ids [T, top_k + num_shared] int64)``,
        both contiguous; ids in descending order of ``s + bias`` (ties: lower index first).
        Runs where :func:`is_available` says (CUDA sm80+, or a CPU under the interpreter).
    """
    _check(logits, bias, top_k, softcap, score_func, num_shared)
    t, e = logits.shape
    k_out = top_k + num_shared
    weights = torch.empty((t, k_out), device=logits.device, dtype=logits.dtype)
    ids = torch.empty((t, k_out), device=logits.device, dtype=torch.int64)
    if t == 0:
        return weights, ids
    assert HAS_TRITON, "fused_moe_route needs triton (check is_available first)"
    block_e = triton.next_power_of_2(e)
    use_pdl = pdl.active(logits.device, interpret_mode())
    _moe_route_kernel[(t,)](
        logits, bias, weights, ids,
        logits.stride(0), logits.stride(1), bias.stride(0),
        float(softcap), float(scale),
        NUM_EXPERTS=e, BLOCK_E=block_e, TOP_K=top_k, NUM_SHARED=num_shared,
        K_PAD=triton.next_power_of_2(k_out),
        HAS_SOFTCAP=softcap > 0, SQRT_SOFTPLUS=score_func == "sqrtsoftplus",
        NORM=bool(norm_topk_prob), OUT_BF16=logits.dtype == torch.bfloat16, PDL=use_pdl,
        num_warps=max(1, min(4, block_e // 256)),  # 8 keys a thread; one warp up to E = 256
        **pdl.launch_options(use_pdl),
    )
    return weights, ids
