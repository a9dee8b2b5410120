"""Token embedding rows ``weight[ids]`` in ONE Triton launch, programmatic-dependent-launch capable.

A graphed forward starts with its attention metadata (a normal launch), then this gather, then
layer 0's input norm, the first of a chain of PDL kernels (kernels/pdl.py). Torch's gather
(``indexSelectSmallIndex``) is a normal launch: the norm's programs could launch only once every
gather program had exited, and on the H200 the 4-row gathers of a verify and a drafter block
took 4.5 us each against 2.3 us for decode's one row (docs/PERFORMANCE.md, sixtieth pass). Here,
for token ``t`` and column ``c``::

    out[t, c] = weight[ids[t], c]

a copy: bitwise ``F.embedding(ids, weight)``. Grid ``(T, cdiv(H, BLOCK))``; under PDL a program
waits before it reads the ids (a copy into the graph's input buffer precedes the forward) and
signals its dependents right after, so the norm's programs launch while the rows are copied.
Ids must lie in ``[0, V)``: they are not checked on the device (the engine checks prompts
against the vocabulary; every other id is an argmax or a sample over it).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from . import pdl
from .availability import interpret_mode, triton_can_run
from .jit import DTYPE_CODE, jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["BLOCK", "can_run", "embedding"]

BLOCK = 2048  # columns a program: one program a row at Laguna's widths (2048, 3072: two)


def _embedding_kernel(ids_ptr, w_ptr, out_ptr, stride_ids, stride_w, stride_o,
                      HIDDEN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    if PDL:  # kernels/pdl.py: wait for what wrote the ids, then let the next kernel launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.load(ids_ptr + t * stride_ids).to(tl.int64)
    tl.store(out_ptr + t * stride_o + cols, tl.load(w_ptr + row * stride_w + cols, mask=ok), mask=ok)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key)."""
    del interpret
    name = "_embedding_kernel"
    # the row strides are the weight's and the output's, constant; the ids' stride varies with
    # the graph runner's row width: not specialised, one build serves every engine
    return jit_functions(__name__, (_embedding_kernel,), {name: ("stride_ids",)})[name]


def _operand_problem(ids: torch.Tensor, weight: torch.Tensor) -> str | None:
    """What about the operands the kernel cannot take; None if nothing."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        return f"ids must be [T] int32 / int64, got {tuple(ids.shape)} {ids.dtype}"
    if weight.dim() != 2 or weight.dtype not in DTYPE_CODE or weight.stride(1) != 1:
        return (f"weight must be [V, H] float32 / bfloat16 / float16 with unit column stride, got "
                f"{tuple(weight.shape)} {weight.dtype} strides {tuple(weight.stride())}")
    if ids.device != weight.device:
        return f"ids ({ids.device}) and weight ({weight.device}) must be on one device"
    return None


def can_run(ids: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`embedding` takes these operands here (else the caller runs ``F.embedding``):
    ``ids [T]`` int32 / int64, ``weight [V, H]`` fp32 / bf16 / fp16 with unit column stride, on
    one device where Triton runs (CUDA, or the CPU under its interpreter)."""
    return _operand_problem(ids, weight) is None and triton_can_run(weight.device)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` of the module docstring in one launch.

    Args:
        ids: ``[T]`` int32 / int64 in ``[0, V)`` (any stride).
        weight: ``[V, H]`` fp32 / bf16 / fp16, unit column stride.

    Returns:
        ``[T, H]``, a new contiguous tensor in weight's dtype.

    Raises:
        ValueError: on operands the kernel does not take, or where Triton cannot run (both name
            ``fusion.embedding``, which takes any).
    """
    problem = _operand_problem(ids, weight)
    if problem is not None:
        raise ValueError(f"embedding: {problem} (fusion.embedding takes any operands)")
    t, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty(t, hidden, dtype=weight.dtype, device=weight.device)
    if t == 0 or hidden == 0:
        return out
    if not triton_can_run(weight.device):
        raise ValueError(f"embedding cannot run on {weight.device}: it needs triton and a CUDA GPU or "
                         f"TRITON_INTERPRET=1 on a CPU; use fusion.embedding")
    interpret = interpret_mode()
    use_pdl = pdl.active(weight.device, interpret)
    _kernel(interpret)[(t, -(-hidden // BLOCK))](
        ids, weight, out, ids.stride(0), weight.stride(0), out.stride(0),
        HIDDEN=hidden, BLOCK=BLOCK, PDL=use_pdl, num_warps=4, **pdl.launch_options(use_pdl))
    return out
