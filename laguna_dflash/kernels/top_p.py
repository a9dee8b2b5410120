"""Top-p (nucleus) filtering without a sort: the boundary found by a radix select over the row.

For probabilities ``p [N, V]`` (float32, non-negative, each row summing to ~1) and a bound
``0 < top_p < 1`` per row, the kept set is every token at least as likely as the boundary token::

    S(t)  = sum { p_v : p_v > t }                 (the mass strictly above t)
    tau   = min { t : S(t) < top_p }              (a value of p, or 0)
    out_v = p_v / sum { p_u : p_u >= tau }   if p_v >= tau,   else 0

This is the sorted definition (sort descending, keep a token while the mass before it is below
``top_p``, so the token crossing the bound is kept) with every token tied with the boundary token
kept too, where a sort would keep an arbitrary subset of the ties. ``S`` is a step function that
drops at each value of ``p`` and is constant in between, so ``tau`` is exactly the boundary
token's probability.

Why: the sort that ``engine/sampler.filtered_probs_rows`` runs for top-p takes 160-430 us a call
at 1-16 rows and 2.9 ms at 256 rows on the H200 (100352 entries; ``benchmarks/bench_top_p.py``).
A radix select finds ``tau`` instead: the float32 bit patterns of non-negative values order like
the values, so ``tau``'s 31 bits are fixed 8, 8, 8 and 7 at a time, high bits first. A pass is two
launches. The histogram launch, grid ``(N, ceil(V / CHUNK))``, sums the mass of the row's entries
that share the bits fixed so far into 256 buckets by their next digit, a chunk a program (no
atomics: each program writes its own partial sums). The select launch, one program a row, adds the
chunks' partials in a fixed order and picks the boundary digit::

    A(d) = above + sum { m(d') : d' > d }    (mass above every entry of bucket d)
    d*   = min { d : A(d) < top_p }           (the bucket holding tau; above < top_p always)

and carries ``above = A(d*)`` into the next pass. After the fourth pass ``tau`` is exact and the
kept mass is ``A(d*) + m(d*)``; a last launch writes ``p / kept mass`` or 0. Nine launches whose
grids depend on the shapes only: CUDA-graph safe, no host sync. A row's result depends on that
row only (its own programs, fixed summation orders), so a request samples the same alone or
batched.

The first version (one program a row bisecting over the row, one commit before this one) took
384-616 us a call at 1-16 rows on the H200, slower than the sort: a single SM walked the 400 KB
row ten times.

:func:`top_p_filter_` runs the kernels on CUDA (and on the CPU under Triton's interpreter, the
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

# The A/B switch (benchmarks/bench_top_p.py times the kernels against the sort either way).
USE_KERNEL = True
CHUNK = 2048  # entries a histogram / write program
SUB = 32  # entries a histogram program adds into its [SUB, 256] accumulator at a time
NUM_WARPS = 4
_BUCKETS = 256
# (shift, width) of the digit each pass fixes: bits 30..23 (the exponent), 22..15, 14..7, 6..0
_PASSES = ((23, 8), (15, 8), (7, 8), (0, 7))


def _histogram_kernel(p_ptr, bound_ptr, bound_value, prefix_ptr, partial_ptr, stride_n, shift, width,
                      IS_FIRST: tl.constexpr, NUM_COLS: tl.constexpr, NUM_CHUNKS: tl.constexpr, HAS_COLUMN: tl.constexpr,
                      CHUNK: tl.constexpr, SUB: tl.constexpr):
    # program (n, c): the entries of chunk c of row n whose bits above the digit equal the
    # prefix fixed so far (every entry in the first pass: bits >> 31 is 0 for a non-negative
    # float) -> their mass by digit, partial[n, c, :]
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if HAS_COLUMN:
        bound = tl.load(bound_ptr + n)
    else:
        bound = bound_value
    if bound < 1.0:
        if IS_FIRST:  # nothing fixed yet (the buffer is not written): every entry is in
            prefix = 0
        else:
            prefix = tl.load(prefix_ptr + n)
        high = shift + width
        buckets = tl.arange(0, 256)
        acc = tl.zeros((SUB, 256), dtype=tl.float32)
        for s in range(0, CHUNK, SUB):
            offs = c * CHUNK + s + tl.arange(0, SUB)
            ok = offs < NUM_COLS
            x = tl.load(p_ptr + n * stride_n + offs, mask=ok, other=0.0)
            bits = x.to(tl.int32, bitcast=True)
            digit = (bits >> shift) & ((1 << width) - 1)
            hit = ok & ((bits >> high) == (prefix >> high))
            acc += tl.where(hit[:, None] & (digit[:, None] == buckets[None, :]), x[:, None], 0.0)
        tl.store(partial_ptr + (n * NUM_CHUNKS + c) * 256 + buckets, tl.sum(acc, axis=0))


def _select_kernel(partial_ptr, bound_ptr, bound_value, prefix_ptr, above_ptr, kept_ptr, shift, IS_FIRST: tl.constexpr,
                   NUM_CHUNKS: tl.constexpr, HAS_COLUMN: tl.constexpr, C_BLOCK: tl.constexpr):
    # program n: the row's bucket masses m (chunks added in order), the boundary digit d*, the
    # prefix and the mass above extended by it; the kept mass once the last digit is fixed
    n = tl.program_id(0).to(tl.int64)
    if HAS_COLUMN:
        bound = tl.load(bound_ptr + n)
    else:
        bound = bound_value
    if bound < 1.0:
        buckets = tl.arange(0, 256)
        m = tl.zeros((256,), dtype=tl.float32)
        m_next = tl.zeros((256,), dtype=tl.float32)  # m_next[d] = m[d + 1] (m[256] = 0)
        for c0 in range(0, NUM_CHUNKS, C_BLOCK):
            cs = c0 + tl.arange(0, C_BLOCK)
            rows = partial_ptr + (n * NUM_CHUNKS + cs[:, None]) * 256
            ok = cs[:, None] < NUM_CHUNKS
            m += tl.sum(tl.load(rows + buckets[None, :], mask=ok, other=0.0), axis=0)
            m_next += tl.sum(tl.load(rows + buckets[None, :] + 1, mask=ok & (buckets[None, :] < 255), other=0.0),
                             axis=0)
        if IS_FIRST:
            above = 0.0
            prefix = 0
        else:
            above = tl.load(above_ptr + n)
            prefix = tl.load(prefix_ptr + n)
        mass_above = above + tl.cumsum(m_next, axis=0, reverse=True)  # A(d); A(255) = above < bound
        d_star = tl.min(tl.where(mass_above < bound, buckets, 256), axis=0)
        pick = buckets == d_star
        above_star = tl.sum(tl.where(pick, mass_above, 0.0), axis=0)
        tl.store(prefix_ptr + n, prefix | (d_star << shift))
        tl.store(above_ptr + n, above_star)
        tl.store(kept_ptr + n, above_star + tl.sum(tl.where(pick, m, 0.0), axis=0))


def _write_kernel(p_ptr, bound_ptr, bound_value, prefix_ptr, kept_ptr, stride_n, NUM_COLS: tl.constexpr,
                  HAS_COLUMN: tl.constexpr, CHUNK: tl.constexpr):
    # program (n, c): chunk c of row n -> p / kept mass where p >= tau, else 0
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if HAS_COLUMN:
        bound = tl.load(bound_ptr + n)
    else:
        bound = bound_value
    if bound < 1.0:
        tau = tl.load(prefix_ptr + n).to(tl.float32, bitcast=True)
        total = tl.load(kept_ptr + n)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ok = offs < NUM_COLS
        x = tl.load(p_ptr + n * stride_n + offs, mask=ok, other=0.0)
        tl.store(p_ptr + n * stride_n + offs, tl.where(x >= tau, x / total, 0.0), mask=ok)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """(histogram, select, write) kernels for one mode (``interpret`` is the cache key)."""
    del interpret
    ns = jit_functions(__name__, (_histogram_kernel, _select_kernel, _write_kernel))
    return ns["_histogram_kernel"], ns["_select_kernel"], ns["_write_kernel"]


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
    n, v = probs.shape
    if column:
        assert top_p.shape == (n, 1) and top_p.dtype == torch.float32, top_p.shape
    bound_ptr, bound_value = (top_p, 0.0) if column else (probs, float(top_p))
    num_chunks = -(-v // CHUNK)
    # per row: tau's bits fixed so far, the mass above them, the kept mass (written by the
    # first pass before any read: IS_FIRST)
    prefix = torch.empty(n, dtype=torch.int32, device=probs.device)
    above = torch.empty(n, dtype=torch.float32, device=probs.device)
    kept = torch.empty(n, dtype=torch.float32, device=probs.device)
    partial = torch.empty((n, num_chunks, _BUCKETS), dtype=torch.float32, device=probs.device)
    histogram, select, write = _kernels(interpret_mode())
    c_block = min(32, max(2, 1 << (num_chunks - 1).bit_length()))
    for i, (shift, width) in enumerate(_PASSES):
        histogram[(n, num_chunks)](probs, bound_ptr, bound_value, prefix, partial, probs.stride(0), shift, width,
                                   IS_FIRST=i == 0, NUM_COLS=v, NUM_CHUNKS=num_chunks, HAS_COLUMN=column, CHUNK=CHUNK,
                                   SUB=SUB, num_warps=NUM_WARPS)
        select[(n,)](partial, bound_ptr, bound_value, prefix, above, kept, shift, IS_FIRST=i == 0, NUM_CHUNKS=num_chunks,
                     HAS_COLUMN=column, C_BLOCK=c_block, num_warps=4)
    write[(n, num_chunks)](probs, bound_ptr, bound_value, prefix, kept, probs.stride(0), NUM_COLS=v,
                           HAS_COLUMN=column, CHUNK=CHUNK, num_warps=NUM_WARPS)
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
