"""Weights into L2 ahead of the kernel that reads them, issued by a latency-bound kernel before.

At batch-1 decode a Laguna layer alternates kernels that stream weights from HBM (the GEMMs and
the MoE GEMVs, near the copy bandwidth) with short kernels that barely touch it (Q/K norm + RoPE,
paged attention and its merge, the norms, the routing): for ~12 us a layer, from the Q/K norm to
the ``o_proj`` GEMM, the HBM is idle (docs/PERFORMANCE.md). :func:`prefetch_l2` lets one of those
kernels ask the memory system to bring the NEXT weight (``o_proj``'s 33.5 MB at XS-2.1 size; the
H200's L2 holds 60 MiB) into L2 meanwhile, so the GEMM after it reads L2 instead of HBM.

Measured (H200, ``benchmarks/bench_l2_prefetch.py``, docs/PERFORMANCE.md "Seventh pass"): it
lands (1 or 8 issuing programs do as well as 132), but an L2-resident weight makes the batch-1
skinny GEMM only ~15% faster (``o_proj`` 15.1 -> 12.4 us event-timed: the GEMV is bound by its
load latency, not by HBM), and issuing it from the attention programs slowed attention by about
as much: the decode replay went 2.26 -> 2.29 ms. So the decode path leaves that one off
(``Attention.prefetch_o_proj``).

What pays (seventy-eighth pass, H100): the fused router's programs, each from 2 lanes once it has
arrived at the router's semaphore, prefetch a 16 MB tail of the NEXT layer's Q|K|V|gate weight
(``models.layers.MoE.prefetch_next_bytes``, a :class:`Spread` over the programs): the routing
and the hand-off to the expert GEMVs leave the HBM idle, the GEMVs stream with ``evict_first``,
and the head GEMM then finds those bytes in L2. The decode graph replayed in 2.36-2.40 against
2.41-2.45 ms without it. Issued before the router's PDL wait or just after it, the same bytes
slowed the router by about what they saved the head GEMM (``moe_routing.PREFETCH_AT``).
Programs appended to the head GEMM's grid, on the ~51 SMs its 81 programs leave idle, that
prefetched 8-16 MB (the part of ``o_proj``'s rows the staged o_proj streams after its wait, or
the head weight's own row ends) made the replay 0.17-0.24 ms slower (seventy-ninth pass, commit
0bd4191): the head GEMM's and the o_proj's spans both grew.

Mechanism (sm90+): ``cp.async.bulk.prefetch.L2.global [addr], size`` (PTX ISA 8.0), a TMA bulk
prefetch: fire and forget, no registers or shared memory held, the issuing program goes on at
once. The bytes ``[0, nbytes)`` of a contiguous weight are cut into ``num_parts x BLOCK`` chunks
of ``chunk`` bytes (a multiple of 16, as the instruction needs; the last chunks are cut short or
empty); program ``part`` of the issuing kernel prefetches its ``BLOCK`` chunks, one per lane
(``BLOCK`` >= the kernel's thread count, so no lane repeats another's). A prefetch is a hint: it
changes no value anywhere, only where the next reads find the bytes. The weights are never
written during a forward, so a program may issue it before its programmatic-dependent-launch wait
(kernels/pdl.py, rule 3).

Only compiled for CUDA sm90+ (the CPU interpreter cannot run inline PTX): :func:`plan` returns
``None`` elsewhere and callers then skip the prefetch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .availability import cuda_capability, interpret_mode, triton_importable
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["PREFETCH_BLOCK", "Spread", "can_run", "chunk_bytes", "contiguous_spread", "issue_plan", "plan",
           "prefetch_function", "prefetch_l2", "prefetch_lanes_function", "region", "row_suffixes"]

# chunks per issuing program: >= the threads of the issuing kernels (8 warps = 256 lanes)
PREFETCH_BLOCK = 256


def _prefetch_l2(base_ptr, nbytes, chunk, part, BLOCK: tl.constexpr):
    # bytes [c * chunk, (c + 1) * chunk) of [0, nbytes) for the BLOCK chunks c of program ``part``
    _prefetch_l2_lanes(base_ptr, nbytes, chunk, chunk, part, BLOCK, BLOCK)


def _prefetch_l2_lanes(base_ptr, nbytes, stride, size, part, BLOCK: tl.constexpr, LANES: tl.constexpr):
    # the first LANES of BLOCK lanes prefetch pieces c = part * LANES + lane, bytes
    # [c * stride, c * stride + min(size, nbytes - c * stride)) (a :class:`Spread`); the other
    # lanes and empty pieces (past nbytes) are predicated off inside the asm (BLOCK >= the
    # program's threads, so no two threads issue the same piece)
    lane = tl.arange(0, BLOCK)
    c = part.to(tl.int64) * LANES + lane
    off = c * stride
    n = tl.minimum(tl.maximum(nbytes - off, 0), size).to(tl.int32)
    n = tl.where(lane < LANES, n, 0)
    ptrs = base_ptr.to(tl.pointer_type(tl.int8)) + off
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, n], dtype=tl.int32, is_pure=False, pack=1)


def _prefetch_l2_kernel(base_ptr, nbytes, chunk, BLOCK: tl.constexpr):
    # standalone (benchmarks/bench_l2_prefetch.py): program p prefetches its BLOCK chunks
    _prefetch_l2(base_ptr, nbytes, chunk, tl.program_id(0), BLOCK)


@functools.cache
def _kernels():
    namespace = jit_functions(__name__, (_prefetch_l2_lanes, _prefetch_l2, _prefetch_l2_kernel))
    return namespace["_prefetch_l2"], namespace["_prefetch_l2_kernel"], namespace["_prefetch_l2_lanes"]


def prefetch_function():
    """The ``triton.jit`` helper for issuing kernels: ``_prefetch_l2(base_ptr, nbytes, chunk,
    part, BLOCK)`` (program ``part``'s share of a :func:`plan`)."""
    return _kernels()[0]


def prefetch_lanes_function():
    """The ``triton.jit`` helper issuing a :class:`Spread` from ``LANES`` lanes a program:
    ``_prefetch_l2_lanes(base_ptr, nbytes, stride, size, part, BLOCK, LANES)`` (program
    ``part``'s pieces; ``BLOCK`` >= the program's threads)."""
    return _kernels()[2]


def plan(weight: torch.Tensor | None, num_parts: int, block: int = PREFETCH_BLOCK) -> tuple[int, int] | None:
    """``(nbytes, chunk)`` for prefetching ``weight`` from ``num_parts`` programs of ``block``
    lanes each, or ``None`` when it cannot run: no weight, not contiguous, not 16-byte aligned,
    not on a CUDA sm90+ device, or under the interpreter. ``nbytes`` is rounded down to 16 (the
    last < 16 bytes are not prefetched)."""
    if weight is None or weight.device.type != "cuda" or num_parts < 1:
        return None
    if not triton_importable() or interpret_mode() or cuda_capability(weight.device.index) < (9, 0):
        return None
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        return None
    nbytes = weight.numel() * weight.element_size() // 16 * 16
    if nbytes == 0:
        return None
    return nbytes, chunk_bytes(nbytes, num_parts, block)


def region(weight: torch.Tensor, max_bytes: int, from_end: bool = False) -> torch.Tensor | None:
    """The first (``from_end``: last) ``max_bytes`` of a contiguous ``weight`` as a flat view
    (a whole number of 16-byte units, so a view from the end stays 16-byte aligned when the
    weight is), or ``None`` when that is empty or ``weight`` is not contiguous."""
    if not weight.is_contiguous():
        return None
    flat = weight.reshape(-1)
    unit = max(1, 16 // weight.element_size())
    n = min(flat.numel(), max(0, max_bytes) // weight.element_size()) // unit * unit
    if n == 0:
        return None
    return flat[flat.numel() - n:] if from_end else flat[:n]


@dataclass(frozen=True)
class Spread:
    """Pieces ``c = 0 .. num_pieces - 1`` of a weight to prefetch: bytes ``[c * stride, c * stride
    + min(size, nbytes - c * stride))`` from ``base``'s first byte (``stride`` and ``size``
    multiples of 16; ``base`` 16-byte aligned where it runs)."""

    base: torch.Tensor
    nbytes: int
    stride: int
    size: int

    @property
    def num_pieces(self) -> int:
        return -(-self.nbytes // self.stride)


def contiguous_spread(region_view: torch.Tensor, num_pieces: int) -> Spread | None:
    """``region_view`` (contiguous, e.g. from :func:`region`) cut into at most ``num_pieces``
    equal chunks (a multiple of 16 bytes each; the last cut short)."""
    nbytes = region_view.numel() * region_view.element_size() // 16 * 16
    if nbytes == 0 or not region_view.is_contiguous() or num_pieces < 1:
        return None
    chunk = chunk_bytes(nbytes, num_pieces, 1)
    return Spread(region_view, nbytes, chunk, chunk)


def row_suffixes(weight: torch.Tensor, max_bytes: int) -> Spread | None:
    """The last ``max_bytes / N`` bytes (rounded down to 16) of every row of a contiguous 2-D
    ``weight [N, K]``: one piece a row. A GEMV whose programs each walk their rows' K from the
    start finds the end of every row in L2, so every program gains, not only those whose rows a
    contiguous region covers."""
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[0] == 0:
        return None
    row_bytes = weight.shape[1] * weight.element_size()
    piece = min(row_bytes, max(0, max_bytes) // weight.shape[0]) // 16 * 16
    if piece == 0 or row_bytes % 16:
        return None
    base = weight.reshape(-1)[(row_bytes - piece) // weight.element_size():]
    return Spread(base, (weight.shape[0] - 1) * row_bytes + piece, row_bytes, piece)


def can_run(spread: Spread | None) -> bool:
    """Whether ``spread`` can be issued here: CUDA sm90+, compiled (not the interpreter), its
    base 16-byte aligned (see :func:`plan`)."""
    if spread is None or spread.base.device.type != "cuda":
        return False
    if not triton_importable() or interpret_mode() or cuda_capability(spread.base.device.index) < (9, 0):
        return False
    return spread.base.data_ptr() % 16 == 0 and spread.stride % 16 == 0 and spread.size % 16 == 0


def issue_plan(prefetch: torch.Tensor | Spread | None, num_programs: int, threads: int,
               region_lanes: int) -> tuple[Spread | None, int]:
    """How ``num_programs`` programs of ``threads`` threads issue ``prefetch``: ``(spread, lanes a
    program)`` for :func:`_prefetch_l2_lanes` (program ``part`` issues pieces ``part * lanes ..``),
    or ``(None, 0)`` where it cannot run (:func:`can_run`) or needs more lanes than a program has.
    A contiguous region (a tensor, e.g. from :func:`region`) is cut into ``region_lanes`` pieces a
    program; a :class:`Spread` keeps its pieces."""
    if num_programs < 1:
        return None, 0
    if isinstance(prefetch, torch.Tensor):
        prefetch = contiguous_spread(prefetch, num_programs * region_lanes)
    if not can_run(prefetch):
        return None, 0
    lanes = -(-prefetch.num_pieces // num_programs)
    return (prefetch, lanes) if lanes <= threads else (None, 0)


def chunk_bytes(nbytes: int, num_parts: int, block: int = PREFETCH_BLOCK) -> int:
    """Bytes per lane so that ``num_parts x block`` lanes cover ``nbytes`` (a multiple of 16):
    the smallest multiple of 16 that does."""
    return -(-nbytes // (num_parts * block * 16)) * 16


def prefetch_l2(weight: torch.Tensor, num_programs: int = 132) -> bool:
    """Launch a kernel of ``num_programs`` programs that prefetches ``weight`` into L2 (for
    benchmarks; the decode path issues prefetches from inside its kernels). Returns whether it
    ran (see :func:`plan`)."""
    p = plan(weight, num_programs)
    if p is None:
        return False
    nbytes, chunk = p
    _kernels()[1][(num_programs,)](weight, nbytes, chunk, BLOCK=PREFETCH_BLOCK, num_warps=4)
    return True
