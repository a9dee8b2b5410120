"""Residual add + RMSNorm of a decoder layer in ONE Triton launch, programmatic-dependent-launch capable.

Between the GEMMs of a decode step a layer runs two elementwise chains: the residual add after
attention followed by the post-attention RMSNorm, and the residual add of the MoE's weighted
pairs followed by the next layer's input RMSNorm (``fusion.add_rms_norm``). ``torch.compile``
makes one kernel of each, but those are normal launches: in a CUDA graph whose other kernels use
programmatic dependent launch (kernels/pdl.py) every normal launch drains the pipeline, twice per
layer. This kernel computes the same chains and takes part in PDL. Per row ``t`` in dtype ``T``::

    s = T(h[t] + delta[t])                           delta [T, H]     (one add, as torch's)
    s = T(((h[t] + d[t, 0]) + d[t, 1]) + ...)        delta [T, P, H]  (in fp32, rounded once)
    s = h[t]                                         no delta (a plain RMSNorm)
    y = T(w * T(s / sqrt(mean(s^2) + eps)))          statistic in fp32 (fusion.rms_normalize)

with ``w`` the weight ``[H]``, or row ``t % G`` of a grouped weight ``[G, H]`` (rows that
interleave G groups, e.g. ``[N, G * H]`` taps viewed as ``[N * G, H]``), or 1 (``unit_weight``:
``y = T(s / sqrt(mean(s^2) + eps))``, fusion.rms_normalize itself),

and writes ``s`` (the new residual stream) and/or ``y`` (the normed input of the next GEMM).
Products, sums, the square root and the divisions are correctly rounded fp32 without FMA
contraction, rounded to ``T`` where torch's eager ops round; so the result differs from
``fusion.add_rms_norm.eager`` only through the summation order of ``mean(s^2)`` (in bf16 that
flips a rounding of ``y`` in well under 1% of the elements).

Grid ``(T,)``: one program per row, the whole row in registers (``H <= MAX_HIDDEN``). The launch
depends only on shapes and nothing is read back on the host: CUDA-graph capturable. Under PDL
a program loads the weight row (a parameter, kept in L2 with ``evict_last``), then waits for its
predecessor before it loads ``h`` or ``delta``, and signals its dependents right after the wait.
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

__all__ = ["MAX_HIDDEN", "add_rms_norm", "can_run", "is_available"]

MAX_HIDDEN = 16384  # one row in one program's registers
_NO_DELTA = -1  # NUM_PAIRS codes: -1 no delta, 0 delta [T, H], P > 0 pairs [T, P, H]
# Warps a program (1, 2, 4, 8 or 16); None: 16 values a thread (4 warps at H = 2048). The
# kernel is latency-bound at decode (one program, ~2 us of a layer's span per launch); more
# warps shorten each thread's load and FMA chains but lengthen the cross-warp reduction. The
# summation order of mean(s^2) follows the warp count. In the graphs on the H200 (an A/B knob):
# 8 warps replayed decode in 2.02 against 2.03 ms and the 4-token verify in 3.67 against
# 3.68-3.69 (within noise), 2 warps 2.08 and 3.73 (docs/PERFORMANCE.md, fifty-ninth pass).
NUM_WARPS: int | None = None


def is_available(device: torch.device | str) -> bool:
    """Triton importable and a CUDA device of compute capability >= 8.0, or a CPU under
    ``TRITON_INTERPRET=1``."""
    return triton_can_run(device, min_major=8)


def _add_rms_norm_kernel(
    h_ptr, d_ptr, w_ptr, res_ptr, out_ptr,
    stride_ht, stride_dt, stride_dp, stride_rt, stride_ot, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, NUM_PAIRS: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr, WRITE_NORM: tl.constexpr, DTYPE: tl.constexpr,
    PDL: tl.constexpr, NUM_WEIGHT_ROWS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    in_row = i < HIDDEN
    if WRITE_NORM and NUM_WEIGHT_ROWS > 0:  # a parameter no kernel writes: loaded before the wait
        # (kernels/pdl.py rule 3); row t % G of a grouped [G, H] weight (contiguous rows)
        w = tl.load(w_ptr + (t % NUM_WEIGHT_ROWS) * HIDDEN + i, mask=in_row, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
    if PDL:  # kernels/pdl.py: wait for the kernel writing delta, then let the next GEMM launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.load(h_ptr + t * stride_ht + i, mask=in_row, other=0.0).to(tl.float32)
    if NUM_PAIRS == 0:
        s = _round_to(s + tl.load(d_ptr + t * stride_dt + i, mask=in_row, other=0.0).to(tl.float32),
                      DTYPE)
    elif NUM_PAIRS > 0:
        for p in tl.static_range(NUM_PAIRS):  # the pairs in order, as fusion._add sums them
            s += tl.load(d_ptr + t * stride_dt + p * stride_dp + i, mask=in_row,
                         other=0.0).to(tl.float32)
        s = _round_to(s, DTYPE)
    if WRITE_RESIDUAL:
        tl.store(res_ptr + t * stride_rt + i, s, mask=in_row)
    if WRITE_NORM:
        mean_sq = tl.math.div_rn(tl.sum(s * s, axis=0), HIDDEN * 1.0)
        inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
        y = _round_to(s * inv, DTYPE)
        if NUM_WEIGHT_ROWS > 0:
            y = _round_to(w * y, DTYPE)
        tl.store(out_ptr + t * stride_ot + i, y, mask=in_row)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key; triton reads the environment)."""
    del interpret
    return jit_functions(__name__, (_round_to, _add_rms_norm_kernel))["_add_rms_norm_kernel"]


def _operand_problem(h: torch.Tensor, delta: torch.Tensor | None,
                     weight: torch.Tensor | None) -> str | None:
    """What about the operands the kernel cannot take, naming the argument; None if nothing."""
    if h.dim() != 2 or h.dtype not in DTYPE_CODE:
        return f"h must be [T, H] float32 / bfloat16 / float16, got {tuple(h.shape)} {h.dtype}"
    t, hidden = h.shape
    if hidden > MAX_HIDDEN or h.stride(1) != 1:
        return f"h must have H <= {MAX_HIDDEN} and unit stride along H, got {tuple(h.shape)}"
    if delta is not None and (delta.dtype != h.dtype or delta.device != h.device
                              or delta.dim() not in (2, 3) or delta.shape[0] != t
                              or delta.shape[-1] != hidden or delta.stride(-1) != 1):
        return (f"delta must be None, [T, H] or [T, P, H] with T={t}, H={hidden}, h's dtype "
                f"{h.dtype} and unit stride along H, got {tuple(delta.shape)} {delta.dtype}")
    # a weight of another dtype promotes torch's product (not this kernel's rounding)
    if weight is not None and (weight.dim() not in (1, 2) or weight.shape[-1] != hidden
                               or weight.dtype != h.dtype or weight.device != h.device
                               or not weight.is_contiguous() or weight.numel() == 0):
        return (f"weight must be None, [H={hidden}] or grouped [G, H={hidden}], contiguous in h's "
                f"dtype {h.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    return None


def can_run(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None) -> bool:
    """Whether :func:`add_rms_norm` takes these operands here (else the caller runs its
    reference): ``h [T, H]`` with ``H <= MAX_HIDDEN`` and unit stride along H, ``delta`` None /
    ``[T, H]`` / ``[T, P, H]`` of h's dtype with unit stride along H, ``weight`` None / ``[H]``
    / ``[G, H]`` contiguous of h's dtype, and :func:`is_available` on h's device."""
    return _operand_problem(h, delta, weight) is None and is_available(h.device)


def _num_warps(block: int) -> int:
    # NUM_WARPS, or 16 values a thread (at most 8 warps)
    if NUM_WARPS is None:
        return max(1, min(8, block // 512))
    if isinstance(NUM_WARPS, bool) or NUM_WARPS not in (1, 2, 4, 8, 16):
        raise ValueError(f"add_rms_norm.NUM_WARPS must be None or 1, 2, 4, 8 or 16, got {NUM_WARPS!r}")
    return NUM_WARPS


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
    unit_weight: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(s, y)`` of the module docstring in one launch.

    Args:
        h: ``[T, H]`` residual stream, fp32 / bf16 / fp16, unit stride along H.
        delta: None, ``[T, H]`` (a sublayer's output) or ``[T, P, H]`` (the MoE's weighted
            pairs), h's dtype, unit stride along H.
        weight: ``[H]`` RMSNorm weight in h's dtype, ``[G, H]`` (row ``t`` normed with weight row
            ``t % G``), or None: no norm (only the sum), unless ``unit_weight``.
        eps: RMSNorm epsilon.
        unit_weight: with ``weight`` None, the norm without a weight (``fusion.rms_normalize``).

    Returns:
        ``(s [T, H], y [T, H])``, new contiguous tensors in h's dtype; ``s`` is None when
        ``delta`` is None (it would be ``h``), ``y`` is None when ``weight`` is None and
        ``unit_weight`` is False.

    Raises:
        ValueError: on operands the kernel does not take (naming the argument), with neither a
            delta nor a norm, with both a weight and ``unit_weight``, or where
            :func:`is_available` does not hold.
    """
    problem = _operand_problem(h, delta, weight)
    if problem is not None:
        raise ValueError(f"add_rms_norm: {problem} (fusion.add_rms_norm takes any operands)")
    if weight is not None and unit_weight:
        raise ValueError("add_rms_norm: pass a weight or unit_weight=True, not both")
    write_norm = weight is not None or unit_weight
    if delta is None and not write_norm:
        raise ValueError("add_rms_norm needs a delta, a weight (or unit_weight=True) or both")
    t, hidden = h.shape
    res = torch.empty_like(h, memory_format=torch.contiguous_format) if delta is not None else None
    out = torch.empty_like(h, memory_format=torch.contiguous_format) if write_norm else None
    if t == 0:
        return res, out
    if not is_available(h.device):
        raise ValueError(f"add_rms_norm cannot run on {h.device}: it needs triton and a CUDA GPU "
                         f"(sm80+) or TRITON_INTERPRET=1 on a CPU; use fusion.add_rms_norm")
    import triton

    interpret = interpret_mode()
    use_pdl = pdl.active(h.device, interpret)
    num_pairs = _NO_DELTA if delta is None else (0 if delta.dim() == 2 else delta.shape[1])
    block = triton.next_power_of_2(hidden)
    _kernels(interpret)[(t,)](
        h, h if delta is None else delta, h if weight is None else weight,
        h if res is None else res, h if out is None else out,
        h.stride(0), 0 if delta is None else delta.stride(0),
        delta.stride(1) if num_pairs > 0 else 0,
        0 if res is None else res.stride(0), 0 if out is None else out.stride(0), float(eps),
        HIDDEN=hidden, BLOCK=block, NUM_PAIRS=num_pairs, WRITE_RESIDUAL=res is not None,
        WRITE_NORM=out is not None, DTYPE=DTYPE_CODE[h.dtype], PDL=use_pdl,
        NUM_WEIGHT_ROWS=0 if weight is None else (1 if weight.dim() == 1 else weight.shape[0]),
        num_warps=_num_warps(block),
        enable_fp_fusion=False,  # no FMA contraction: products and sums round as torch's do
        **pdl.launch_options(use_pdl),
    )
    return res, out
