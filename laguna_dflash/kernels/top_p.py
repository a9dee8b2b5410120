"""Top-p (nucleus) filtering without a sort: a threshold found by bisection, one program a row.

For probabilities ``p [N, V]`` (float32, non-negative, each row summing to ~1) and a bound
``0 < top_p < 1`` per row, the kept set is every token at least as likely as the boundary token::

    S(t)  = sum { p_v : p_v > t }                 (the mass strictly above t)
    tau   = min { t : S(t) < top_p }              (a value of p, or 0)
    out_v = p_v / sum { p_u : p_u >= tau }   if p_v >= tau,   else 0

This is the sorted definition (sort descending, keep a token while the mass before it is below
``top_p``, so the token crossing the bound is kept) with every token tied with the boundary token
kept too, where a sort would keep an arbitrary subset of the ties. ``S`` is a step function that
drops at each value of ``p`` and is constant in between, so ``tau`` is exactly the boundary
token's probability; and a float sum of non-negative terms with fewer terms is never larger
(rounding is monotone), so the computed ``S`` is non-increasing too and the bisection is exact.

Why: the sort that ``engine/sampler.filtered_probs_rows`` did for top-p took about 1 ms a step
at batch 1 on the H200 (100352 entries), the largest part of a sampled step's overhead
(docs/PERFORMANCE.md, thirtieth pass). Here one program a row bisects over the float32 bit
patterns (ordered like the values for non-negative floats), testing ``NUM_PROBES`` thresholds a
pass over the row (which stays in L2): ``log2(NUM_PROBES + 1)`` bits a pass, ~31 bits in all.
The grid is ``(N,)`` and nothing leaves the device: CUDA-graph safe, no host sync. A row's
result depends on that row only (one program, a fixed summation order), so a request samples
the same alone or batched.

:func:`top_p_filter_` runs the kernel on CUDA (and on the CPU under Triton's interpreter, the
tests) and :func:`top_p_filter_reference` elsewhere; both keep the same set (their sums may
round differently, which can move the boundary only where ``S(tau)`` is within rounding of
``top_p``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["can_use", "top_p_filter_", "top_p_filter_reference"]

# The A/B switch (benchmarks/bench_sampler.py --switch laguna_dflash.kernels.top_p:USE_KERNEL=False).
USE_KERNEL = True
BLOCK = 1024  # entries a program loads per iteration of a pass
NUM_PROBES = 8  # thresholds tested per pass over the row (a power of 2): log2(9) bits a pass
NUM_WARPS = 8
_INF_BITS = 0x7F800000  # float32 +inf: S(+inf) = 0 < top_p, the bisection's upper end


def _top_p_kernel(p_ptr, bound_ptr, bound_value, stride_n, NUM_COLS: tl.constexpr,
                  HAS_COLUMN: tl.constexpr, BLOCK: tl.constexpr, NUM_PROBES: tl.constexpr):
    # program n: row n of p, in place. Invariant of the bisection over bit patterns b (int64):
    # S(float(lo)) >= bound (lo = -1 stands for "below every value") and S(float(hi)) < bound;
    # it ends with hi = lo + 1, hi = bits(tau).
    n = tl.program_id(0).to(tl.int64)
    row = p_ptr + n * stride_n
    if HAS_COLUMN:
        bound = tl.load(bound_ptr + n)
    else:
        bound = bound_value
    if bound < 1.0:
        lo = tl.full((), -1, tl.int64)
        hi = tl.full((), _INF_BITS, tl.int64)
        k = tl.arange(0, NUM_PROBES).to(tl.int64) + 1
        while hi - lo > 1:
            # NUM_PROBES thresholds strictly inside (lo, hi), non-decreasing (equal near the end)
            probes = lo + 1 + ((hi - lo - 1) * k) // (NUM_PROBES + 1)
            thresholds = probes.to(tl.int32).to(tl.float32, bitcast=True)
            mass = tl.zeros((NUM_PROBES,), dtype=tl.float32)
            for start in range(0, NUM_COLS, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(row + offs, mask=offs < NUM_COLS, other=0.0)
                above = x[:, None] > thresholds[None, :]
                mass += tl.sum(tl.where(above, x[:, None], 0.0), axis=0)
            below_bound = mass < bound
            hi = tl.min(tl.where(below_bound, probes, hi), axis=0)
            lo = tl.max(tl.where(below_bound, lo, probes), axis=0)
        tau = hi.to(tl.int32).to(tl.float32, bitcast=True)
        kept = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, NUM_COLS, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row + offs, mask=offs < NUM_COLS, other=0.0)
            kept += tl.where(x >= tau, x, 0.0)
        total = tl.sum(kept, axis=0)
        for start in range(0, NUM_COLS, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < NUM_COLS
            x = tl.load(row + offs, mask=ok, other=0.0)
            tl.store(row + offs, tl.where(x >= tau, x / total, 0.0), mask=ok)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    del interpret  # the cache key: the interpreter decorates differently
    import triton.language as tl

    ns = jit_functions(__name__, (_top_p_kernel,))
    ns["_INF_BITS"] = tl.constexpr(_INF_BITS)  # a global a kernel reads must be a constexpr
    return ns["_top_p_kernel"]


def can_use(probs: torch.Tensor) -> bool:
    """Whether :func:`top_p_filter_` takes the kernel: switched on, ``[N, V]`` float32 with unit
    column stride and ``N, V >= 1``, no autograd, on a device Triton runs on."""
    return (USE_KERNEL and probs.dim() == 2 and probs.shape[0] > 0 and probs.shape[1] > 0
            and probs.dtype == torch.float32 and probs.stride(1) == 1
            and not (probs.requires_grad and torch.is_grad_enabled()) and triton_can_run(probs.device))


def top_p_filter_(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus (module docstring), renormalised, zeros elsewhere.

    Args:
        probs: ``[N, V]`` float32 probabilities (rows summing to ~1). Filtered in place where the
            kernel runs (:func:`can_use`); otherwise a new tensor is returned.
        top_p: the bound, one float for every row or a ``[N, 1]`` float32 column on probs'
            device. A row whose bound is ``>= 1`` (``+inf`` included) is left as it is.

    Returns:
        ``[N, V]`` float32: ``probs`` itself (kernel) or the reference's result.
    """
    column = isinstance(top_p, torch.Tensor)
    if not column and top_p >= 1.0:
        return probs
    if not can_use(probs):
        return top_p_filter_reference(probs, top_p)
    if column:
        assert top_p.shape == (probs.shape[0], 1) and top_p.dtype == torch.float32, top_p.shape
    _kernel(interpret_mode())[(probs.shape[0],)](
        probs, top_p if column else probs, 0.0 if column else float(top_p), probs.stride(0),
        NUM_COLS=probs.shape[1], HAS_COLUMN=column, BLOCK=BLOCK, NUM_PROBES=NUM_PROBES, num_warps=NUM_WARPS)
    return probs


def top_p_filter_reference(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """The same kept set by a sort (``[N, V]`` float32 in, a new ``[N, V]`` float32 out): the
    boundary token is the last in descending order whose exclusive prefix mass is below the
    bound; every token at least as likely is kept. Rows whose bound is ``>= 1`` are returned
    bitwise unchanged."""
    sorted_p = probs.sort(dim=-1, descending=True).values
    # exclusive prefix sums: non-decreasing along the row (monotone rounding), so the tokens
    # below the bound are a prefix and the count finds its last one
    before = torch.nn.functional.pad(sorted_p.cumsum(-1)[:, :-1], (1, 0))
    num_kept = (before < top_p).sum(-1, keepdim=True).clamp_(min=1)
    tau = sorted_p.gather(-1, num_kept - 1)
    kept = probs.masked_fill(probs < tau, 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    if isinstance(top_p, torch.Tensor):
        return torch.where(top_p < 1.0, kept, probs)
    return kept if top_p < 1.0 else probs
