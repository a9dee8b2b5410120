"""Server building blocks without a server: incremental detokenization, stop strings, sampling
field checks, Prometheus rendering and the SpecDecoding log line."""

from __future__ import annotations

import logging
import random

import pytest

from laguna_dflash.server.detokenizer import IncrementalDetokenizer, OutputText
from laguna_dflash.server.errors import APIError
from laguna_dflash.server.metrics import EngineSnapshot, ServerMetrics, SpecCounters
from laguna_dflash.server.protocol import ChatCompletionRequest, CompletionRequest
from laguna_dflash.server.sampling import (
    build_sampling_params,
    reject_unsupported,
    resolve_max_tokens,
    stop_strings,
)
from laguna_dflash.server.stats_log import StatsLogger, format_spec_decoding_line

VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import hf_fixtures as hf
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    hf.make_tokenizer(d, VOCAB, update_model_config=False)
    return AutoTokenizer.from_pretrained(str(d))


def _stream(tokenizer, ids, stop=(), include=False, skip=True, min_tokens=0):
    """Feed ids one at a time like the server does; return (streamed deltas, final OutputText)."""
    out = OutputText(IncrementalDetokenizer(tokenizer, skip), tuple(stop), include, min_tokens)
    deltas = []
    for t in ids:
        if out.add_token(t):
            break
        deltas.append(out.take(final=False))
    else:
        out.finish()
    deltas.append(out.take(final=True))
    return deltas, out


def test_incremental_text_equals_full_decode_on_multibyte_text(tokenizer):
    text = "héllo wörld ✓ 日本語 naïve café — ünïcödé 🙂 def f(x):\n    return x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # byte-level pieces: many chars span several tokens
    deltas, out = _stream(tokenizer, ids)
    assert "".join(deltas) == out.text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)  # never a half character


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_full_decode_on_random_ids(tokenizer, skip):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        deltas, out = _stream(tokenizer, ids, skip=skip)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_stop_string_never_streamed_and_text_cut_before_it(tokenizer):
    text = "alpha beta gamma delta epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, out = _stream(tokenizer, ids, stop=("gamma", "zeta"))
    assert out.stop_hit == "gamma"
    assert "".join(deltas) == out.text == "alpha beta "
    deltas, out = _stream(tokenizer, ids, stop=["delta", "a g"], include=True)
    assert out.stop_hit == "a g" and "".join(deltas) == "alpha beta g"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """As in vLLM, a stop string inside the first min_tokens tokens does not stop the request."""
    text = "alpha beta gamma delta gamma epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first_gamma = next(i for i in range(len(ids)) if "gamma" in tokenizer.decode(ids[: i + 1]))
    deltas, out = _stream(tokenizer, ids, stop=("gamma",), min_tokens=first_gamma + 1)
    assert out.stop_hit == "gamma" and "".join(deltas) == out.text == "alpha beta gamma delta "
    deltas, out = _stream(tokenizer, ids, stop=("gamma",), min_tokens=len(ids))
    assert out.stop_hit is None and out.text == text


def test_stop_string_in_the_held_back_tail_is_found_at_the_end(tokenizer):
    ids = tokenizer.encode("one two", add_special_tokens=False)
    deltas, out = _stream(tokenizer, ids, stop=("two",))
    assert "".join(deltas) == "one " and out.stop_hit == "two"


def _completion(**fields):
    return CompletionRequest(prompt="x", **fields)


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"),
    ({"logit_bias": {"3": -100.5}}, "logit_bias"),
    ({"min_tokens": 5}, "min_tokens"),  # above max_tokens (4)
    ({"cache_salt": ""}, "cache_salt"),
])
def test_bad_sampling_values_are_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as info:
        build_sampling_params(_completion(**fields), 4, None, {})
    assert info.value.status == 400 and info.value.param == param


def test_sampling_defaults_and_generation_config():
    p = build_sampling_params(_completion(top_k=-1), 4, 2, {})
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (1.0, 1.0, 0, 4, 2)
    p = build_sampling_params(_completion(temperature=0.0), 4, None,
                              {"temperature": 0.7, "top_k": 20, "min_p": 0.05})
    assert (p.temperature, p.top_k, p.min_p) == (0.0, 20, 0.05)  # request wins, defaults fill
    assert build_sampling_params(_completion(min_p=0.1), 4, None, {"min_p": 0.05}).min_p == 0.1
    assert build_sampling_params(_completion(cache_salt="tenant"), 4, None, {}).cache_salt == "tenant"
    assert build_sampling_params(_completion(), 4, None, {}).cache_salt is None
    with pytest.raises(APIError, match="logprobs must be in"):
        build_sampling_params(_completion(), 4, 21, {})


def test_penalty_fields_and_the_generation_config_repetition_penalty():
    p = build_sampling_params(_completion(presence_penalty=0.5, frequency_penalty=-1.0,
                                          logit_bias={"7": -100, "12": 2.5}), 4, None, {})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.0)
    assert p.logit_bias == {7: -100.0, 12: 2.5} and p.has_penalties
    assert not build_sampling_params(_completion(), 4, None, {}).has_penalties
    p = build_sampling_params(_completion(), 4, None, {"repetition_penalty": 1.1})
    assert p.repetition_penalty == 1.1 and p.has_penalties  # generation_config.json's default
    p = build_sampling_params(_completion(repetition_penalty=1.0), 4, None, {"repetition_penalty": 1.1})
    assert p.repetition_penalty == 1.0 and not p.has_penalties  # the request wins


def test_max_tokens_rules():
    assert resolve_max_tokens(None, 10, 100, 16) == 16
    assert resolve_max_tokens(None, 95, 100, 16) == 5  # a default never overflows the context
    assert resolve_max_tokens(None, 10, 100, None) == 90
    for bad in (0, -3, 91):
        with pytest.raises(APIError) as info:
            resolve_max_tokens(bad, 10, 100, 16)
        assert info.value.status == 400 and info.value.param == "max_tokens"
    with pytest.raises(APIError, match="maximum context length is 100"):
        resolve_max_tokens(91, 10, 100, 16)
    # chat has no echo: its message must not offer 0 as a way out; completions with echo take 0
    with pytest.raises(APIError, match=r"max_completion_tokens must be at least 1 \(0 is taken only"):
        resolve_max_tokens(0, 10, 100, None, "max_completion_tokens")
    assert resolve_max_tokens(0, 10, 100, 16, allow_zero=True) == 0
    with pytest.raises(APIError, match="max_tokens must be at least 0, got -1"):
        resolve_max_tokens(-1, 10, 100, 16, allow_zero=True)
    # the generation_config.json's max_new_tokens caps the budget, asked for or default; a
    # request past the context is still an error, not silently capped
    assert resolve_max_tokens(50, 10, 100, 16, cap=20) == 20
    assert resolve_max_tokens(5, 10, 100, 16, cap=20) == 5
    assert resolve_max_tokens(None, 10, 100, None, cap=20) == 20
    assert resolve_max_tokens(None, 10, 100, 16, cap=4) == 4
    assert resolve_max_tokens(0, 10, 100, 16, allow_zero=True, cap=4) == 0
    with pytest.raises(APIError, match="maximum context length is 100"):
        resolve_max_tokens(91, 10, 100, 16, cap=20)


_USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("request_, param, fix", [
    (CompletionRequest(prompt="x", n=0), "n", "must be in"),
    (CompletionRequest(prompt="x", n=65), "n", "must be in"),
    (CompletionRequest(prompt="x", best_of=2), "best_of", "set it to 1"),
    (CompletionRequest(prompt="x", suffix="y"), "suffix", "leave suffix out"),
    (CompletionRequest(prompt="x", use_beam_search=True), "use_beam_search",
     "leave use_beam_search out"),
    (CompletionRequest(prompt="x", stream_options={"include_usage": True}), "stream_options",
     "set stream=true"),
    (ChatCompletionRequest(messages=_USER, stream=False, stream_options={"include_usage": True}),
     "stream_options", "set stream=true"),
    # were ignored with a 200: a reply with no function call, no echoed message (tools and
    # tool_choice: tests/test_server_tool_calls.py)
    (ChatCompletionRequest(messages=_USER, functions=[{"name": "f", "parameters": {}}]),
     "functions", "leave functions out"),
    (ChatCompletionRequest(messages=_USER, function_call={"name": "f"}), "function_call",
     "leave function_call out"),
    (ChatCompletionRequest(messages=_USER, echo=True), "echo", "leave echo out"),
    # vLLM's 400: both sent true
    (ChatCompletionRequest(messages=_USER, continue_final_message=True, add_generation_prompt=True),
     "add_generation_prompt", "leave add_generation_prompt out"),
])
def test_unsupported_fields_are_rejected(request_, param, fix):
    """Each rejection names its field and says how to fix the request."""
    with pytest.raises(APIError) as info:
        reject_unsupported(request_)
    assert info.value.status == 400 and info.value.param == param
    assert fix in info.value.message


@pytest.mark.parametrize("request_", [
    CompletionRequest(prompt="x", best_of=1, suffix=""),
    ChatCompletionRequest(messages=_USER, tools=[{"type": "function", "function": {"name": "f"}}],
                          tool_choice="none", parallel_tool_calls=False),
    ChatCompletionRequest(messages=_USER, response_format={"type": "text"}),
    ChatCompletionRequest(messages=_USER, continue_final_message=True),  # the default yields
    ChatCompletionRequest(messages=_USER, continue_final_message=True, add_generation_prompt=False),
    CompletionRequest(prompt="x", response_format={"type": "text"}, bad_words=[],
                      use_beam_search=False, guided_json=None),
    # structured outputs are checked and compiled by Serving.structured_constraint
    # (tests/test_server_structured_outputs.py), not refused here
    ChatCompletionRequest(messages=_USER, response_format={"type": "json_object"}),
    CompletionRequest(prompt="x", guided_regex="a+"),
    ChatCompletionRequest(messages=_USER, structured_outputs={"choice": ["a", "b"]}),
    ChatCompletionRequest(messages=_USER, tool_choice="auto", functions=[], function_call="none",
                          echo=False),
])
def test_default_valued_fields_are_accepted(request_):
    reject_unsupported(request_)


def test_stop_field_forms():
    assert stop_strings(_completion(stop="x")) == ("x",)
    assert stop_strings(_completion(stop=["a", "bc"])) == ("a", "bc")
    assert stop_strings(_completion()) == ()
    with pytest.raises(APIError):
        stop_strings(_completion(stop=["a", ""]))


def test_error_body_shape():
    body = APIError(404, "The model `x` does not exist.", "model").body()
    assert body == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}}


def _parse(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def test_metrics_render_names_histograms_and_escaping():
    m = ServerMetrics('m"1')
    m.add_prompt_tokens(7)
    m.observe_tokens(2, ttft_s=0.03, itl_s=None)
    m.observe_tokens(3, ttft_s=None, itl_s=0.02)
    m.observe_finished("length", 0.4, num_preemptions=1)
    spec = SpecCounters(3, num_drafts=4, num_draft_tokens=12, num_accepted_tokens=5,
                        num_accepted_tokens_per_pos=(3, 2, 0))
    text = m.render(EngineSnapshot(num_running=1, num_waiting=2, num_free_blocks=6, num_blocks=8,
                                   spec=spec))
    v = _parse(text)
    label = 'model_name="m\\"1"'
    assert v[f"vllm:prompt_tokens_total{{{label}}}"] == 7
    assert v[f"vllm:generation_tokens_total{{{label}}}"] == 5
    assert v[f'vllm:request_success_total{{{label},finished_reason="length"}}'] == 1
    assert v[f"vllm:kv_cache_usage_perc{{{label}}}"] == pytest.approx(0.25)
    assert v[f"vllm:num_requests_waiting{{{label}}}"] == 2
    assert v[f'vllm:time_to_first_token_seconds_bucket{{{label},le="0.02"}}'] == 0
    assert v[f'vllm:time_to_first_token_seconds_bucket{{{label},le="0.04"}}'] == 1
    assert v[f'vllm:time_to_first_token_seconds_bucket{{{label},le="+Inf"}}'] == 1
    assert v[f"vllm:inter_token_latency_seconds_count{{{label}}}"] == 1
    assert v[f"vllm:spec_decode_num_drafts_total{{{label}}}"] == 4
    assert v[f"vllm:spec_decode_num_draft_tokens_total{{{label}}}"] == 12
    assert v[f"vllm:spec_decode_num_accepted_tokens_total{{{label}}}"] == 5
    assert v[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="1"}}'] == 2
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text


def test_spec_decoding_log_line_format():
    line = format_spec_decoding_line(10, 30, 12, [7, 4, 1], elapsed_s=2.0)
    assert line == (
        "SpecDecoding metrics: Mean acceptance length: 2.20, Accepted throughput: 6.00 tokens/s, "
        "Drafted throughput: 15.00 tokens/s, Accepted: 12 tokens, Drafted: 30 tokens, "
        "Per-position acceptance rate: 0.700, 0.400, 0.100, Avg Draft acceptance rate: 40.0%")


def test_stats_logger_logs_interval_deltas_only_when_busy(caplog):
    caplog.set_level(logging.INFO, logger="laguna_dflash.server.stats_log")
    metrics = ServerMetrics("m")
    log = StatsLogger(metrics, interval_s=5.0)
    start = log._last_time
    first = SpecCounters(2, 4, 8, 3, (2, 1))
    log.maybe_log(EngineSnapshot(num_running=1, num_blocks=4, num_free_blocks=4, spec=first),
                  now=start + 1.0)
    assert not caplog.records  # interval not over yet
    # intervals of 5.5 s: (start + 5.0) - start may round below 5.0 for a large monotonic clock
    log.maybe_log(EngineSnapshot(num_running=1, num_blocks=4, num_free_blocks=4, spec=first),
                  now=start + 5.5)
    second = SpecCounters(2, 6, 12, 5, (3, 2))
    log.maybe_log(EngineSnapshot(num_blocks=4, num_free_blocks=4, spec=second), now=start + 11.0)
    spec_lines = [r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage()]
    assert len(spec_lines) == 2
    assert "Accepted: 2 tokens, Drafted: 4 tokens" in spec_lines[1]  # the delta, not the total
    assert "Per-position acceptance rate: 0.500, 0.500" in spec_lines[1]
    caplog.clear()
    log.maybe_log(EngineSnapshot(num_blocks=4, num_free_blocks=4, spec=second), now=start + 20.0)
    assert not caplog.records  # idle: nothing to report


def test_requests_between_prefill_chunks_count_as_running():
    """/load, /health and vllm:num_requests_running count a request whose chunked prefill is
    under way (it sits in neither the scheduler's running nor its waiting list)."""
    from types import SimpleNamespace

    from laguna_dflash.server.async_engine import AsyncEngine

    scheduler = SimpleNamespace(running=["a"], prefilling=["b", "c"], waiting=["d"],
                                num_prefix_queries=0, num_prefix_hits=0)
    engine = SimpleNamespace(spec_stats=None, scheduler=scheduler, timings=SimpleNamespace(num_steps=0),
                             allocator=SimpleNamespace(num_free_blocks=3, num_blocks=8))
    snapshot = AsyncEngine(engine, ServerMetrics("m")).snapshot
    assert (snapshot.num_running, snapshot.num_waiting) == (3, 1)


@pytest.mark.parametrize("body, param, needles", [
    ({"prompt": [1, "a"]}, "prompt", ("str", "list[int]")),
    ({"prompt": 5}, "prompt", ("list[list[int]]", "got an integer")),
    ({"prompt": "x", "stop": 5}, "stop", ("str", "list[str]", "got an integer")),
])
def test_a_wrongly_typed_union_field_is_named_as_sent(body, param, needles):
    """Fields that take several shapes (``prompt``, ``stop``, message ``content``): the error
    names the field the client sent (not pydantic's per-alternative ``prompt.str``) and lists
    the accepted shapes once."""
    from pydantic import ValidationError

    from laguna_dflash.server.errors import from_validation_error

    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    error = from_validation_error(info.value)
    assert error.status == 400 and error.param == param, error.message
    assert all(n in error.message for n in needles), error.message
    assert f"{param}.str" not in error.message and error.message.count(f"{param}:") == 1
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    error = from_validation_error(info.value)
    assert error.param == "messages.0.content", error.message
    with pytest.raises(ValidationError) as info:  # dict keys that look like a shape are kept
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"A": "x"}})
    error = from_validation_error(info.value)
    assert error.param == "logit_bias.A" and "valid number" in error.message, error.message


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_torch_cannot_take_is_400_naming_seed(seed):
    with pytest.raises(APIError) as info:
        build_sampling_params(_completion(seed=seed), 4, None, {})
    assert info.value.status == 400 and info.value.param == "seed"
    for ok in (0, -1, 2**63 - 1):
        assert build_sampling_params(_completion(seed=ok, n=64), 4, None, {}).seed == ok


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """As vLLM: temperature below 1e-5 samples greedily (1e-39 made the scaled float32 logits
    inf, their softmax NaN, and the sampled token garbage)."""
    import torch

    from laguna_dflash.engine.sampler import sample_rows

    for t in (1e-39, 1e-6):
        p = build_sampling_params(_completion(temperature=t, top_k=5), 4, None, {})
        assert p.is_greedy, t
        logits = torch.randn(3, 50) * 5
        assert sample_rows(logits, [p] * 3).tolist() == logits.argmax(-1).tolist()
    assert build_sampling_params(_completion(temperature=1e-4), 4, None, {}).temperature == 1e-4


@pytest.mark.parametrize("spec_version", ["2.4", "2.0"])
def test_a_stream_failing_before_its_first_chunk_aborts_its_jobs(spec_version):
    """The client is gone when the response starts: the event generator never runs (so none of
    its own clean-up does), and the response itself aborts every job."""
    import asyncio
    from types import SimpleNamespace

    from laguna_dflash.server.serving import Serving

    started, aborted = [], []

    async def events():
        started.append(True)
        yield "data: {}\n\n"

    jobs = [SimpleNamespace(stream=SimpleNamespace(abort=lambda i=i: aborted.append(i)))
            for i in range(3)]
    response = Serving.sse_response(events(), jobs)

    async def send(message):
        raise OSError("the client went away")

    async def receive():
        await asyncio.sleep(3600)

    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    from starlette.requests import ClientDisconnect

    with pytest.raises((OSError, ClientDisconnect)):
        asyncio.run(response(scope, receive, send))
    assert started == [] and aborted == [0, 1, 2]


def test_chat_templates_of_the_server_and_of_requests(tokenizer):
    """``--chat-template`` replaces the tokenizer's; a request's own template (top-level or in
    ``chat_template_kwargs``) is a 400 naming it unless the server trusts request templates."""
    from types import SimpleNamespace

    from laguna_dflash.server.args import ServerConfig
    from laguna_dflash.server.chat import render_chat
    from laguna_dflash.server.protocol import ChatMessage

    def serving(**config):
        cfg = ServerConfig(engine=None, **config)
        return SimpleNamespace(config=cfg, require_tokenizer=lambda what: tokenizer)

    messages = [ChatMessage(role="user", content="hi")]
    server_template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    request_template = "{% for m in messages %}({{ m.content }}){% endfor %}"
    own = render_chat(serving(), messages) if tokenizer.chat_template else None
    assert render_chat(serving(chat_template=server_template), messages) == "[user:hi]"
    assert own != "[user:hi]"
    for kw, param in ((dict(chat_template=request_template), "chat_template"),
                      (dict(chat_template_kwargs={"chat_template": request_template}),
                       "chat_template_kwargs.chat_template")):
        with pytest.raises(APIError, match="--trust-request-chat-template") as info:
            render_chat(serving(chat_template=server_template), messages, **kw)
        assert info.value.status == 400 and info.value.param == param
        trusted = serving(chat_template=server_template, trust_request_chat_template=True)
        assert render_chat(trusted, messages, **kw) == "(hi)"
    no_template = SimpleNamespace(config=ServerConfig(engine=None),
                                  require_tokenizer=lambda what: SimpleNamespace(chat_template=None))
    with pytest.raises(APIError, match="--chat-template FILE"):
        render_chat(no_template, messages)


def test_logprobs_cap_is_the_servers_max_logprobs():
    """``logprobs`` above the server's ``--max-logprobs`` is a 400 naming the field and the flag;
    a raised cap lets more through."""
    with pytest.raises(APIError, match=r"logprobs must be in \[0, 5\] \(the server's --max-logprobs\)"):
        build_sampling_params(_completion(), 4, 6, {}, max_logprobs=5)
    assert build_sampling_params(_completion(), 4, 50, {}, max_logprobs=100).logprobs == 50
    with pytest.raises(APIError) as info:
        build_sampling_params(_completion(), 4, 21, {})
    assert info.value.param == "logprobs"


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_silent_stream_ends_and_aborts_its_jobs_when_the_client_leaves(spec_version):
    """A streamed response whose events have sent nothing yet (a request still waiting, or
    text held back for a stop string) must end, and abort its jobs, once the client goes
    away. Starlette watches for the disconnect only under ASGI spec versions before 2.4; under
    2.4 it learns of it from a failing send, and a silent stream never sends."""
    import asyncio
    from types import SimpleNamespace

    from laguna_dflash.server.serving import JobsStreamingResponse

    aborted, closed = [], []

    async def events():
        try:
            await asyncio.Event().wait()  # no delta ever comes
            yield "never"
        finally:
            closed.append(True)

    jobs = [SimpleNamespace(request_id="cmpl-1", stream=SimpleNamespace(
        abort=lambda: aborted.append(True)))]

    async def receive() -> dict:
        await asyncio.sleep(0.05)  # the client leaves after the headers went out
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        response = JobsStreamingResponse(events(), jobs, media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}
        await asyncio.wait_for(response(scope, receive, send), timeout=5)

    asyncio.run(run())
    assert aborted and closed == [True]
    assert [m["type"] for m in sent] == ["http.response.start"]


def _run(tokenizer, ids: list[int], stop: tuple[str, ...], min_tokens: int,
         block: int) -> tuple[OutputText, int, str]:
    """Feed ``ids`` ``block`` at a time (one speculative step each), as the server does ->
    (the OutputText, the tokens taken, the text streamed)."""
    out = OutputText(IncrementalDetokenizer(tokenizer), stop, False, min_tokens)
    taken, streamed = 0, ""
    for start in range(0, len(ids), block):
        chunk = ids[start : start + block]
        n = out.add_tokens(chunk, ends_on_stop_token=False)
        taken += n
        if out.stop_hit is not None:
            break
        streamed += out.take(final=False)
    else:
        out.finish()
    return out, taken, streamed + out.take(final=True)


@pytest.mark.parametrize("block", [1, 4])
def test_a_stop_string_inside_the_first_min_tokens_never_stops_the_request(tokenizer, block):
    """vLLM's min_tokens: a stop string completed within the first ``min_tokens`` tokens is
    ignored. With a second, longer stop string the text held back for it reached into those
    tokens, so the short stop string found there stopped the request on the next token and cut
    the text inside the first ``min_tokens`` tokens ("alpha ")."""
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    b_at = next(i for i in range(len(ids)) if "b" in tokenizer.decode(ids[: i + 1]))
    assert b_at + 2 < len(ids) and "b" not in tokenizer.decode(ids[b_at + 1 :])
    for stop in (("b",), ("b", "zzzzzzzzzz"), ("zzzzzzzzzz", "b")):
        out, taken, streamed = _run(tokenizer, ids, stop, b_at + 1, block)
        assert out.stop_hit is None, stop
        assert (taken, streamed, out.text) == (len(ids), text, text), stop
    # a later occurrence, past min_tokens, still stops it (at the first one after them)
    later = "alpha beta gamma bed"
    ids = tokenizer.encode(later, add_special_tokens=False)
    out, taken, streamed = _run(tokenizer, ids, ("b", "zzzzzzzzzz"), b_at + 1, block)
    assert out.stop_hit == "b" and streamed == out.text == "alpha beta gamma "
    assert tokenizer.decode(ids[:taken]).endswith("b") and taken < len(ids)


def test_completions_logprobs_false_means_none():
    """``logprobs: false`` on completions asks for no logprobs (pydantic made it 0: one
    log-probability per token, sent back); ``true`` stays 1 and integers are kept, as in vLLM."""
    assert CompletionRequest(prompt="x", logprobs=False).logprobs is None
    assert CompletionRequest(prompt="x", logprobs=True).logprobs == 1
    assert CompletionRequest(prompt="x", logprobs=0).logprobs == 0


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(tokenizer):
    """vLLM's ``return_tokens_as_token_ids``: logprob tokens are ``token_id:<id>`` (chat and
    completions, the top ones too); it was ignored, giving the tokens' text."""
    from functools import partial
    from types import SimpleNamespace

    from laguna_dflash.server import chat, completions
    from laguna_dflash.server.serving import Serving

    serving = SimpleNamespace(tokenizer=tokenizer)
    serving.token_str = partial(Serving.token_str, serving)
    ids = tokenizer.encode("ab", add_special_tokens=False)
    lps = [{t: -0.5, 7: -1.0} for t in ids]
    body, _ = completions._logprobs(serving, ids, lps, 0, as_ids=True)
    assert body["tokens"] == [f"token_id:{t}" for t in ids]
    assert set(body["top_logprobs"][0]) == {f"token_id:{ids[0]}", "token_id:7"}
    assert completions._logprobs(serving, ids, lps, 0)[0]["tokens"] == [
        tokenizer.decode([t]) for t in ids]
    entries = chat._logprobs(serving, ids, lps, 2, as_ids=True)
    assert entries[0]["token"] == f"token_id:{ids[0]}"
    assert entries[0]["bytes"] == list(f"token_id:{ids[0]}".encode())
    assert {e["token"] for e in entries[0]["top_logprobs"]} == {f"token_id:{ids[0]}", "token_id:7"}


def test_request_tools_reach_the_chat_template(tokenizer):
    """As vLLM, a request's ``tools`` (allowed with ``tool_choice: "none"``) reach the chat
    template, which may describe them to the model; they were dropped, so the prompt differed
    from vLLM's. ``chat_template_kwargs``' own ``tools`` win, as for every flag they set."""
    from types import SimpleNamespace

    from laguna_dflash.server.args import ServerConfig
    from laguna_dflash.server.chat import render_chat
    from laguna_dflash.server.protocol import ChatMessage

    template = ("{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
                "{% for m in messages %}[{{ m.content }}]{% endfor %}")
    serving = SimpleNamespace(config=ServerConfig(engine=None, chat_template=template),
                              require_tokenizer=lambda what: tokenizer)
    messages = [ChatMessage(role="user", content="hi")]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert render_chat(serving, messages) == "[hi]"
    assert render_chat(serving, messages, tools=tools) == "<get_weather>[hi]"
    other = [{"type": "function", "function": {"name": "other"}}]
    assert render_chat(serving, messages, chat_template_kwargs={"tools": other},
                       tools=tools) == "<other>[hi]"
