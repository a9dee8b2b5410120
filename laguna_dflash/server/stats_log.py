"""Periodic log lines while the server is busy, in vLLM's format (users paste them into issues)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from .metrics import EngineSnapshot, ServerMetrics, SpecCounters

logger = logging.getLogger(__name__)


def format_spec_decoding_line(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                              accepted_per_pos: Sequence[int], elapsed_s: float) -> str:
    """vLLM's "SpecDecoding metrics" line for counter deltas over ``elapsed_s`` seconds.

    Mean acceptance length = 1 + accepted / drafts (it counts the bonus token); per-position
    acceptance rate i = accepted at position i / drafts.
    """
    drafts = max(num_drafts, 1)
    elapsed = max(elapsed_s, 1e-9)
    per_pos = ", ".join(f"{n / drafts:.3f}" for n in accepted_per_pos)
    rate = 100.0 * num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + num_accepted_tokens / drafts:.2f}, "
        f"Accepted throughput: {num_accepted_tokens / elapsed:.2f} tokens/s, "
        f"Drafted throughput: {num_draft_tokens / elapsed:.2f} tokens/s, "
        f"Accepted: {num_accepted_tokens} tokens, Drafted: {num_draft_tokens} tokens, "
        f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: {rate:.1f}%"
    )


class StatsLogger:
    """Logs throughput / queue / KV usage and the SpecDecoding line every ``interval_s`` seconds,
    but only for intervals in which something happened."""

    def __init__(self, metrics: ServerMetrics, interval_s: float) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_tokens = (0, 0)
        self._last_spec: SpecCounters | None = None

    def maybe_log(self, snap: EngineSnapshot, now: float | None = None) -> None:
        if self.interval_s <= 0:
            return
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        prompt, generated = self.metrics.totals()
        d_prompt, d_gen = prompt - self._last_tokens[0], generated - self._last_tokens[1]
        busy = d_prompt or d_gen or snap.num_running or snap.num_waiting
        if busy:
            logger.info(
                "Engine: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                d_prompt / elapsed, d_gen / elapsed, snap.num_running, snap.num_waiting,
                100.0 * snap.kv_cache_usage,
            )
        spec, last = snap.spec, self._last_spec
        if spec is not None:
            prev = last or SpecCounters(spec.num_speculative_tokens, 0, 0, 0,
                                        (0,) * len(spec.num_accepted_tokens_per_pos))
            if spec.num_drafts > prev.num_drafts:
                logger.info(format_spec_decoding_line(
                    spec.num_drafts - prev.num_drafts,
                    spec.num_draft_tokens - prev.num_draft_tokens,
                    spec.num_accepted_tokens - prev.num_accepted_tokens,
                    [a - b for a, b in zip(spec.num_accepted_tokens_per_pos,
                                           prev.num_accepted_tokens_per_pos)],
                    elapsed))
        self._last_time, self._last_tokens, self._last_spec = now, (prompt, generated), spec
