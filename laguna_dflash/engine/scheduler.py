"""Continuous batching: admit waiting requests under a token budget, grow block tables, preempt.

A step is either a prefill batch (newly admitted requests, whole prompt each) or a decode batch
(every running request). Decode steps reserve KV for ``1 + num_lookahead`` positions per request
(the bonus token plus K draft tokens when speculating). When blocks run out the most recently
admitted request is preempted: its blocks are freed and it is recomputed later from its tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from .kv_cache import BlockAllocator
from .sequence import Sequence, Status

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    sequences: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_lookahead: int = 0,
    ) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead = num_lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _reserve(self, seq: Sequence, num_positions: int) -> bool:
        need = self.allocator.blocks_needed(num_positions, len(seq.block_table))
        if not self.allocator.can_allocate(need):
            return False
        seq.block_table += self.allocator.allocate(need)
        return True

    def reserve(self, seq: Sequence, num_positions: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_positions`` positions if blocks are free
        (no preemption); False when they are not."""
        return self._reserve(seq, num_positions)

    def release(self, seq: Sequence) -> None:
        """Free a request's KV blocks (finished, aborted or preempted)."""
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def schedule(self) -> ScheduledBatch | None:
        prefill: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(prefill) < self.max_num_seqs:
            seq = self.waiting[0]
            # A prefill computes every token and samples the next, so reserve one extra position
            # plus the decode lookahead it will need next.
            if seq.num_tokens > budget and prefill:
                break
            if not self._reserve(seq, seq.num_tokens + 1 + self.num_lookahead):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            budget -= seq.num_tokens
            prefill.append(seq)
        if prefill:
            self.running += prefill
            return ScheduledBatch(prefill, is_prefill=True)
        if not self.running:
            if self.waiting:
                seq = self.waiting[0]
                raise RuntimeError(
                    f"request {seq.request_id} needs {seq.num_tokens + 1 + self.num_lookahead} KV "
                    f"positions but the cache has only {self.allocator.num_blocks} blocks of "
                    f"{self.allocator.block_size}; raise num_kv_blocks or lower max_model_len"
                )
            return None
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below
            while not self._reserve(seq, seq.num_tokens + self.num_lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                scheduled.append(seq)
        return ScheduledBatch(scheduled, is_prefill=False) if scheduled else self.schedule()

    def _preempt(self, seq: Sequence) -> None:
        logger.warning("KV cache full: preempting request %d (recomputed later)", seq.request_id)
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.WAITING
        seq.clear_pending_taps()
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
