"""Prometheus metrics with vLLM's names, hand-written in the text exposition format (0.0.4).

Dashboards and ``vllm bench serve`` read ``vllm:*`` names: ``vllm bench serve`` takes the
``vllm:spec_decode_*_total`` deltas around a run to print acceptance rate, acceptance length
(``1 + accepted / drafts``) and per-position acceptance (``per_pos[i] / drafts``). Counters are
written by the engine thread; ``render`` may run on any thread, so everything sits behind one lock.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class SpecCounters:
    """Engine-wide spec-decode counters (vLLM meaning), copied by the engine thread."""

    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]


@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent view of the engine taken by the engine thread after each iteration."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_steps: int = 0
    spec: SpecCounters | None = None
    # prefix caching: prompt tokens looked up at admission, and found cached
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` buckets, ``_sum``, ``_count``)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return "+Inf" if value == float("inf") else repr(float(value))


class ServerMetrics:
    """Request-level counters and latency histograms, plus rendering of the engine snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.request_success = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    # ---- recording (engine thread) ---------------------------------------------------------

    def add_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def observe_tokens(self, n: int, ttft_s: float | None, itl_s: float | None) -> None:
        """``n`` new tokens of one request in one step; first ones give TTFT, later ones ITL."""
        with self._lock:
            self.generation_tokens += n
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if itl_s is not None:
                self.itl.observe(itl_s)

    def observe_finished(self, reason: str, e2e_s: float, num_preemptions: int) -> None:
        with self._lock:
            self.request_success[reason] = self.request_success.get(reason, 0) + 1
            self.e2e.observe(e2e_s)
            self.num_preemptions += num_preemptions

    def totals(self) -> tuple[int, int]:
        """(prompt tokens, generation tokens) so far, for the periodic log line."""
        with self._lock:
            return self.prompt_tokens, self.generation_tokens

    # ---- rendering -------------------------------------------------------------------------

    def render(self, snap: EngineSnapshot) -> str:
        """The Prometheus text exposition of every metric."""
        base = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{{{base}{labels}}} {_fmt(value)}")

        def histogram(name: str, help_text: str, h: Histogram) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} histogram")
            running = 0
            for le, c in zip(h.buckets, h.counts):
                running += c
                out.append(f'{name}_bucket{{{base},le="{_fmt(float(le))}"}} {running}')
            out.append(f'{name}_bucket{{{base},le="+Inf"}} {h.count}')
            out.append(f"{name}_sum{{{base}}} {_fmt(float(h.total))}")
            out.append(f"{name}_count{{{base}}} {h.count}")

        with self._lock:
            family("vllm:num_requests_running", "gauge", "Requests in the running batch.",
                   [("", snap.num_running)])
            family("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                   [("", snap.num_waiting)])
            family("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0-1).",
                   [("", snap.kv_cache_usage)])
            family("laguna_dflash:kv_cache_free_blocks", "gauge", "Free KV cache blocks.",
                   [("", snap.num_free_blocks)])
            family("laguna_dflash:kv_cache_total_blocks", "gauge", "KV cache blocks in all.",
                   [("", snap.num_blocks)])
            family("vllm:prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                   [("", self.prompt_tokens)])
            family("vllm:prefix_cache_queries_total", "counter",
                   "Prompt tokens looked up in the prefix cache.", [("", snap.num_prefix_queries)])
            family("vllm:prefix_cache_hits_total", "counter",
                   "Prompt tokens found in the prefix cache (not recomputed).",
                   [("", snap.num_prefix_hits)])
            family("vllm:generation_tokens_total", "counter", "Generated tokens.",
                   [("", self.generation_tokens)])
            family("vllm:request_success_total", "counter", "Finished requests by finish reason.",
                   [(f',finished_reason="{r}"', n) for r, n in self.request_success.items()])
            family("vllm:num_preemptions_total", "counter",
                   "Preemptions of finished requests (counted when they finish).",
                   [("", self.num_preemptions)])
            histogram("vllm:time_to_first_token_seconds", "Time to first token.", self.ttft)
            histogram("vllm:inter_token_latency_seconds",
                      "Time between engine steps that delivered tokens to a request.", self.itl)
            histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", self.e2e)
        spec = snap.spec
        if spec is not None:
            family("vllm:spec_decode_num_drafts_total", "counter", "Speculative steps (drafts).",
                   [("", spec.num_drafts)])
            family("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                   [("", spec.num_draft_tokens)])
            family("vllm:spec_decode_num_accepted_tokens_total", "counter",
                   "Draft tokens accepted.", [("", spec.num_accepted_tokens)])
            family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted draft tokens by position in the draft.",
                   [(f',position="{i}"', n) for i, n in enumerate(spec.num_accepted_tokens_per_pos)])
        return "\n".join(out) + "\n"
