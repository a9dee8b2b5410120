"""Gather the requests' pending target taps (``Sequence.pending_taps``) into one feature tensor.

A request's pending taps are row segments of the batch taps of the steps that produced them
(a prefill, a verify, or up to ``K_max + 1`` target-only decode steps), so they are copied per
*source tensor*, not per request: one source (the steady state of speculation) takes one
``index_select``; several (target-only steps) are concatenated first, so the copy is three
kernels whatever the number of steps. The row indices are built on the host and shipped with
one copy, whatever the batch size.
"""

from __future__ import annotations

import numpy as np
import torch

from .sequence import Sequence


def plan_rows(pending: list[Sequence], dest_offsets: list[int]) -> tuple[list[torch.Tensor], np.ndarray]:
    """Where each pending row comes from and goes to.

    Request ``i``'s rows land at destination rows ``dest_offsets[i] ..`` in position order.
    Returns the distinct ``sources`` (first-use order) and ``rows [2, N]`` int64: destination
    row, and row in the concatenation of ``sources`` (``torch.cat(sources)``), laid out source
    by source.
    """
    dst_of: dict[int, list[int]] = {}
    src_of: dict[int, list[int]] = {}
    sources: dict[int, torch.Tensor] = {}
    for s, dst in zip(pending, dest_offsets):
        for source, first, n in s.pending_taps:
            key = id(source)
            if key not in sources:
                sources[key], dst_of[key], src_of[key] = source, [], []
            dst_of[key].extend(range(dst, dst + n))
            src_of[key].extend(range(first, first + n))
            dst += n
    dst_rows, src_rows, offset = [], [], 0
    for key, source in sources.items():
        dst_rows += dst_of[key]
        src_rows += [r + offset for r in src_of[key]]
        offset += source.shape[0]
    return list(sources.values()), np.array([dst_rows, src_rows], dtype=np.int64).reshape(2, -1)


def _picked(sources: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """The source rows ``rows[1]`` of ``torch.cat(sources)`` (no concatenation for one source)."""
    stacked = sources[0] if len(sources) == 1 else torch.cat(sources)
    return stacked.index_select(0, rows[1])


def copy_rows(dest: torch.Tensor, sources: list[torch.Tensor], rows: torch.Tensor) -> None:
    """``dest[rows[0]] = torch.cat(sources)[rows[1]]`` (``rows`` from :func:`plan_rows`, on
    ``dest``'s device)."""
    dest.index_copy_(0, rows[0], _picked(sources, rows).to(dest.dtype))


def gather_pending_taps(pending: list[Sequence], index: torch.Tensor, rows: np.ndarray,
                        sources: list[torch.Tensor]) -> torch.Tensor:
    """Features ``[N, D]``: the requests' pending rows concatenated in request order.

    ``sources`` / ``rows`` come from :func:`plan_rows` with consecutive offsets; ``index`` holds
    ``rows`` on the device. A single source needs only its ``index_select`` (its destination rows
    are ``0 .. N-1`` in order); one contiguous run of a single source is a view.
    """
    if len(sources) == 1:
        src = rows[1]
        if src.size and src[-1] - src[0] + 1 == src.size and np.all(np.diff(src) == 1):
            return sources[0][int(src[0]) : int(src[-1]) + 1]
        return sources[0].index_select(0, index[1])
    out = torch.empty(rows.shape[1], sources[0].shape[1], dtype=sources[0].dtype,
                      device=sources[0].device)
    copy_rows(out, sources, index)
    return out
