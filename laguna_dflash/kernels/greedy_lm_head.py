"""Greedy tokens through an int8 copy of the lm_head: the exact argmax, about half the bytes.

A greedy step needs only ``argmax_v logits[v]``, not the logits. At batch 1 the lm_head's
weight (``[V, H]``, 411 MB at Laguna-XS-2.1 size in bf16) is ~7% of a decode step's bytes, and
its GEMM runs at the copy bandwidth. Here the step streams a per-row int8 copy instead (half the
bytes) and reads the full-precision rows only for the few tokens the int8 logits cannot rule out.
The result is the argmax of the full-precision logits, bit for bit: nothing is approximated.

For a row ``x [H]`` of the final-normed hidden state and vocabulary row ``w_v``:

* ``q_v = round(w_v / s_v)``, ``s_v = max|w_v| / 127`` (:func:`quantize`, once); the error norm
  ``err_v >= ||w_v - s_v q_v||_2`` and ``norm_v >= ||w_v||_2`` are kept (fp32, rounded up).
* ``i_v``: the int8 logit, ``s_v * sum_k x_k q_vk`` (``skinny_gemm`` with ``scale=``: exact
  products, fp32 sums), rounded to x's dtype.
* ``e_v``: the exact logit, ``sum_k x_k w_vk`` in fp32 (this module's last kernel), rounded to
  x's dtype. These are the logits whose argmax the step returns.
* Bound: ``|e_v - i_v| <= B_v = c (err_v + slack norm_v) + 2^-7 |i_v|``, ``c = 1.001 ||x||_2``.
  Cauchy-Schwarz gives ``||x|| err_v`` for the quantization. ``slack`` (:func:`slack`: 1e-3 up
  to K = 3355, then ``1.25 K 2^-22``) covers the fp32 sums of both logits, whatever their order
  or the tensor cores' alignment: at most ``K 2^-23 ||x|| ||w_v||`` each (4.9e-4 for both at
  K = 2048). The last term covers rounding ``i_v`` to x's dtype.
* ``lo = max_v (i_v - B_v) <= max_v e_v <= hi = max_v (i_v + B_v)``, so
  ``mag = max(|lo|, |hi|) >= |max_v e_v|``. A token is a candidate when
  ``i_v + B_v >= lo - 2^-6 mag``. Every other token has
  ``e_v < max e - 2^-6 |max e|``. That is at least two units in the last place of the
  output dtype (bf16 / fp16) below the maximum, so its rounded logit is strictly below the
  maximum's. The argmax of the candidates' rounded exact logits, lowest index on ties, is
  therefore ``torch.argmax`` over all the exact logits.
* A row whose ``x`` or int8 logits hold a NaN or an infinity takes every token as a candidate
  (the full-precision lm_head for that row; NaN first, as ``torch.argmax`` ranks it).

With random Gaussian weights at XS-2.1 size ``B_v`` is about a third of the logits' spread: 9-45
candidates a row in 100352 tokens (39-80 at S-2.1's width), counted by
:func:`candidates_reference` in ``benchmarks/bench_greedy_lm_head.py``. A trained head's peaked
logits leave fewer: on the embedded demo target (4096 x 256) a median of 1 and at most 9 a step,
against 3 and 16 for Gaussian weights of that shape (``benchmarks/count_greedy_candidates.py``).

Launches (eager: the lm_head runs outside the CUDA graphs, engine/engine.py):

1. the int8 GEMM (``skinny_gemm``: its int8 table, else the e4m3 table's tiles: same bytes);
2. ``_bounds_kernel``, grid ``(M, V / CHUNK)``: ``c`` and the chunk's ``lo`` / ``hi``;
3. ``_exact_kernel``, grid ``(M, V / EXACT_CHUNK)``: the row's threshold from the bounds'
   chunks, then its candidates in token order, one whole weight row a candidate (a loop whose
   trip count is the candidate count), and the chunk's (max, first index), as
   ``kernels/argmax.py``'s chunk kernel gives them, NaN included;
4. ``argmax``'s finish kernel over the chunks (and, with ``also_into``, the tokens stored a
   second time: the decode graph's input ids, engine/cuda_graph.py's ``decode_ids``).

With ``kernels.pdl.USE_PDL`` (sm90+) all four are programmatic dependent launches
(kernels/pdl.py's rules): each launches while the one before drains, and reads only the
copy's bounds before its wait.

Runs on CUDA, and on the CPU under Triton's interpreter (the tests). For bf16 / fp16 weights
only: an fp32 model's logits would need another tie margin, so it keeps the full GEMM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import argmax as _argmax
from . import pdl
from . import skinny_gemm as _sg
from .availability import interpret_mode, triton_can_run
from .jit import DTYPE_CODE, _round_to, jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["Int8LmHead", "can_use", "candidates_reference", "greedy_tokens", "greedy_tokens_reference",
           "quantize", "slack"]

MAX_M = 16  # rows a call (the skinny GEMM's)
SLACK = 1e-3  # the least slack for the fp32 sums' error, relative to ||x|| ||w_v|| (module docstring)
CHUNK = 2048  # tokens a program of the bounds kernel
# tokens a program of the exact kernel (a power of two; its candidates are a serial loop, so a
# smaller chunk shortens the longest loop, for more programs). On H100s with Gaussian weights
# (at most 3 candidates a 2048-token chunk, 2 a 256-token one) 256 was 0.1-1.3 us faster than
# 2048 a call in three runs (docs/PERFORMANCE.md, eightieth pass): the three small launches
# cost ~9-11 us whatever the chunk. Kept for flatter logits, whose candidates would crowd.
EXACT_CHUNK = 256
# The bounds, exact and finish launches as programmatic dependent launches where kernels.pdl
# is active (module docstring); False: plain launches (the A/B baseline).
USE_PDL = True
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Int8LmHead:
    """A per-row int8 copy of an lm_head weight ``[V, H]`` and its error bounds (:func:`quantize`).

    Attributes:
        q: ``[V, H]`` int8, ``round(w_v / scale_v)`` in ``[-127, 127]``.
        scale: ``[V]`` fp32, ``max|w_v| / 127`` (1 for an all-zero row).
        err: ``[V]`` fp32, at least ``||w_v - scale_v q_v||_2``.
        norm: ``[V]`` fp32, at least ``||w_v||_2``.
    """

    q: torch.Tensor
    scale: torch.Tensor
    err: torch.Tensor
    norm: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.err, self.norm))


def _round_up_f32(v: torch.Tensor) -> torch.Tensor:
    # float64 -> the smallest float32 >= v
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.full_like(f, float("inf"))), f)


@torch.no_grad()
def quantize(weight: torch.Tensor, rows_per_step: int = 8192) -> Int8LmHead:
    """The int8 copy of ``weight [V, H]`` (bf16 / fp16) and its bounds, on its device, a block of
    ``rows_per_step`` rows at a time (the float64 norms of one block at most in memory)."""
    if weight.dim() != 2 or weight.dtype not in _DTYPES:
        raise ValueError(f"weight must be [V, H] bf16 / fp16, got {tuple(weight.shape)} {weight.dtype}")
    v, h = weight.shape
    q = torch.empty((v, h), dtype=torch.int8, device=weight.device)
    scale = torch.empty(v, dtype=torch.float32, device=weight.device)
    err = torch.empty(v, dtype=torch.float32, device=weight.device)
    norm = torch.empty(v, dtype=torch.float32, device=weight.device)
    for r0 in range(0, v, rows_per_step):
        w = weight[r0 : r0 + rows_per_step].float()
        s = w.abs().amax(dim=1) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        qi = torch.clamp(torch.round(w / s[:, None]), -127, 127)
        q[r0 : r0 + rows_per_step] = qi.to(torch.int8)
        scale[r0 : r0 + rows_per_step] = s
        w64 = w.double()
        err[r0 : r0 + rows_per_step] = _round_up_f32((w64 - s.double()[:, None] * qi.double()).norm(dim=1))
        norm[r0 : r0 + rows_per_step] = _round_up_f32(w64.norm(dim=1))
    return Int8LmHead(q, scale, err, norm)


def can_use(x: torch.Tensor, weight: torch.Tensor, head: Int8LmHead | None) -> bool:
    """Whether :func:`greedy_tokens` takes ``x [M, H]`` here: a copy of ``weight``, ``1 <= M <=
    16``, bf16 / fp16 of weight's dtype with unit column stride, contiguous weight, where the
    skinny GEMM runs (CUDA, or the CPU under the interpreter)."""
    return (
        head is not None and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and weight.dim() == 2
        and x.dtype in _DTYPES and weight.dtype == x.dtype and weight.is_contiguous()
        and x.shape[1] == weight.shape[1] and head.q.shape == weight.shape and x.stride(1) == 1
        and x.device == weight.device == head.q.device
        and _sg.can_use(x, head.q, head.scale) and triton_can_run(x.device)
    )


def greedy_tokens_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.argmax`` of ``x @ weight^T`` rounded to x's dtype (float64 sums): what
    :func:`greedy_tokens` returns up to the fp32 summation order of the logits."""
    return torch.argmax((x.double() @ weight.double().T).to(x.dtype), dim=-1)


# ---- Triton kernels ---------------------------------------------------------------------------------


def _chunk_start(err_ptr, norm_ptr, c, V, SLACK: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    # a program's tokens [c CHUNK, (c+1) CHUNK), which are in the vocabulary, and their
    # err + SLACK norm (the copy's bounds, never written: read before the PDL wait); then the
    # wait and the signal (kernels/pdl.py's rules 1 and 2)
    offs_v = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ok = offs_v < V
    bound = tl.load(err_ptr + offs_v, mask=ok, other=0.0) + SLACK * tl.load(norm_ptr + offs_v, mask=ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    return offs_v, ok, bound


def _bounds_kernel(x_ptr, i_ptr, err_ptr, norm_ptr, lo_ptr, hi_ptr, cx_ptr, V, stride_xm, stride_im,
                   num_chunks, SLACK: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr,
                   CHUNK: tl.constexpr, PDL: tl.constexpr):
    # program (m, c): c = 1.001 ||x_m|| (stored by chunk 0) and, over tokens [c CHUNK, (c+1) CHUNK),
    # lo = max(i - B), hi = max(i + B); lo = -inf where x_m or an int8 logit is not finite
    # (every token a candidate). PDL: the copy's bounds (never written) are read before the wait
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_v, ok, bound = _chunk_start(err_ptr, norm_ptr, c, V, SLACK, CHUNK, PDL)
    offs_h = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + m * stride_xm + offs_h, mask=offs_h < K, other=0.0).to(tl.float32)
    finite = tl.min((tl.abs(x) < float("inf")).to(tl.int32), 0)  # 0: a NaN or an infinity
    cx = 1.001 * tl.math.sqrt_rn(tl.sum(x * x, 0))
    i = tl.load(i_ptr + m * stride_im + offs_v, mask=ok, other=0.0).to(tl.float32)
    b = cx * bound + 0.0078125 * tl.abs(i)  # 2^-7 |i|: i's rounding to x's dtype
    finite = tl.minimum(finite, tl.min(tl.where(ok, (tl.abs(i) < float("inf")).to(tl.int32), 1), 0))
    lo = tl.max(tl.where(ok, i - b, float("-inf")), 0)
    hi = tl.max(tl.where(ok, i + b, float("-inf")), 0)
    tl.store(lo_ptr + m * num_chunks + c, tl.where(finite > 0, lo, float("-inf")))
    tl.store(hi_ptr + m * num_chunks + c, hi)
    if c == 0:
        tl.store(cx_ptr + m, cx)


def _exact_kernel(x_ptr, w_ptr, i_ptr, err_ptr, norm_ptr, lo_ptr, hi_ptr, cx_ptr, part_v_ptr, part_i_ptr,
                  V, stride_xm, stride_w, stride_im, num_bound_chunks, num_chunks,
                  SLACK: tl.constexpr, K: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_B: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr):
    # program (m, c): the candidates among tokens [c CHUNK, (c+1) CHUNK), one whole weight row
    # each in token order (a row is one load a thread: candidates are few, so the loop's trip
    # count, not its loads, is short); their exact logits rounded to DTYPE; the chunk's (max,
    # first index of it), or (NaN, first NaN's index) as argmax's chunk kernel, or (-inf, the
    # chunk's first token) without a candidate. lo / hi: the bounds kernel's num_bound_chunks
    # partials a row. PDL: the copy's bounds (never written) are read before the wait
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_v, ok, bound = _chunk_start(err_ptr, norm_ptr, c, V, SLACK, CHUNK, PDL)
    offs_c = tl.arange(0, BLOCK_B)
    ok_c = offs_c < num_bound_chunks
    lo = tl.max(tl.load(lo_ptr + m * num_bound_chunks + offs_c, mask=ok_c, other=float("-inf")), 0)
    hi = tl.max(tl.load(hi_ptr + m * num_bound_chunks + offs_c, mask=ok_c, other=float("-inf")), 0)
    mag = tl.maximum(tl.abs(lo), tl.abs(hi))  # >= |the maximal logit|, in [lo, hi]
    threshold = lo - 0.015625 * mag  # 2^-6 mag: two units in the last place of the maximum
    cx = tl.load(cx_ptr + m)
    i = tl.load(i_ptr + m * stride_im + offs_v, mask=ok, other=0.0).to(tl.float32)
    b = cx * bound + 0.0078125 * tl.abs(i)
    # lo = -inf: a row with a NaN or an infinity (_bounds_kernel), every token a candidate
    every = (lo == float("-inf")).to(tl.int32)
    left = tl.where(ok, tl.maximum((i + b >= threshold).to(tl.int32), every), 0)
    offs_h = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + m * stride_xm + offs_h, mask=offs_h < K, other=0.0).to(tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_at = c.to(tl.int64) * CHUNK
    found_nan = tl.full([], 0, tl.int32)
    while tl.max(left, 0) > 0:
        v = tl.min(tl.where(left > 0, offs_v, V), 0)  # the next candidate, in token order
        left = tl.where(offs_v == v, 0, left)
        w = tl.load(w_ptr + v * stride_w + offs_h, mask=offs_h < K, other=0.0).to(tl.float32)
        e = _round_to(tl.sum(w * x, 0), DTYPE)
        # a NaN wins (the first one), else a strictly larger logit (the first maximal index)
        take = (found_nan == 0) & ((e != e) | (e > best))
        best = tl.where(take, e, best)
        best_at = tl.where(take, v, best_at)
        found_nan = tl.where(e != e, 1, found_nan)
    tl.store(part_v_ptr + m * num_chunks + c, best)
    tl.store(part_i_ptr + m * num_chunks + c, best_at)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """(bounds kernel, exact kernel) for one mode (``interpret`` is the cache key)."""
    del interpret
    ns = jit_functions(__name__, (_round_to, _chunk_start, _bounds_kernel, _exact_kernel))
    return ns["_bounds_kernel"], ns["_exact_kernel"]


def candidates_reference(x: torch.Tensor, head: Int8LmHead) -> torch.Tensor:
    """``[M, V]`` bool: the tokens whose full-precision rows :func:`greedy_tokens` reads for ``x
    [M, H]``, by the module docstring's bound in torch (the int8 logits summed in float64, so a
    token at the threshold may differ from the kernels' choice; a diagnostic: how many rows the
    exact pass reads)."""
    h = x.shape[1]
    i = ((x.double() @ head.q.double().T) * head.scale.double()).to(x.dtype).double()  # [M, V]
    cx = 1.001 * x.double().norm(dim=1, keepdim=True)
    b = cx * (head.err.double() + slack(h) * head.norm.double()) + 2.0**-7 * i.abs()
    lo = (i - b).max(dim=1, keepdim=True).values
    hi = (i + b).max(dim=1, keepdim=True).values
    threshold = lo - 2.0**-6 * torch.maximum(lo.abs(), hi.abs())
    every = ~torch.isfinite(x.double()).all(dim=1, keepdim=True) | ~torch.isfinite(i).all(dim=1, keepdim=True)
    return (i + b >= threshold) | every


def slack(k: int) -> float:
    """The bound's allowance for the fp32 sums of both logits over ``k`` terms, relative to
    ``||x|| ||w_v||``: ``k 2^-23`` each at worst (serial round-to-nearest is half that), with a
    quarter more, and never under :data:`SLACK`."""
    return max(SLACK, 1.25 * k * 2.0**-22)


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def greedy_tokens(x: torch.Tensor, weight: torch.Tensor, head: Int8LmHead,
                  also_into: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax`` over the logits ``x @ weight^T`` (fp32 sums, rounded to x's dtype), each
    row's, through the int8 copy ``head`` (module docstring) -> ``[M]`` int64.

    Args:
        x: ``[M, H]`` bf16 / fp16 (the final-normed hidden states), ``1 <= M <= 16``.
        weight: ``[V, H]`` contiguous, x's dtype: the lm_head weight ``head`` was made from.
        head: :func:`quantize` ``(weight)``.
        also_into: ``[M]`` int64 contiguous on x's device, or None: the finish kernel stores the
            tokens there too (a CUDA graph's input ids: no copy launch after it).

    Raises:
        ValueError: where :func:`can_use` does not hold, or ``also_into`` is not ``[M]`` int64
            contiguous on x's device.
    """
    if not can_use(x, weight, head):
        raise ValueError(f"greedy_tokens takes x [1..{MAX_M}, H] bf16 / fp16 of weight's dtype with "
                         f"weight's int8 copy, on a device Triton runs on; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}: use the lm_head GEMM and argmax")
    if also_into is not None and (also_into.shape != (x.shape[0],) or also_into.dtype != torch.int64
                                  or not also_into.is_contiguous() or also_into.device != x.device):
        raise ValueError(f"also_into must be [{x.shape[0]}] int64 contiguous on {x.device}, got "
                         f"{tuple(also_into.shape)} {also_into.dtype} on {also_into.device}")
    m, h = x.shape
    v = weight.shape[0]
    i = _sg.skinny_gemm(x, head.q, _sg.default_config(m, v, h, int8=True), scale=head.scale)  # [M, V]
    num_bound_chunks = -(-v // CHUNK)
    num_chunks = -(-v // EXACT_CHUNK)
    dev = x.device
    lo = torch.empty((m, num_bound_chunks), dtype=torch.float32, device=dev)
    hi = torch.empty((m, num_bound_chunks), dtype=torch.float32, device=dev)
    cx = torch.empty(m, dtype=torch.float32, device=dev)
    part_v = torch.empty((m, num_chunks), dtype=torch.float32, device=dev)
    part_i = torch.empty((m, num_chunks), dtype=torch.int64, device=dev)
    out = torch.empty(m, dtype=torch.int64, device=dev)
    interpret = interpret_mode()
    use_pdl = USE_PDL and pdl.active(dev, interpret)
    launch = dict(PDL=use_pdl, **pdl.launch_options(use_pdl))
    bounds, exact = _kernels(interpret)
    block_h = _next_pow2(h)
    bounds[(m, num_bound_chunks)](x, i, head.err, head.norm, lo, hi, cx, v, x.stride(0), i.stride(0),
                                  num_bound_chunks, SLACK=slack(h), K=h, BLOCK_H=block_h, CHUNK=CHUNK,
                                  num_warps=4, **launch)
    exact[(m, num_chunks)](x, weight, i, head.err, head.norm, lo, hi, cx, part_v, part_i,
                           v, x.stride(0), weight.stride(0), i.stride(0), num_bound_chunks, num_chunks,
                           SLACK=slack(h), K=h, BLOCK_H=block_h, CHUNK=EXACT_CHUNK,
                           BLOCK_B=max(2, _next_pow2(num_bound_chunks)), DTYPE=DTYPE_CODE[x.dtype],
                           num_warps=4, **launch)
    finish = _argmax._kernels(interpret)[1]
    finish[(m,)](part_v, part_i, out, out if also_into is None else also_into, num_chunks,
                 BLOCK_C=max(2, _next_pow2(num_chunks)), HAS_OUT2=also_into is not None, num_warps=1, **launch)
    return out
