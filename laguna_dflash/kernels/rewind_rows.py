"""A drafter block queued ahead: its first positions and first token ids, written on the device.

A DFlash step queues the next step's drafter block before its acceptance reaches the host
(``engine/ahead.py``). Request ``i``'s block then starts ``S - a_i`` positions before the upper
bound the host knows (``S`` drafts verified, ``a_i`` accepted, both on the device) and its first
token is the target's token ``t_{a_i}``. The graph runner uploads its request rows
(``engine/cuda_graph.py``: ``[start_pos, seq_len, block tables..., token ids...]``, int64) with
the upper bounds and a placeholder id, then this one launch corrects them::

    shift        = S - accepted[i]
    start_pos[i] -= shift;   seq_len[i] -= shift                (seq_len = start_pos + q holds)
    ids[i, 0]    = tokens[i, accepted[i]]

As torch ops it was ten small launches a step (an upload of the anchors, two adds, a gather, a
fill, a cat, and three copies into the rows); one program a request here. Launched normally
(no PDL): its input is the upload just before it. Integer arithmetic only: bitwise
:func:`rewind_rows_reference`, the CPU path.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .availability import interpret_mode, triton_can_run
from .jit import jit_functions

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["rewind_rows", "rewind_rows_reference"]

# The A/B switch (benchmarks: --switch laguna_dflash.kernels.rewind_rows:USE_KERNEL=False).
USE_KERNEL = True


def _rewind_rows_kernel(state_ptr, accepted_ptr, tokens_ptr, stride_state, stride_tokens, max_shift,
                        IDS_COL: tl.constexpr):
    # program r: request r's row of the state
    r = tl.program_id(0).to(tl.int64)
    row = state_ptr + r * stride_state
    a = tl.load(accepted_ptr + r).to(tl.int64)
    shift = max_shift - a
    tl.store(row, tl.load(row) - shift)
    tl.store(row + 1, tl.load(row + 1) - shift)
    tl.store(row + IDS_COL, tl.load(tokens_ptr + r * stride_tokens + a))


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The JIT kernel for one mode (``interpret`` is the cache key). Its integers are not
    specialised: the stride and the shift vary with K (adaptive K), and a variant built on
    first use would stall that step."""
    del interpret
    name = "_rewind_rows_kernel"
    return jit_functions(__name__, (_rewind_rows_kernel,),
                         {name: ("stride_state", "stride_tokens", "max_shift")})[name]


def _check(state: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, ids_col: int) -> None:
    r = accepted.shape[0] if accepted.dim() == 1 else -1
    if state.dim() != 2 or state.dtype != torch.int64 or state.stride(1) != 1 or state.shape[0] < r:
        raise ValueError(f"state must be a 2-D int64 tensor with unit column stride and a row per "
                         f"request, got {state.dtype} {tuple(state.shape)} strides {tuple(state.stride())}")
    if accepted.dim() != 1 or accepted.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"accepted must be a 1-D int32 / int64 tensor, got {accepted.dtype} "
                         f"{tuple(accepted.shape)}")
    if tokens.dim() != 2 or tokens.dtype != torch.int64 or tokens.shape[0] != r or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [R, S + 1] int64 with R = {r} rows, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    if not 2 <= ids_col < state.shape[1]:
        raise ValueError(f"ids_col {ids_col} is not a column of the state's {state.shape[1]}")


def rewind_rows(state: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, ids_col: int) -> None:
    """Move request ``i``'s row back by ``S - accepted[i]`` positions and set its first token id
    to ``tokens[i, accepted[i]]``, in place, for ``i < R`` (see the module docstring).

    Args:
        state: ``[>= R, W]`` int64 rows ``[start_pos, seq_len, ..., token ids from ids_col]``
            (unit column stride; any row stride).
        accepted: ``[R]`` int32 / int64, each in ``0 .. S``.
        tokens: ``[R, S + 1]`` int64.
    """
    _check(state, accepted, tokens, ids_col)
    r = accepted.shape[0]
    if r == 0:
        return
    if not (USE_KERNEL and triton_can_run(state.device)):
        rewind_rows_reference(state, accepted, tokens, ids_col)
        return
    accepted, tokens = accepted.contiguous(), tokens.contiguous()
    _kernel(interpret_mode())[(r,)](state, accepted, tokens, state.stride(0), tokens.stride(0),
                                    tokens.shape[1] - 1, IDS_COL=ids_col, num_warps=1)


def rewind_rows_reference(state: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor,
                          ids_col: int) -> None:
    """:func:`rewind_rows` in torch ops (the CPU path, and the kernel's oracle)."""
    _check(state, accepted, tokens, ids_col)
    r = accepted.shape[0]
    index = accepted.to(torch.int64).view(-1, 1)
    state[:r, :2] -= (tokens.shape[1] - 1 - index)
    state[:r, ids_col] = tokens.gather(1, index).view(-1)
