"""vLLM's V1 request-level metric families on /metrics: the request phases (queue, prefill,
decode, inference), per-request token counts and max_tokens, tokens per engine step, and the
older ``time_per_output_token`` name of the inter-token latency.

Three levels: :class:`ServerMetrics` alone (buckets, rendering); :class:`AsyncEngine` stepping a
scripted fake engine on a fake clock (when a request counts as first scheduled: the start of the
step whose scheduler admitted it, kept through a preemption; a failed step's batch too); and a
live target-only server on a tiny random checkpoint (counts, sums against the responses' usage,
phases adding up to e2e, cumulative buckets, a well-formed exposition).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from laguna_dflash.config import SamplingParams
from laguna_dflash.engine.engine import StepError
from laguna_dflash.engine.sequence import Sequence, Status
from laguna_dflash.server import async_engine as async_engine_module
from laguna_dflash.server.async_engine import AsyncEngine, _Request
from laguna_dflash.server.metrics import (
    E2E_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    EngineSnapshot,
    RequestPhases,
    ServerMetrics,
    buckets_1_2_5,
)

PHASES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds")
TOKEN_HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                    "vllm:request_params_max_tokens")
NEW_HISTOGRAMS = (*PHASES, *TOKEN_HISTOGRAMS, "vllm:iteration_tokens_total",
                  "vllm:time_per_output_token_seconds", "vllm:request_params_n")

# ---- parsing the exposition --------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def parse_exposition(text: str) -> dict[str, dict]:
    """Text format 0.0.4, strictly: ``{family: {"type", "help", "samples": [(name, labels,
    value)]}}``. Each family has one HELP and one TYPE before its samples, every sample belongs
    to the family declared last (histograms: ``_bucket`` / ``_sum`` / ``_count``), label sets
    are well formed and every value is a float."""
    families: dict[str, dict] = {}
    current = None
    assert text.endswith("\n")
    for line in text.splitlines():
        assert line, "blank line in the exposition"
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            assert name not in families, f"{name} declared twice"
            families[name] = {"help": help_text, "type": None, "samples": []}
            current = name
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert name == current and families[name]["type"] is None, line
            assert kind in _SUFFIXES, line
            families[name]["type"] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"malformed sample line: {line!r}"
            name, raw_labels, raw_value = m.groups()
            family = families[current]
            assert name in [current + s for s in _SUFFIXES[family["type"]]], (current, line)
            labels = {}
            if raw_labels:
                pairs = _LABEL.findall(raw_labels)
                rebuilt = ",".join(f'{k}="{v}"' for k, v in pairs)
                assert rebuilt == raw_labels, f"malformed labels: {raw_labels!r}"
                labels = dict(pairs)
                assert len(labels) == len(pairs), f"repeated label: {line!r}"
            family["samples"].append((name, labels, float(raw_value)))
    return families


def histogram(families: dict[str, dict], name: str) -> tuple[list[tuple[float, float]], float, float]:
    """``([(le, cumulative count)], sum, count)`` of histogram ``name``, checked: typed
    histogram, one model_name label, bucket bounds ascending and ending at +Inf, counts
    cumulative (non-decreasing), the +Inf bucket equal to ``_count``."""
    family = families[name]
    assert family["type"] == "histogram", name
    buckets, total, count = [], None, None
    for sample, labels, value in family["samples"]:
        assert set(labels) <= {"model_name", "le"} and "model_name" in labels, labels
        if sample.endswith("_bucket"):
            buckets.append((float(labels["le"]), value))
        elif sample.endswith("_sum"):
            total = value
        else:
            count = value
    bounds = [le for le, _ in buckets]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds) and bounds[-1] == math.inf
    counts = [c for _, c in buckets]
    assert counts == sorted(counts), f"{name}: buckets not cumulative: {counts}"
    assert counts[-1] == count and count == int(count), name
    return buckets, total, count


# ---- ServerMetrics alone -----------------------------------------------------------------------


def test_1_2_5_buckets_reach_max_model_len():
    assert buckets_1_2_5(64) == (1, 2, 5, 10, 20, 50)
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
    assert buckets_1_2_5(1) == (1,)


def test_request_phases_from_times():
    assert RequestPhases.from_times(1.0, 3.0, 4.5, 9.0) == RequestPhases(2.0, 1.5, 4.5, 6.0)
    # aborted while queued: nothing but e2e; aborted after admission, before a token: queue only
    assert RequestPhases.from_times(1.0, None, None, None) == RequestPhases()
    assert RequestPhases.from_times(1.0, 2.0, None, None) == RequestPhases(queue_s=1.0)


def test_render_has_the_new_families_with_vllms_buckets():
    m = ServerMetrics("m")
    m.set_max_model_len(64)
    m.observe_tokens(1, ttft_s=0.2, itl_s=None)
    m.observe_tokens(2, ttft_s=None, itl_s=0.03)
    m.observe_tokens(1, ttft_s=None, itl_s=0.3)
    m.observe_iteration(7)
    m.observe_iteration(40)
    m.observe_finished("length", 2.0, 0, phases=RequestPhases(0.5, 0.2, 1.2, 1.4),
                       num_prompt_tokens=3, num_generation_tokens=4, max_tokens=4)
    m.observe_finished("abort", 0.7, 0, phases=RequestPhases(queue_s=0.7),
                       num_prompt_tokens=60, num_generation_tokens=0, max_tokens=16)
    families = parse_exposition(m.render(EngineSnapshot()))
    for name in NEW_HISTOGRAMS:
        assert families[name]["type"] == "histogram"
    for name in TOKEN_HISTOGRAMS:
        buckets, _, count = histogram(families, name)
        assert [le for le, _ in buckets] == [1, 2, 5, 10, 20, 50, math.inf]
        assert count == 2
    for name in PHASES:
        assert [le for le, _ in histogram(families, name)[0]] == [*E2E_BUCKETS, math.inf]
    assert [le for le, _ in histogram(families, "vllm:iteration_tokens_total")[0]] == [
        *ITERATION_TOKENS_BUCKETS, math.inf]
    queue, queue_sum, queue_count = histogram(families, "vllm:request_queue_time_seconds")
    assert (queue_sum, queue_count) == (pytest.approx(1.2), 2)
    assert dict(queue)[0.5] == 1 and dict(queue)[0.8] == 2
    assert histogram(families, "vllm:request_prefill_time_seconds")[2] == 1  # the abort had none
    prompt, prompt_sum, _ = histogram(families, "vllm:request_prompt_tokens")
    assert prompt_sum == 63 and dict(prompt)[5] == 1 and dict(prompt)[50] == 1
    assert dict(prompt)[math.inf] == 2  # 60 > max_model_len's last 1-2-5 bound
    gen, gen_sum, _ = histogram(families, "vllm:request_generation_tokens")
    assert gen_sum == 4 and dict(gen)[1] == 1  # 0 tokens is in the first bucket
    iteration, iteration_sum, _ = histogram(families, "vllm:iteration_tokens_total")
    assert iteration_sum == 47 and dict(iteration)[8] == 1 and dict(iteration)[64] == 2
    # the older name shares inter_token_latency's observations
    old = [s[1:] for s in families["vllm:time_per_output_token_seconds"]["samples"]]
    new = [s[1:] for s in families["vllm:inter_token_latency_seconds"]["samples"]]
    assert old == new and histogram(families, "vllm:time_per_output_token_seconds")[2] == 2


# ---- AsyncEngine on a scripted engine and a fake clock --------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t


class _ScriptedEngine:
    """Enough of LLMEngine for AsyncEngine's step loop: each ``step()`` applies the next
    scripted change to the requests and moves the clock one second on (the step's duration)."""

    def __init__(self, clock: _Clock, script) -> None:
        self.clock, self.script = clock, list(script)
        self.scheduler = SimpleNamespace(running=[], prefilling=[], waiting=[],
                                         num_prefix_queries=0, num_prefix_hits=0)
        self.allocator = SimpleNamespace(num_free_blocks=8, num_blocks=8)
        self.timings = SimpleNamespace(num_steps=0)
        self.spec_stats = None
        self.proposer = None
        self.max_model_len = 64
        self.aborted: list[Sequence] = []

    def step(self) -> None:
        change = self.script.pop(0)
        self.clock.t += 1.0
        change()

    def abort(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.aborted.append(seq)


def _scripted(monkeypatch, script) -> tuple[AsyncEngine, _Clock, _ScriptedEngine]:
    clock = _Clock()
    monkeypatch.setattr(async_engine_module, "time", clock)
    engine = _ScriptedEngine(clock, script)
    loop = AsyncEngine(engine, ServerMetrics("m"))
    monkeypatch.setattr(loop, "_deliver", lambda items: None)
    return loop, clock, engine


def _request(loop: AsyncEngine, rid: str, prompt_len: int, max_tokens: int) -> _Request:
    params = SamplingParams(max_tokens=max_tokens)
    req = _Request(rid, list(range(prompt_len)), params, None, None, arrival=0.0)
    req.seq = Sequence(len(loop._active), list(range(prompt_len)), params)
    loop._active[rid] = req
    return req


def _emit(seq: Sequence, *tokens: int) -> None:
    seq.status = Status.RUNNING
    seq.append_tokens(list(tokens), max_model_len=64)


def _values(loop: AsyncEngine) -> dict[str, dict]:
    return parse_exposition(loop.metrics.render(loop.snapshot))


def test_first_scheduled_is_the_start_of_the_admitting_step(monkeypatch):
    """A (2 tokens) is admitted by step 1 (a chunked prefill: no token yet), gets its first
    token in step 2 and its last in step 3. C is admitted with it, preempted in step 2 and
    readmitted to finish in step 3 (its queue time is the first wait only). B waits until step 3
    admits it and finishes in step 4 with one token. Steps start at 10, 20, 30, 40 and take 1 s;
    everything arrived at 0."""
    reqs = {}

    def step1():
        reqs["a"].seq.status = reqs["c"].seq.status = Status.RUNNING

    def step2():
        _emit(reqs["a"].seq, 5)
        reqs["c"].seq.status = Status.WAITING  # preempted before any token

    def step3():
        _emit(reqs["a"].seq, 6)
        _emit(reqs["c"].seq, 7)
        reqs["b"].seq.status = Status.RUNNING

    def step4():
        _emit(reqs["b"].seq, 8)

    loop, clock, _ = _scripted(monkeypatch, [step1, step2, step3, step4])
    reqs["a"] = _request(loop, "a", prompt_len=3, max_tokens=2)
    reqs["b"] = _request(loop, "b", prompt_len=5, max_tokens=1)
    reqs["c"] = _request(loop, "c", prompt_len=4, max_tokens=1)
    for start in (10.0, 20.0, 30.0, 40.0):
        clock.t = start
        loop._step()
    assert not loop._active
    a, b, c = reqs["a"], reqs["b"], reqs["c"]
    assert (a.scheduled_time, a.first_token_time, a.last_token_time) == (10.0, 21.0, 31.0)
    assert (c.scheduled_time, c.first_token_time) == (10.0, 31.0)
    assert (b.scheduled_time, b.first_token_time, b.last_token_time) == (30.0, 41.0, 41.0)
    families = _values(loop)
    expected = {  # a, c, b
        "vllm:request_queue_time_seconds": 10 + 10 + 30,
        "vllm:request_prefill_time_seconds": 11 + 21 + 11,
        "vllm:request_decode_time_seconds": 10 + 0 + 0,
        "vllm:request_inference_time_seconds": 21 + 21 + 11,
        "vllm:request_prompt_tokens": 3 + 4 + 5,
        "vllm:request_generation_tokens": 2 + 1 + 1,
        "vllm:request_params_max_tokens": 2 + 1 + 1,
        "vllm:e2e_request_latency_seconds": 31 + 31 + 41,
    }
    for name, total in expected.items():
        _, got_sum, got_count = histogram(families, name)
        assert (got_sum, got_count) == (total, 3), name
    # steps 2, 3, 4 delivered tokens: a's prompt + 1; a's 1 + c's prompt + 1; b's prompt + 1
    _, iteration_sum, iteration_count = histogram(families, "vllm:iteration_tokens_total")
    assert (iteration_sum, iteration_count) == ((3 + 1) + (1 + 4 + 1) + (5 + 1), 3)


def test_a_failed_steps_batch_counts_as_scheduled(monkeypatch):
    """A step that raises StepError fails its batch: those requests were admitted (queue time
    observed, no prefill), a request still waiting is not; the waiting one then runs."""
    reqs = {}

    def failing():
        reqs["d"].seq.status = Status.RUNNING
        raise StepError([reqs["d"].seq], RuntimeError("injected"))

    def fine():
        _emit(reqs["e"].seq, 1)

    loop, clock, engine = _scripted(monkeypatch, [failing, fine])
    reqs["d"] = _request(loop, "d", prompt_len=2, max_tokens=1)
    reqs["e"] = _request(loop, "e", prompt_len=2, max_tokens=1)
    clock.t = 5.0
    loop._step()
    assert engine.aborted == [reqs["d"].seq] and "d" not in loop._active
    assert reqs["d"].scheduled_time == 5.0 and reqs["e"].scheduled_time is None
    clock.t = 7.0
    loop._step()
    families = _values(loop)
    _, queue_sum, queue_count = histogram(families, "vllm:request_queue_time_seconds")
    assert (queue_sum, queue_count) == (5.0 + 7.0, 2)
    _, prefill_sum, prefill_count = histogram(families, "vllm:request_prefill_time_seconds")
    assert (prefill_sum, prefill_count) == (1.0, 1)  # e only
    assert histogram(families, "vllm:request_prompt_tokens")[2] == 2


# ---- a live server ----------------------------------------------------------------------------

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def serial_server(tmp_path_factory):
    """A target-only server (no tokenizer: token-id prompts) running one request at a time, so
    concurrent requests queue behind each other."""
    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path_factory.mktemp("metrics") / "target", seed=0)
    with df.tiny_http_server(target, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1") as http:
        yield http


def _scrape(http: httpx.Client) -> tuple[str, dict[str, dict]]:
    text = http.get("/metrics").text
    return text, parse_exposition(text)


def _wait_idle(http: httpx.Client) -> None:
    deadline = time.monotonic() + 15  # the engine thread publishes after its step
    while (h := http.get("/health").json())["num_requests_running"] or h["num_requests_waiting"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_live_request_histograms_match_the_responses(serial_server):
    """Concurrent requests (some streamed, one with n=2) on a one-at-a-time server: each new
    histogram counts every engine request once; the token sums are the prompts' lengths, the
    usage's completion tokens and the max_tokens sent; queue + prefill is TTFT, inference is
    prefill + decode, and the phases add up to e2e; inference intervals never overlap (one
    request runs at a time), so they sum to at most the wall time of the burst."""
    http = serial_server
    _wait_idle(http)
    _, before = _scrape(http)
    bodies = [{"prompt": [(7 * i + j) % 60 + 1 for j in range(3 + 4 * i)], "max_tokens": 4 + 3 * i,
               "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1} for i in range(5)]
    bodies.append({"prompt": [9, 8, 7], "max_tokens": 5, "temperature": 0.8, "seed": 1, "n": 2,
                   "ignore_eos": True})
    usages: list[dict] = [{}] * len(bodies)

    def send(i: int) -> None:
        body = bodies[i]
        if body.get("stream"):
            body = {**body, "stream_options": {"include_usage": True}}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            chunks = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
            usages[i] = json.loads(chunks[-1])["usage"]
        else:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usages[i] = r.json()["usage"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wall = time.monotonic() - t0
    _wait_idle(http)
    text, after = _scrape(http)
    if (parser := _prometheus_parser()) is not None:  # the reference parser reads it too
        parsed = {f.name: f.type for f in parser(text)}
        for name in NEW_HISTOGRAMS:
            assert parsed[name] == "histogram", name

    def delta(name: str) -> tuple[float, float]:
        b, a = histogram(before, name), histogram(after, name)
        return a[1] - b[1], a[2] - b[2]

    num_requests = len(bodies) + 1  # n=2 is two engine requests
    for name in (*PHASES, *TOKEN_HISTOGRAMS, "vllm:e2e_request_latency_seconds"):
        total, count = delta(name)
        assert count == num_requests, (name, count)
        assert total >= 0, name
    for name in TOKEN_HISTOGRAMS:
        assert [le for le, _ in histogram(after, name)[0]] == [1, 2, 5, 10, 20, 50, math.inf]
    prompt_tokens = sum(len(b["prompt"]) * b.get("n", 1) for b in bodies)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    # usage counts a prompt once per response, the engine (and vLLM's histogram) once per choice
    assert sum(u["prompt_tokens"] for u in usages) == sum(len(b["prompt"]) for b in bodies)
    assert delta("vllm:request_prompt_tokens")[0] == prompt_tokens
    assert delta("vllm:request_generation_tokens")[0] == completion_tokens
    assert completion_tokens == sum(b["max_tokens"] * b.get("n", 1) for b in bodies)  # ignore_eos
    assert delta("vllm:request_params_max_tokens")[0] == completion_tokens
    # every prompt once (at its first token) and every generated token, over the steps
    iteration_sum, iteration_count = delta("vllm:iteration_tokens_total")
    assert iteration_sum == prompt_tokens + completion_tokens
    assert num_requests <= iteration_count <= completion_tokens
    queue, prefill, decode, inference = (delta(name)[0] for name in PHASES)
    ttft = delta("vllm:time_to_first_token_seconds")[0]
    e2e = delta("vllm:e2e_request_latency_seconds")[0]
    assert queue + prefill == pytest.approx(ttft, abs=1e-6)
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert 0 <= e2e - (queue + prefill + decode) < 0.05 * num_requests
    assert inference <= wall
    assert queue > 0 and prefill > 0 and decode > 0
    old = [s[1:] for s in after["vllm:time_per_output_token_seconds"]["samples"]]
    assert old == [s[1:] for s in after["vllm:inter_token_latency_seconds"]["samples"]]
    # n once per prompt of a request (vLLM's parent request), not once per choice
    assert delta("vllm:request_params_n") == (sum(b.get("n", 1) for b in bodies), len(bodies))
    n_buckets = dict(histogram(after, "vllm:request_params_n")[0])
    assert list(n_buckets) == [1, 2, 5, 10, 20, math.inf]


def _prometheus_parser():
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return None
    return text_string_to_metric_families
