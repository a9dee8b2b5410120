"""Work a decode step queues for the NEXT step before its own host sync waits.

A step's one host sync (its results to the host) leaves the GPU idle while the host commits,
schedules and prepares the next launch. Where the next step's first launch needs only device
values, the step queues it behind its own results instead, and the next step takes it when its
batch is what was assumed (else it runs its own):

* a DFlash step queues the next drafter block (anchor ``P + a + 1``, bonus ``t_a`` on the
  device): :class:`DraftsAhead` (``engine.draft_ahead``);
* a target-only step queues the next target forward with its sampled tokens as input ids
  (positions are known on the host): :class:`ForwardAhead` (``engine.decode_ahead``); with a
  drafter loaded (K = 0 steps) it also returns the taps the drafter's context needs.

Work queued for a batch that then changes is dropped; its cache writes land at positions that
are rewritten before they are read (or in blocks freed after it, in stream order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cuda_graph import StagedDecode
from .sequence import Sequence


@dataclass
class DraftsAhead:
    """Drafts ``[R, k]`` (device) queued by a DFlash step for the next one, for requests
    ``request_ids``, at ``anchors`` (filled in once that step's acceptance reached the host)."""

    request_ids: tuple[int, ...]
    k: int
    drafts: torch.Tensor
    anchors: list[int] = field(default_factory=list)

    def fits(self, seqs: list[Sequence], k: int) -> bool:
        """Whether the step of ``seqs`` with ``k`` drafts is the one these drafts were made for."""
        return (self.k == k and self.request_ids == tuple(s.request_id for s in seqs)
                and self.anchors == [s.num_tokens - 1 for s in seqs])


@dataclass
class ForwardAhead:
    """Final-normed hidden states ``[R, H]`` of a target forward queued by a target-only step,
    one row per request of ``request_ids``, for the token at ``positions``; with a drafter, its
    taps ``[R, num_taps * H]`` (else None)."""

    request_ids: tuple[int, ...]
    positions: list[int]
    hidden: torch.Tensor
    taps: torch.Tensor | None = None

    def rows_for(self, seqs: list[Sequence]) -> list[int] | None:
        """Rows of ``hidden`` for a decode step of ``seqs`` (each computing its last token), or
        None when this forward does not cover one of them (admitted or recomputed since)."""
        index = {rid: i for i, rid in enumerate(self.request_ids)}
        rows = []
        for s in seqs:
            i = index.get(s.request_id)
            if i is None or self.positions[i] != s.num_tokens - 1:
                return None
            rows.append(i)
        return rows


@dataclass(frozen=True)
class PlannedForward:
    """The next step's target forward, planned by a target-only step before its own tokens
    exist: request ``request_ids[i]`` computes position ``positions[i]`` (``items``: the runner's
    forward items), its rows already uploaded where ``staged`` is not None."""

    request_ids: tuple[int, ...]
    positions: list[int]
    items: list
    staged: StagedDecode | None
