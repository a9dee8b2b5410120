"""Row argmax over the vocabulary, ``torch.argmax(logits, dim=-1)`` in two short launches.

For ``logits [N, V]`` (fp32 / bf16 / fp16, unit column stride)::

    out[n] = min { v : logits[n, v] = max_u logits[n, u] }      (the FIRST maximal index)

and, as ``torch.argmax`` does, a NaN counts as larger than every number: a row holding a NaN
gives the index of its first NaN. Comparisons only (bf16 / fp16 widen to fp32 exactly), so the
result equals torch's bit for bit, ties included.

Why: greedy decoding takes one argmax a step over the target's logits, and DFlash one more over
the drafter's. On the H200 torch's reduction ran each ~100k-entry row in one block: 22.7 us a
call, ~1% of a batch-1 Laguna-XS decode step (``host_timeline.py --kernels``,
docs/PERFORMANCE.md, fourteenth pass). Here the row is cut into ``CHUNK``-entry chunks, one
program each (grid ``(N, ceil(V / CHUNK))``), each writing its chunk's (max, first index) to a
small fp32 / int64 scratch; a second launch (one program a row) picks the first chunk holding
the row's maximum. The grid depends on the shapes only: CUDA-graph safe, no host sync.

Runs on CUDA, and on the CPU under Triton's interpreter (the tests); elsewhere
:func:`argmax_rows` is ``torch.argmax``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["CHUNK", "argmax_rows", "can_use"]

# The A/B switch (benchmarks/host_timeline.py --switch laguna_dflash.kernels.argmax:USE_KERNEL=False).
USE_KERNEL = True
CHUNK = 2048  # entries a program: 16 fp32 a thread with 4 warps
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_INDEX = 2**62  # larger than any index: the neutral element of the min below


def _chunk_argmax_kernel(x_ptr, part_v_ptr, part_i_ptr, num_cols, stride_xn, num_chunks,
                         CHUNK: tl.constexpr):
    # program (n, c): entries [c CHUNK, (c + 1) CHUNK) of row n -> (max, first index of it), or
    # (NaN, first NaN's index) when the chunk holds a NaN. Entries past the row read as -inf: a
    # chunk always holds a real entry and real entries come first, so the min index is real
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + n * stride_xn + offs, mask=offs < num_cols, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    has_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), x), 0)
    hit = tl.where(has_nan, is_nan, x == top)
    first = tl.min(tl.where(hit, offs, _NO_INDEX), 0)
    tl.store(part_v_ptr + n * num_chunks + c, tl.where(has_nan, float("nan"), top))
    tl.store(part_i_ptr + n * num_chunks + c, first)


def _finish_argmax_kernel(part_v_ptr, part_i_ptr, out_ptr, out2_ptr, num_chunks, BLOCK_C: tl.constexpr,
                          PDL: tl.constexpr, HAS_OUT2: tl.constexpr):
    # program n: the row's chunks in order; a NaN chunk wins (the first NaN of the row has the
    # smallest index among the NaN chunks' first NaNs), else the smallest index among the chunks
    # that reached the row's maximum. PDL: a programmatic dependent launch (kernels/pdl.py).
    # HAS_OUT2: the index is stored at out2_ptr + n too (a graph's input ids, greedy_lm_head)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    v = tl.load(part_v_ptr + n * num_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(part_i_ptr + n * num_chunks + c, mask=ok, other=_NO_INDEX)
    is_nan = v != v
    has_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), v), 0)
    hit = tl.where(has_nan, is_nan, (v == top) & ok)
    index = tl.min(tl.where(hit, i, _NO_INDEX), 0)
    tl.store(out_ptr + n, index)
    if HAS_OUT2:
        tl.store(out2_ptr + n, index)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """(chunk kernel, finish kernel) for one mode (``interpret`` is the cache key)."""
    del interpret
    import triton.language as tl

    ns = jit_functions(__name__, (_chunk_argmax_kernel, _finish_argmax_kernel))
    ns["_NO_INDEX"] = tl.constexpr(_NO_INDEX)  # a global a kernel reads must be a constexpr
    return ns["_chunk_argmax_kernel"], ns["_finish_argmax_kernel"]


def can_use(logits: torch.Tensor) -> bool:
    """Whether :func:`argmax_rows` takes the kernels for ``logits``: switched on, ``[N, V]`` with
    ``N, V >= 1``, fp32 / bf16 / fp16 with unit column stride, no autograd, on a device Triton
    runs on (CUDA, or the CPU under its interpreter)."""
    return (USE_KERNEL and logits.dim() == 2 and logits.shape[0] > 0 and logits.shape[1] > 0
            and logits.dtype in _DTYPES and logits.stride(1) == 1
            and not (logits.requires_grad and torch.is_grad_enabled()) and triton_can_run(logits.device))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` (first maximal index, NaN largest) -> int64.

    Args:
        logits: ``[N, V]``; any row stride. Other shapes, dtypes or devices go to
            ``torch.argmax`` (:func:`can_use`).

    Returns:
        ``[N]`` int64 on logits' device.
    """
    if not can_use(logits):
        return torch.argmax(logits, dim=-1)
    n, v = logits.shape
    num_chunks = -(-v // CHUNK)
    part_v = torch.empty((n, num_chunks), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((n, num_chunks), dtype=torch.int64, device=logits.device)
    out = torch.empty((n,), dtype=torch.int64, device=logits.device)
    chunk_kernel, finish_kernel = _kernels(interpret_mode())
    chunk_kernel[(n, num_chunks)](logits, part_v, part_i, v, logits.stride(0), num_chunks, CHUNK=CHUNK,
                                  num_warps=4)
    finish_kernel[(n,)](part_v, part_i, out, out, num_chunks, BLOCK_C=max(2, 1 << (num_chunks - 1).bit_length()),
                        PDL=False, HAS_OUT2=False, num_warps=1)
    return out
