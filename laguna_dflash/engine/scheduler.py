"""Continuous batching: admit waiting requests under a token budget, grow block tables, preempt.

A step is either a prefill batch (newly admitted requests, whole prompt each) or a decode batch
(every running request). Decode steps reserve KV for ``1 + num_lookahead`` positions per request
(the bonus token plus K draft tokens when speculating). When blocks run out the most recently
admitted request is preempted: its blocks are freed and it is recomputed later from its tokens.

Scheduling policy (vLLM's ``--scheduling-policy``): ``fcfs`` admits in arrival order; ``priority``
keeps the waiting, prefilling and running queues ordered by (``priority``, arrival), lower first,
so the most urgent waiting request is admitted first and the least urgent running one is
preempted first. A running request is never preempted to admit a waiting one.

Prefix caching (``enable_prefix_caching``, vLLM's automatic prefix caching): a request is
admitted with the cached blocks of its longest cached full-block prefix at the head of its
block table (shared, never written: it writes only past them) and ``num_computed`` at their end,
so its prefill computes only the rest; at least its last token is computed (its logits give the
first output token). After each step the engine :meth:`Scheduler.cache_blocks` the requests'
newly final full blocks. Requests asking for prompt logprobs compute their whole prompt.

A waiting request whose next full blocks (at least half of what it would compute) are being
computed by a request admitted before it waits until they are cached, instead of computing them
again in the same step (:meth:`Scheduler._waits_for_prefix`): the ``n`` choices of one prompt,
or requests sent together with one long system prompt, prefill the shared part once. Requests
behind it are admitted meanwhile.

Chunked prefill (``enable_chunked_prefill``, vLLM's): a prefill step computes at most
``max_num_batched_tokens`` tokens; a prompt longer than what is left of that budget is computed
in chunks over several prefill steps (its full layers' blocks reserved whole at admission), and while one is
in progress the steps alternate with decode steps of the running requests, so a long prompt
delays their next token by one chunk, not by its whole prefill.

Hybrid KV layout (``kv_cache.HybridLayout``, vLLM's hybrid KV cache manager): the sliding-window
layers' groups hold, per request, only the blocks within ``sliding_window`` of the positions it
still computes (``Sequence.swa_block_tables``): a step's reservation takes their blocks up to the
step's end, :meth:`Scheduler.trim_window` frees those that fell out of the window after it. With
prefix caching their blocks are registered under the full blocks' hashes qualified by the
group, and a cached prefix is used only as far as every group holds its last window. A DFlash
drafter whose layers all slide keeps its context K/V in one of these groups
(``HybridLayout.draft_group``): nothing here tells it from the target's.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockAllocator, HybridLayout, block_hashes
from .sequence import Sequence, Status

logger = logging.getLogger(__name__)

# False: a waiting request never waits for a prefix another request is computing (an A/B switch
# for benchmarks/bench_prefix_cache.py)
wait_for_shared_prefixes = True


@dataclass
class ScheduledBatch:
    sequences: list[Sequence]
    is_prefill: bool
    # prefill: the tokens each request computes this step, at positions num_computed ..; short
    # of its last token for a request in the middle of a chunked prefill
    num_new_tokens: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_lookahead: int = 0,
        enable_prefix_caching: bool = False,
        enable_chunked_prefill: bool = False,
        layout: HybridLayout | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.allocator = allocator
        self.is_priority = scheduling_policy == "priority"
        self.layout = layout
        self.num_swa_groups = layout.num_swa_groups if layout is not None else 0
        self.null_block = allocator.num_blocks  # the scratch block: an SWA table's freed entry
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefilling: list[Sequence] = []  # admitted, prompt partly computed (chunked)
        self._decode_turn = False  # the next step decodes (a chunked prefill is in progress)
        # prompt tokens looked up in the prefix cache at admission, and found there
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead = num_lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def add(self, seq: Sequence) -> None:
        self._enqueue(self.waiting, seq)

    def _enqueue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
        """Append ``seq`` (first come, first served), or with the priority policy insert it
        after every request of ``queue`` that goes before it: a lower ``priority`` value, or
        the same and an earlier arrival (request ids increase). The queues stay ordered, so
        admission takes them from the front and preemption from the back, under either policy."""
        if not self.is_priority:
            queue.append(seq)
            return
        key = (seq.priority, seq.request_id)
        i = len(queue)
        while i > 0 and (queue[i - 1].priority, queue[i - 1].request_id) > key:
            i -= 1
        queue.insert(i, seq)

    def _swa_needed(self, seq: Sequence, num_positions: int) -> int:
        """Blocks the SWA groups' tables of ``seq`` lack to cover ``num_positions`` positions
        (their entries from ``swa_start`` on are held, so only the new ones at the end)."""
        if not self.num_swa_groups:
            return 0
        return self.num_swa_groups * self.allocator.blocks_needed(num_positions, len(seq.swa_block_tables[0]))

    def _swa_grow(self, seq: Sequence, num_positions: int) -> None:
        for table in seq.swa_block_tables:  # all of one length: each takes the same count
            table += self.allocator.allocate(self.allocator.blocks_needed(num_positions, len(table)))

    def _reserve(self, seq: Sequence, num_positions: int) -> bool:
        need = self.allocator.blocks_needed(num_positions, len(seq.block_table))
        swa_need = self._swa_needed(seq, num_positions)
        if need == swa_need == 0:
            return True  # most steps: every table covers the positions already
        if not self.allocator.can_allocate(need + swa_need):
            return False
        seq.block_table += self.allocator.allocate(need)
        self._swa_grow(seq, num_positions)
        return True

    def reserve(self, seq: Sequence, num_positions: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_positions`` positions if blocks are free
        (no preemption); False when they are not."""
        return self._reserve(seq, num_positions)

    def _fit_chunk(self, seq: Sequence, count: int) -> int:
        """Reserve the blocks of ``seq``'s next ``count`` prompt tokens (the SWA groups' only:
        its full table was reserved whole at admission), as many as fit -> the tokens reserved
        (0: none). A chunk that completes the prompt reserves its first decode positions too."""
        while count > 0:
            done = seq.num_computed + count == seq.num_tokens
            if self._reserve(seq, seq.num_computed + count + (1 + self.num_lookahead if done else 0)):
                return count
            count = count // 2 if count > 1 else 0
        return 0

    def trim_window(self, seq: Sequence) -> None:
        """Free the SWA groups' blocks that every position ``seq`` still computes is past the
        window of: position ``p >= num_computed`` sees keys ``> p - window``, so blocks before
        the one holding ``num_computed - window`` are never read again."""
        if not self.num_swa_groups or not seq.swa_block_tables:
            return
        first = max(0, seq.num_computed - self.layout.sliding_window) // self.allocator.block_size
        first = min(first, len(seq.swa_block_tables[0]))
        if first <= seq.swa_start:
            return
        for table in seq.swa_block_tables:
            self.allocator.free(table[seq.swa_start : first])
            table[seq.swa_start : first] = [self.null_block] * (first - seq.swa_start)
        seq.swa_start = first

    def release(self, seq: Sequence) -> None:
        """Free a request's KV blocks (finished, aborted or preempted) and drop its pending taps:
        they reference whole batch-taps tensors ``[N, n_taps * H]``, held for as long as the
        caller keeps the Sequence, and only a running request's next step writes them."""
        self.allocator.free(seq.block_table)
        for table in seq.swa_block_tables:
            self.allocator.free(table[seq.swa_start :])
        seq.clear_pending_taps()
        seq.block_table = []
        seq.swa_block_tables = []
        seq.swa_start = 0
        seq.num_computed = 0
        seq.num_registered_blocks = 0

    @staticmethod
    def swa_hash(block_hash: bytes, group: int) -> bytes:
        """The name of an SWA group's block of the prefix ``block_hash`` names (group 0, the
        full layers, uses the hash itself)."""
        return block_hash + bytes([group + 1])

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[list[int]]]:
        """The cached blocks of ``seq``'s longest cached prefix, short of its last token: the
        full group's, and each SWA group's last window before its end (``[start, n)``, see
        :meth:`_swa_cached`)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return [], [[] for _ in range(self.num_swa_groups)]
        bs = self.allocator.block_size
        seq.block_hashes = block_hashes(seq.token_ids, bs, seq.block_hashes, seq.params.cache_salt)
        cached = self.allocator.lookup(seq.block_hashes[: (seq.num_tokens - 1) // bs])
        if not self.num_swa_groups:
            return cached, []
        n, swa = self._swa_cached(seq, len(cached))
        return cached[:n], swa

    def _swa_first(self, num_computed: int) -> int:
        """The first SWA block the positions from ``num_computed`` on still read."""
        return max(0, num_computed - self.layout.sliding_window) // self.allocator.block_size

    def _swa_cached(self, seq: Sequence, num_full: int) -> tuple[int, list[list[int]]]:
        """The longest prefix of ``n <= num_full`` cached full blocks whose last window is
        cached in every SWA group too -> (n, each group's blocks ``[_swa_first(n * bs), n)``).
        A group missing block ``m`` rules out every ``n > m`` whose window holds it, so the
        search goes on from ``n = m`` (at most ``num_full`` lookups a group, not a window each)."""
        bs = self.allocator.block_size
        n = num_full
        while n > 0:
            first = self._swa_first(n * bs)
            groups = []
            for g in range(self.num_swa_groups):
                names = [self.swa_hash(h, g) for h in reversed(seq.block_hashes[first:n])]
                found = self.allocator.lookup(names)  # from block n - 1 down, to the first miss
                if len(found) < n - first:
                    n = n - 1 - len(found)  # the missing block: no hit past it
                    break
                groups.append(found[::-1])
            else:
                return n, groups
        return 0, [[] for _ in range(self.num_swa_groups)]

    def _admission_count(self, seq: Sequence, cached: list[int], budget: int, has_prefill: bool) -> int | None:
        """The tokens of ``seq``'s first prefill step past its ``cached`` blocks within ``budget``
        (all of them without chunked prefill); None: the whole prompt waits for a later step."""
        num_new = seq.num_tokens - len(cached) * self.allocator.block_size
        if num_new > budget and has_prefill and not self.enable_chunked_prefill:
            return None
        return min(num_new, budget) if self.enable_chunked_prefill else num_new

    def _admit(self, seq: Sequence, cached: list[int], swa_cached: list[list[int]], num_compute: int) -> bool:
        """Give ``seq`` its block table for a prefill (``cached`` shared at its head; each SWA
        group's ``swa_cached`` at the end of its cached prefix, then blocks for the
        ``num_compute`` tokens of this step) and ``num_computed`` at the cached prefix's end;
        False when the blocks are not free."""
        bs = self.allocator.block_size
        need = self.allocator.blocks_needed(seq.num_tokens + 1 + self.num_lookahead, len(cached))
        swa_end = len(cached) * bs + num_compute + 1 + self.num_lookahead
        swa_need = self.num_swa_groups * self.allocator.blocks_needed(swa_end, len(cached))
        shared = [b for blocks in [cached, *swa_cached] for b in blocks]
        if not self.allocator.can_allocate(need + swa_need + self.allocator.num_unreferenced(shared)):
            return False
        self.allocator.share(shared)
        seq.block_table = cached + self.allocator.allocate(need)
        seq.num_computed = seq.num_admitted_cached_tokens = len(cached) * bs
        if self.num_swa_groups:
            seq.swa_start = self._swa_first(seq.num_computed) if cached else 0
            seq.swa_block_tables = [[self.null_block] * seq.swa_start + blocks for blocks in swa_cached]
            self._swa_grow(seq, swa_end)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed
        if self.enable_prefix_caching:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += seq.num_admitted_cached_tokens
        return True

    def _uncached_prompt_blocks(self, seq: Sequence) -> list[bytes]:
        """The hashes of the full blocks an admitted request's prefill is still computing (its
        prompt's, past those it registered or found cached)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        first = max(seq.num_registered_blocks, seq.num_admitted_cached_tokens // self.allocator.block_size)
        return seq.block_hashes[first : len(seq.prompt_token_ids) // self.allocator.block_size]

    def _waits_for_prefix(self, seq: Sequence, cached: list[int], in_flight: set[bytes]) -> bool:
        """True when ``seq`` should stay waiting because a request admitted earlier is computing
        the full blocks right after its cached prefix, covering at least half of what it would
        compute: admitted a step later it finds them cached (``n`` choices of one prompt, or
        requests sent together with one long system prompt, compute the prompt once). A short
        shared head (one block of a long prompt) is not worth the step it would wait."""
        if (not in_flight or not wait_for_shared_prefixes or not self.enable_prefix_caching
                or seq.params.prompt_logprobs is not None):
            return False
        bs = self.allocator.block_size
        num_shared = 0
        for h in seq.block_hashes[len(cached) : (seq.num_tokens - 1) // bs]:
            if h not in in_flight:
                break
            num_shared += 1
        return num_shared > 0 and 2 * num_shared * bs >= seq.num_tokens - len(cached) * bs

    def cache_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose K/V became final (prefix caching)."""
        if not self.enable_prefix_caching:
            return
        bs = self.allocator.block_size
        num_full = min(seq.num_final_positions, seq.num_tokens) // bs
        if num_full <= seq.num_registered_blocks:
            return
        # extended, never cut: a hash names its token prefix, and token ids are only appended
        seq.block_hashes = block_hashes(seq.token_ids[: num_full * bs], bs, seq.block_hashes,
                                        seq.params.cache_salt)
        for i in range(seq.num_registered_blocks, num_full):
            self.allocator.register(seq.block_table[i], seq.block_hashes[i])
            if i >= seq.swa_start:  # an SWA block not freed yet (else it stays unnamed)
                for g, table in enumerate(seq.swa_block_tables):
                    self.allocator.register(table[i], self.swa_hash(seq.block_hashes[i], g))
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> None:
        self.allocator.reset_prefix_cache()
        for seq in self.running + self.prefilling:
            seq.num_registered_blocks = 0

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def schedule(self) -> ScheduledBatch | None:
        if self._decode_turn and self.running:
            self._decode_turn = False
            return self._schedule_decode()
        prefill: list[Sequence] = []
        counts: list[int] = []
        budget = self.max_num_batched_tokens
        for seq in self.prefilling:  # chunked prefills in progress go first, oldest first
            if budget <= 0:
                break
            count = self._fit_chunk(seq, min(seq.num_tokens - seq.num_computed, budget))
            if count == 0:
                break  # no SWA block free for it (its full blocks are held since admission)
            prefill.append(seq)
            counts.append(count)
            budget -= count
        num_admitted = 0
        in_flight = {h for seq in self.prefilling for h in self._uncached_prompt_blocks(seq)}
        i = 0  # waiting requests before i wait for a prefix another request is computing
        while (i < len(self.waiting) and budget > 0
               and len(self.running) + len(self.prefilling) + num_admitted < self.max_num_seqs):
            seq = self.waiting[i]
            # A prefill computes every token past the cached prefix and samples the next, so
            # reserve one extra position plus the decode lookahead it will need next.
            cached, swa_cached = self._cached_prefix(seq)
            if self._waits_for_prefix(seq, cached, in_flight):
                i += 1
                continue
            count = self._admission_count(seq, cached, budget, bool(prefill))
            if count is None:
                break
            if not self._admit(seq, cached, swa_cached, count):
                if not cached or self.running or self.prefilling or num_admitted:
                    break
                # alone, a cached prefix can need more blocks than a cold start (its sliding
                # groups' window before the prefix end, then a whole chunk): compute it all
                cached, swa_cached = [], [[] for _ in range(self.num_swa_groups)]
                count = self._admission_count(seq, cached, budget, bool(prefill))
                if count is None or not self._admit(seq, cached, swa_cached, count):
                    break
            del self.waiting[i]
            in_flight.update(self._uncached_prompt_blocks(seq))
            seq.status = Status.RUNNING
            num_admitted += 1
            prefill.append(seq)
            counts.append(count)
            budget -= count
        if not prefill and not self.running and self.prefilling:
            # a chunked prefill cannot get its SWA blocks (not even for one token: a last
            # token's chunk also reserves the decode lookahead, which may take more blocks than
            # are free), and no decode will free any: the newest chunked request goes back to
            # waiting (its blocks free), as a preemption. One alone holds every block in use:
            # its last token needs at least what this one-token chunk does, so recomputing it
            # would come back here; it is refused instead of stalling or cycling
            if len(self.prefilling) == 1:
                seq = self.prefilling[0]
                raise RuntimeError(
                    f"request {seq.request_id}'s prompt ({seq.num_tokens} tokens) needs more KV "
                    f"blocks than the cache's {self.allocator.num_blocks} of "
                    f"{self.allocator.block_size} with its sliding window and decode lookahead; "
                    "raise num_kv_blocks or lower max_num_batched_tokens")
            self._preempt(self.prefilling[-1])
            return self.schedule()
        if prefill:
            for seq, n in zip(prefill, counts):
                completes = seq.num_computed + n == seq.num_tokens
                if completes and seq in self.prefilling:
                    self.prefilling.remove(seq)
                if completes:
                    self._enqueue(self.running, seq)
                elif seq not in self.prefilling:
                    self._enqueue(self.prefilling, seq)
            # a chunked prompt still in progress: the running requests decode next
            self._decode_turn = bool(self.prefilling)
            return ScheduledBatch(prefill, is_prefill=True, num_new_tokens=counts)
        return self._schedule_decode()

    def _schedule_decode(self) -> ScheduledBatch | None:
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
        preempted: set[Sequence] = set()  # identity-hashed: no scans of the running list
        for seq in list(self.running):
            if seq in preempted:
                continue
            while not self._reserve(seq, seq.num_tokens + self.num_lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            if seq not in preempted:
                scheduled.append(seq)
        return ScheduledBatch(scheduled, is_prefill=False) if scheduled else self.schedule()

    def _preempt(self, seq: Sequence) -> None:
        logger.warning("KV cache full: preempting request %d (recomputed later)", seq.request_id)
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        if self.is_priority:
            self._enqueue(self.waiting, seq)
        else:  # first in line again: it arrived before every waiting request
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
