"""Gather the requests' pending target taps (``Sequence.pending_taps``) into one feature tensor.

A request's pending taps are row segments of the batch taps of the steps that produced them
(a prefill, a verify, or up to ``K_max + 1`` target-only decode steps), so they are copied per
*source tensor*, not per request: for every distinct source one ``index_select`` and, unless the
destination is the plain concatenation of a single source, one ``index_copy_``. The row indices
are built on the host and shipped with one copy, whatever the batch size.
"""

from __future__ import annotations

import numpy as np
import torch

from .sequence import Sequence


def plan_rows(pending: list[Sequence], dest_offsets: list[int]) -> tuple[list[tuple[torch.Tensor, int, int]], np.ndarray]:
    """Where each pending row comes from and goes to.

    Request ``i``'s rows land at destination rows ``dest_offsets[i] ..`` in position order.
    Returns ``groups`` ``[(source, begin, end)]`` and ``rows [2, N]`` int64 (destination row,
    source row), laid out group by group: group ``g`` copies ``source[rows[1, begin:end]]`` to
    the destination rows ``rows[0, begin:end]``.
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
    groups, begin = [], 0
    for key, source in sources.items():
        groups.append((source, begin, begin + len(dst_of[key])))
        begin += len(dst_of[key])
    rows = np.array([sum(dst_of.values(), []), sum(src_of.values(), [])], dtype=np.int64).reshape(2, -1)
    return groups, rows


def copy_rows(dest: torch.Tensor, groups: list[tuple[torch.Tensor, int, int]], rows: torch.Tensor) -> None:
    """``dest[rows[0, b:e]] = source[rows[1, b:e]]`` for every group (``rows`` on ``dest``'s device)."""
    for source, begin, end in groups:
        picked = source.index_select(0, rows[1, begin:end])
        dest.index_copy_(0, rows[0, begin:end], picked.to(dest.dtype))


def gather_pending_taps(pending: list[Sequence], index: torch.Tensor, rows: np.ndarray,
                        groups: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """Features ``[N, D]``: the requests' pending rows concatenated in request order.

    ``groups`` / ``rows`` come from :func:`plan_rows` with consecutive offsets; ``index`` holds
    ``rows`` on the device. A single source needs only its ``index_select`` (its destination rows
    are ``0 .. N-1`` in order); one contiguous run of a single source is a view.
    """
    if len(groups) == 1:
        source = groups[0][0]
        src = rows[1]
        if src.size and src[-1] - src[0] + 1 == src.size and np.all(np.diff(src) == 1):
            return source[int(src[0]) : int(src[-1]) + 1]
        return source.index_select(0, index[1])
    out = torch.empty(rows.shape[1], groups[0][0].shape[1], dtype=groups[0][0].dtype,
                      device=groups[0][0].device)
    copy_rows(out, groups, index)
    return out
