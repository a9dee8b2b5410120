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
# vLLM gives e2e and the four request phases (queue, prefill, decode, inference) one list of
# buckets; the phases share this module's e2e list, so their buckets line up with e2e's (vLLM's
# list, as far as known here, starts at 0.3 s; the 0.01 / 0.05 / 0.1 s bounds in front are this
# module's, which a fast engine's queue and prefill times need)
REQUEST_PHASE_BUCKETS = E2E_BUCKETS
# vLLM's fixed list for tokens per engine step (some versions derive it from the CUDA graph
# capture sizes instead; this server's graph sizes are not known here, so the fixed list)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's buckets for a request's ``n`` (its choices)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# before the engine tells its max_model_len (AsyncEngine sets it): the engine's own default cap
DEFAULT_MAX_MODEL_LEN = 8192
FINISHED_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... while at most ``max_value`` (vLLM's buckets for per-request
    token counts, up to max_model_len; larger values land in ``+Inf`` only)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


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


@dataclass(frozen=True)
class RequestPhases:
    """One request's intervals (seconds), vLLM's V1 request phases; None where the request
    never reached the phase's end (e.g. aborted while queued, or before its first token).

    - ``queue_s``: arrival -> first scheduled (the start of the engine step that first computed
      any of its prompt; a preempted request's later waits are not counted);
    - ``prefill_s``: first scheduled -> first output token;
    - ``decode_s``: first output token -> last output token (0 for a single token);
    - ``inference_s``: first scheduled -> last output token (prefill + decode).
    """

    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None

    @classmethod
    def from_times(cls, arrival: float, scheduled: float | None, first_token: float | None,
                   last_token: float | None) -> RequestPhases:
        """The phases from the request's timestamps (one monotonic clock)."""
        return cls(
            queue_s=None if scheduled is None else scheduled - arrival,
            prefill_s=None if scheduled is None or first_token is None else first_token - scheduled,
            decode_s=None if first_token is None or last_token is None else last_token - first_token,
            inference_s=None if scheduled is None or last_token is None else last_token - scheduled)


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
        # per finished request: its phases (see RequestPhases), token counts and max_tokens
        self.queue_time = Histogram(REQUEST_PHASE_BUCKETS)
        self.prefill_time = Histogram(REQUEST_PHASE_BUCKETS)
        self.decode_time = Histogram(REQUEST_PHASE_BUCKETS)
        self.inference_time = Histogram(REQUEST_PHASE_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.params_n = Histogram(PARAMS_N_BUCKETS)
        self.set_max_model_len(DEFAULT_MAX_MODEL_LEN)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Size the per-request token histograms' 1-2-5 buckets up to ``max_model_len`` (they
        start empty again: call it before serving)."""
        buckets = buckets_1_2_5(max_model_len)
        with self._lock:
            self.request_prompt_tokens = Histogram(buckets)
            self.request_generation_tokens = Histogram(buckets)
            self.request_max_tokens = Histogram(buckets)

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

    def observe_params_n(self, n: int) -> None:
        """One prompt's ``n`` (its choices, each an engine request of its own), once when the
        engine accepted them all (serving.Serving.start), as vLLM counts its parent request."""
        with self._lock:
            self.params_n.observe(n)

    def observe_iteration(self, num_tokens: int) -> None:
        """One engine step's tokens, vLLM's way: the new output tokens of every request, plus
        the whole prompt of each request whose first output token came in this step."""
        with self._lock:
            self.iteration_tokens.observe(num_tokens)

    def observe_finished(self, reason: str, e2e_s: float, num_preemptions: int, *,
                         phases: RequestPhases | None = None,
                         num_prompt_tokens: int | None = None,
                         num_generation_tokens: int | None = None,
                         max_tokens: int | None = None) -> None:
        """A request ended (any reason). The request-level histograms take what is given:
        each phase that it reached, its prompt and generated token counts, its max_tokens."""
        with self._lock:
            self.request_success[reason] = self.request_success.get(reason, 0) + 1
            self.e2e.observe(e2e_s)
            self.num_preemptions += num_preemptions
            if phases is not None:
                for h, value in ((self.queue_time, phases.queue_s),
                                 (self.prefill_time, phases.prefill_s),
                                 (self.decode_time, phases.decode_s),
                                 (self.inference_time, phases.inference_s)):
                    if value is not None:
                        h.observe(value)
            if num_prompt_tokens is not None:
                self.request_prompt_tokens.observe(num_prompt_tokens)
            if num_generation_tokens is not None:
                self.request_generation_tokens.observe(num_generation_tokens)
            if max_tokens is not None:
                self.request_max_tokens.observe(max_tokens)

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
            # vLLM's older name of the same histogram (still emitted by some versions)
            histogram("vllm:time_per_output_token_seconds",
                      "Time between engine steps that delivered tokens to a request (the older "
                      "name of vllm:inter_token_latency_seconds).", self.itl)
            histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", self.e2e)
            histogram("vllm:request_queue_time_seconds",
                      "Arrival to the start of the engine step that first computed the request's "
                      "prompt.", self.queue_time)
            histogram("vllm:request_prefill_time_seconds",
                      "First scheduled to first output token.", self.prefill_time)
            histogram("vllm:request_decode_time_seconds",
                      "First output token to last output token.", self.decode_time)
            histogram("vllm:request_inference_time_seconds",
                      "First scheduled to last output token.", self.inference_time)
            histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                      self.request_prompt_tokens)
            histogram("vllm:request_generation_tokens",
                      "Generated tokens of each finished request.", self.request_generation_tokens)
            histogram("vllm:request_params_max_tokens",
                      "The max_tokens parameter of each finished request.", self.request_max_tokens)
            histogram("vllm:request_params_n", "The n parameter of each prompt of a request.",
                      self.params_n)
            histogram("vllm:iteration_tokens_total",
                      "Tokens per engine step: new output tokens, plus the prompts of requests "
                      "whose first token came in the step.", self.iteration_tokens)
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
