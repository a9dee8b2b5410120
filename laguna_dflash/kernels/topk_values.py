"""The ``k`` largest values of each row, ``torch.topk(x, k).values``, in two short launches.

For ``x [N, V]`` float32 (unit column stride) and ``1 <= k <= V``::

    out[n] = the k largest entries of x[n], descending (the multiset: ties repeat)

Values only: the sampler's top-k needs the k-th largest score as its threshold, and its ranked
top-p the k largest scores in order (engine/sampler.py); neither needs their indices.

Why: ``torch.topk`` over one 100352-entry row runs ~30 us of radix-select launches on the H200
(a top-k 20 sampling step at one row took 79 us in all, against 21 us with temperature alone;
thirty-third pass, docs/PERFORMANCE.md), and top-k 20 is the server's default for Laguna.

Here the row is cut into ``chunk``-entry chunks, one program each (grid ``(N, ceil(V /
chunk))``), each keeping its chunk's ``K_PAD = next_pow2(k)`` largest values (one bitonic
``tl.topk``) in a small scratch; a second launch (one program a row) takes the ``K_PAD`` largest
of those and stores the first ``k``. The k largest of a row are among the k largest of its
chunks, so this is exact: sorting moves values and never rounds one, so the result equals
torch's value for value (NaN excepted: torch ranks a NaN above everything, the bitonic network
does not order it; logits hold none). The chunk grows with ``k`` so the second launch merges at
most :data:`MAX_MERGE` values; a ``k`` past that goes to ``torch.topk``. The grid depends on the
shapes only: CUDA-graph safe, no host sync.

Runs on CUDA, and on the CPU under Triton's interpreter (the tests); elsewhere
:func:`topk_values` is ``torch.topk``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["MAX_MERGE", "build_ahead_ks", "can_use", "chunk_for", "topk_values"]

# The A/B switch (benchmarks/profile_sampler.py --switch
# laguna_dflash.kernels.topk_values:USE_KERNEL=False): False gives the sampler torch.topk. On since
# the thirty-fourth pass: its CUDA tests passed on the H200 and top-k 20 took 43 against 76 us at
# one row, 45 against 86 at 4, 208 against 254 at 64 (docs/PERFORMANCE.md).
USE_KERNEL = True
MIN_CHUNK = 1024  # entries a program at least: 8 fp32 a thread with 4 warps
MAX_CHUNK = 8192  # at most: the bitonic network's registers
MAX_MERGE = 4096  # values the second launch merges a row at most (chunks x K_PAD)


def _chunk_topk_kernel(x_ptr, part_ptr, num_cols, stride_xn, num_chunks,
                       CHUNK: tl.constexpr, K_PAD: tl.constexpr):
    # program (n, c): entries [c CHUNK, (c + 1) CHUNK) of row n -> their K_PAD largest,
    # descending, at part[n, c K_PAD ..]. Entries past the row read as -inf (never above a real
    # one, and a chunk past the row's end K_PAD short of real entries pads with -inf, as the
    # largest values of a row shorter than k would be)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + n * stride_xn + offs, mask=offs < num_cols, other=float("-inf"))
    top = tl.topk(x, K_PAD)  # [K_PAD] descending
    tl.store(part_ptr + (n * num_chunks + c) * K_PAD + tl.arange(0, K_PAD), top)


def _merge_topk_kernel(part_ptr, out_ptr, k, num_parts, stride_on,
                       K_PAD: tl.constexpr, BLOCK: tl.constexpr):
    # program n: the K_PAD largest of row n's num_parts = chunks x K_PAD candidates, descending;
    # the first k stored (the padding reads as -inf)
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    part = tl.load(part_ptr + n * num_parts + offs, mask=offs < num_parts, other=float("-inf"))
    top = tl.topk(part, K_PAD)
    cols = tl.arange(0, K_PAD)
    tl.store(out_ptr + n * stride_on + cols, top, mask=cols < k)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """(chunk kernel, merge kernel) for one mode (``interpret`` is the cache key)."""
    del interpret
    ns = jit_functions(__name__, (_chunk_topk_kernel, _merge_topk_kernel))
    return ns["_chunk_topk_kernel"], ns["_merge_topk_kernel"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def chunk_for(num_cols: int, k: int) -> int | None:
    """Entries a program for rows of ``num_cols`` and top ``k``: the smallest power of two from
    MIN_CHUNK to MAX_CHUNK (and at least ``next_pow2(k)``) whose chunks leave the merge at most
    MAX_MERGE candidates a row; None when none does (``torch.topk`` then)."""
    k_pad = max(2, _next_pow2(k))
    chunk = max(MIN_CHUNK, k_pad)
    while chunk <= MAX_CHUNK:
        if -(-num_cols // chunk) * k_pad <= MAX_MERGE:
            return chunk
        chunk *= 2
    return None


def can_use(x: torch.Tensor, k: int) -> bool:
    """Whether :func:`topk_values` takes the kernels: switched on, ``[N, V]`` float32 with
    ``N >= 1``, unit column stride, ``1 <= k <= V`` with a chunk (:func:`chunk_for`), no
    autograd, on a device Triton runs on (CUDA, or the CPU under its interpreter)."""
    return (USE_KERNEL and x.dim() == 2 and x.shape[0] > 0 and 1 <= k <= x.shape[1]
            and x.dtype == torch.float32 and x.stride(1) == 1
            and chunk_for(x.shape[1], k) is not None
            and not (x.requires_grad and torch.is_grad_enabled()) and triton_can_run(x.device))


def build_ahead_ks(num_cols: int, max_k: int) -> list[int]:
    """The ``k`` whose launches over rows of ``num_cols`` build every variant :func:`topk_values`
    launches for ``k <= max_k``: one ``k`` per pair of ``K_PAD`` (the constexpr) and Triton's
    specialisation of the integer ``k`` (1; a multiple of 16; any other). The chunk follows
    from ``K_PAD`` and ``num_cols``; of the other integer arguments, the merge's candidate count
    depends on ``k`` through ``K_PAD`` only, and its output's row stride is ``k`` itself."""
    first: dict[tuple[int, str], int] = {}
    for k in range(1, min(num_cols, max_k) + 1):
        if chunk_for(num_cols, k) is None:
            continue
        spec = "1" if k == 1 else "D" if k % 16 == 0 else ""
        first.setdefault((max(2, _next_pow2(k)), spec), k)
    return sorted(first.values())


def topk_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk(x, k, dim=-1).values``: each row's ``k`` largest values, descending.

    Args:
        x: ``[N, V]`` float32, any row stride, no NaN; other shapes, dtypes, devices or a ``k``
            past :data:`MAX_MERGE`'s reach go to ``torch.topk`` (:func:`can_use`).
        k: values a row, ``1 <= k <= V``.

    Returns:
        ``[N, k]`` float32 on x's device, equal to torch's value for value.
    """
    if not can_use(x, k):
        return torch.topk(x, k, dim=-1).values
    n, v = x.shape
    chunk = chunk_for(v, k)
    k_pad = max(2, _next_pow2(k))  # tl.topk selects from at least 2
    num_chunks = -(-v // chunk)
    part = torch.empty((n, num_chunks * k_pad), dtype=torch.float32, device=x.device)
    out = torch.empty((n, k), dtype=torch.float32, device=x.device)
    chunk_kernel, merge_kernel = _kernels(interpret_mode())
    chunk_kernel[(n, num_chunks)](x, part, v, x.stride(0), num_chunks, CHUNK=chunk, K_PAD=k_pad,
                                  num_warps=4 if chunk <= 2048 else 8)
    merge_kernel[(n,)](part, out, k, num_chunks * k_pad, out.stride(0), K_PAD=k_pad,
                       BLOCK=max(k_pad, _next_pow2(num_chunks * k_pad)), num_warps=4)
    return out
