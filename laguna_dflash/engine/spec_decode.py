"""DFlash speculative decoding: the proposer (drafter side) and acceptance (verifier side).

Acceptance rule (greedy and sampled alike). The target's verify forward over
``[bonus, d_1..d_K]`` gives, at row ``i``, the target's choice ``t_i`` for position ``P+i+1``
(argmax at temperature 0, else a sample from the target's filtered distribution). Draft ``d_k``
is accepted while every earlier one was and ``d_k == t_{k-1}``; the request then emits
``t_0 .. t_a`` (``a`` accepted drafts plus one bonus/correction token). With argmax (one-hot)
drafts this is standard speculative sampling: ``d`` is accepted with probability ``p(d)`` and on
rejection the emitted token is distributed as ``p`` restricted to ``!= d``, renormalised — so the
output distribution is exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .ahead import DraftsAhead
from .context_graph import ContextGraphRunner
from .cuda_graph import DeviceStart
from .kv_cache import KVCache
from .pending_taps import gather_pending_taps, plan_rows
from .runner import ForwardItem, ModelRunner, to_device_async
from .sequence import Sequence

#: the drafter's likeliest tokens a position that a constrained request's draft is chosen from
#: (DFlashProposer._guide); 0 turns guided drafting off (the argmax, as unconstrained requests)
num_draft_candidates = 1024


def num_accepted(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """``draft_tokens [R, K]``, ``target_tokens [R, K+1]`` -> accepted drafts ``[R]`` (0..K).

    Longest prefix with ``d_k == t_{k-1}``, via a cumulative product (on the device, no loop).
    """
    match = (draft_tokens == target_tokens[:, :-1]).to(torch.int32)
    return torch.cumprod(match, dim=1).sum(dim=1)


@dataclass
class SpecDecodingStats:
    """Engine-wide counters with vLLM's meaning; acceptance length = 1 + accepted / drafts."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, accepted: int, num_draft_tokens: int | None = None) -> None:
        """One request's step: ``num_draft_tokens`` drafted (default K), ``accepted`` taken."""
        self.num_drafts += 1
        self.num_draft_tokens += self.num_speculative_tokens if num_draft_tokens is None else num_draft_tokens
        self.num_accepted_tokens += accepted
        for k in range(accepted):
            self.num_accepted_tokens_per_pos[k] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        n = max(self.num_drafts, 1)
        return [c / n for c in self.num_accepted_tokens_per_pos]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
        }


class DFlashProposer:
    """Runs the drafter: context K/V precompute, then one block forward for all requests.

    The drafter's KV cache shares the target's slot index space. With ``draft_group`` 0 it is a
    cache of its own indexed by the target's full table, so the context K/V of position ``j``
    lives at the slot of the target's KV of ``j``; else it is a sliding group of the hybrid
    layout (``kv_cache.HybridLayout.draft_group``) and its table is the request's
    ``swa_block_tables[draft_group - 1]``: entries before ``swa_start`` are the scratch block, so
    context older than the window is written there (never read: outside every window).
    """

    def __init__(self, drafter: torch.nn.Module, kv_cache: KVCache, runner: ModelRunner,
                 num_speculative_tokens: int, draft_group: int = 0) -> None:
        self.drafter = drafter
        self.kv_cache = kv_cache
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_group = draft_group
        # set by LLMEngine.attach_context_graphs (EngineConfig.graph_context_precompute)
        self.context_graphs: ContextGraphRunner | None = None

    def table(self, seq: Sequence) -> list[int]:
        """``seq``'s block table of the drafter's cache."""
        return seq.swa_block_tables[self.draft_group - 1] if self.draft_group else seq.block_table

    def forward_item(self, seq: Sequence, start_pos: int, num_tokens: int) -> ForwardItem:
        """``seq``'s slice of a drafter block forward: ``num_tokens`` at ``start_pos ..``."""
        return ForwardItem(num_tokens, start_pos, start_pos + num_tokens, self.table(seq),
                           swa_start=seq.swa_start if self.draft_group else 0,
                           is_window_table=bool(self.draft_group))

    def slots(self, seq: Sequence, start: int, count: int) -> np.ndarray:
        """Drafter cache slots ``[count]`` int64 of ``seq``'s positions ``start ..`` (host)."""
        bs = self.kv_cache.block_size
        pos = np.arange(start, start + count)
        return np.asarray(self.table(seq), dtype=np.int64)[pos // bs] * bs + pos % bs

    def store_rows(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the context K/V of ``taps [N, n_taps * H_t]`` at ``positions [N]`` / drafter
        cache ``slots [N]`` (int64, on the device): the verify forward's context store
        (``ModelRunner.context_store``; it runs inside the verify's CUDA graph) and the eager
        store of pending taps. The slots are the target's: both caches share one slot index
        space (same blocks, same scratch slot)."""
        context = self.drafter.combine_hidden_states(taps)
        self.drafter.precompute_and_store_context_kv(context, positions, slots, self.kv_cache.layers)

    @torch.inference_mode()
    def store_context(self, seqs: list[Sequence]) -> None:
        """Write drafter context K/V for every request's pending target taps (all layers at once)."""
        pending = [s for s in seqs if s.num_pending]
        if not pending:
            return
        if self.context_graphs is not None and self.context_graphs.can_run(pending):
            self.context_graphs.run(pending, self.slots)
        else:
            self._store_context_eagerly(pending)
        for s in pending:
            s.clear_pending_taps()

    def _store_context_eagerly(self, pending: list[Sequence]) -> None:
        device = torch.device(self.runner.device)
        counts = [s.num_pending for s in pending]
        sources, rows = plan_rows(pending, np.cumsum([0] + counts[:-1]).tolist())
        index = torch.from_numpy(np.concatenate([  # [4, N]: positions, slots, gather rows (host)
            np.concatenate([np.stack([np.arange(s.pending_start, s.pending_start + n),
                                      self.slots(s, s.pending_start, n)])
                            for s, n in zip(pending, counts)], axis=1), rows]))
        if device.type == "cuda":  # one asynchronous copy
            index = index.pin_memory().to(device, non_blocking=True)
        self.store_rows(gather_pending_taps(pending, index[2:], rows, sources), index[0], index[1])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int | None = None) -> torch.Tensor:
        """Draft tokens ``[R, k]`` int64 (default k = K) for the running requests (argmax of the
        shared lm_head)."""
        self.store_context(seqs)
        k = k or self.num_speculative_tokens
        mask_id = self.drafter.mask_token_id
        ids, items = [], []
        for s in seqs:
            p = s.num_tokens - 1  # position of the pending bonus token
            ids += [s.last_token] + [mask_id] * k
            items.append(self.forward_item(s, p, k + 1))
        return self._drafts(ids, items, k, seqs=seqs)

    @torch.inference_mode()
    def propose_ahead(self, seqs: list[Sequence], k: int, anchors: list[int], accepted: torch.Tensor,
                      target_tokens: torch.Tensor) -> DraftsAhead | None:
        """The NEXT step's drafts, queued from this step's device results before they reach the
        host: request ``i`` (bonus at ``anchors[i] = P``, ``accepted [R]`` drafts taken, target
        tokens ``[R, k + 1]``) continues with a block ``[t_a, MASK x k]`` at ``P + a + 1 <=
        P + k + 1``. Needs the drafter's graph runner (it takes first positions from the device),
        block tables covering ``P + 2k + 1`` and no pending taps (the verify stored the
        context); else None, and the next step proposes."""
        graphs = self.runner.graphs
        bs = self.kv_cache.block_size
        max_anchors = [p + k + 1 for p in anchors]
        items = [self.forward_item(s, m, k + 1) for m, s in zip(max_anchors, seqs)]
        if (graphs is None or not graphs.can_run(items, len(seqs) * (k + 1))
                or any(s.num_pending or len(self.table(s)) * bs < m + k + 1
                       for m, s in zip(max_anchors, seqs))):
            return None
        # the items start at P + k + 1, k - a past the block; the bonus t_a is the placeholder 0
        # (one launch corrects both on the device: kernels/rewind_rows.py)
        ids = [t for _ in seqs for t in [0] + [self.drafter.mask_token_id] * k]
        return DraftsAhead(tuple(s.request_id for s in seqs), k,
                           self._drafts(ids, items, k, DeviceStart(accepted, target_tokens)))

    def _drafts(self, ids: list[int], items: list[ForwardItem], k: int,
                device_start: DeviceStart | None = None, seqs: list[Sequence] | None = None) -> torch.Tensor:
        """The drafter block forward and the argmax of its ``k`` mask rows -> ``[R, k]`` int64;
        the rows of ``seqs`` with a structured-output constraint are chosen inside it instead
        (:meth:`_guide`)."""
        r = len(items)
        hidden = self.runner.forward(ids, items, is_causal=self.drafter.is_causal, device_start=device_start,
                                     copy_hidden=False)[0]  # consumed at once by the lm_head
        hidden = hidden.view(r, k + 1, -1)[:, 1:]
        drafts = self.drafter.draft_tokens(hidden.reshape(r * k, -1)).view(r, k)
        guided = [i for i, s in enumerate(seqs or ()) if s.grammar is not None] if num_draft_candidates else []
        return self._guide(drafts, hidden, [seqs[i] for i in guided], guided) if guided else drafts

    def _guide(self, drafts: torch.Tensor, hidden: torch.Tensor, seqs: list[Sequence],
               rows: list[int]) -> torch.Tensor:
        """Constrained requests' drafts (rows ``rows`` of ``drafts [R, k]``; ``hidden [R, k, H]``
        the block's mask rows) taken from the drafter's ``num_draft_candidates`` likeliest
        tokens a position, the first each position's grammar state allows
        (ConstraintMatcher.guided_drafts): a draft the constraint refuses is never accepted, so
        the argmax would end the block there. The candidates come to the host (a sync the
        verify then saves: it reads these drafts from the matchers), the chosen drafts go up
        in place of the argmax."""
        k = drafts.shape[1]
        index = to_device_async(torch.tensor(rows), drafts.device)
        candidates = self.drafter.draft_candidates(hidden.index_select(0, index).reshape(len(rows) * k, -1),
                                                   num_draft_candidates).view(len(rows), k, -1).cpu().numpy()
        chosen = [s.grammar.guided_drafts(s.output_token_ids, c) for s, c in zip(seqs, candidates)]
        drafts = drafts.clone()  # the argmax may be a graph's output buffer
        drafts.index_copy_(0, index, to_device_async(torch.tensor(chosen, dtype=drafts.dtype), drafts.device))
        return drafts
