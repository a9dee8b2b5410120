"""A live server on 127.0.0.1 (background thread, free port) driven by the official openai client
and raw HTTP: parity with offline greedy decoding, streaming, load with speculation, metrics,
disconnects, bad input, auth and an engine failure.

The stack: a tiny Laguna target (vocab 384) with a byte-level BPE tokenizer and chat template,
and a briefly distilled z-lab DFlash drafter (block 4, K = 3) so drafts are sometimes accepted and
steps deliver several tokens. The KV cache is small (100 blocks of 8) so the load test makes
requests wait and get preempted. Offline references come from a target-only ``LLM`` (greedy
speculative output is lossless, so it must match).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import wait_until_healthy

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.cli import build_parser
from laguna_dflash.engine.engine import LLMEngine
from laguna_dflash.server.app import build_app
from laguna_dflash.server.args import resolve_server_config
from laguna_dflash.server.launcher import ServerThread, build_serving

KEY = "test-key"
NAME = "laguna-tiny"
MAX_MODEL_LEN = 256
K = 3

WORDS = ("def", "class", "return", "import", "the", "quick", "brown", "fox", "speculative",
         "decoding", "block", "token", "print", "value", "list", "for", "while", "lambda")


@dataclass
class Stack:
    url: str
    target: Path
    draft: Path
    engine: LLMEngine
    offline: LLM
    client: openai.OpenAI

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"},
                            timeout=kw.pop("timeout", 60.0), **kw)

    def greedy(self, prompts: list[str] | None = None, ids: list[list[int]] | None = None,
               max_tokens: int = 24, **kw):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
        if ids is not None:
            return self.offline.generate(prompt_token_ids=ids, sampling_params=params)
        return self.offline.generate(prompts, params)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import dflash_fixtures as df

    target, draft = df.make_served_pair(tmp_path_factory.mktemp("server"), K + 1, distill_steps=500)
    args = build_parser().parse_args([
        "serve", "--model", str(target), "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(draft), "--speculative-num-draft-tokens", str(K + 1),
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "8", "--num-kv-blocks", "100",
        "--api-key", KEY, "--served-model-name", NAME, "--log-stats-interval", "1",
    ])
    serving = build_serving(resolve_server_config(args))
    server = ServerThread(build_app(serving)).start()
    offline = LLM(str(target), block_size=8, max_model_len=MAX_MODEL_LEN)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        yield Stack(server.url, target, draft, serving.engine.engine, offline, client)
    finally:
        client.close()
        server.stop()


def _metrics(stack: Stack) -> dict[str, float]:
    """/metrics as {name{labels}: value}, without the model_name label."""
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")
            values[key] = float(value)
    return values


def _wait_idle(stack: Stack, timeout: float = 15.0) -> dict[str, float]:
    """Wait until nothing runs or waits and every KV block is free again; return the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(stack)
        idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["laguna_dflash:kv_cache_free_blocks"] == m["laguna_dflash:kv_cache_total_blocks"])
        if idle:
            assert m["vllm:kv_cache_usage_perc"] == 0.0
            return m
        assert time.monotonic() < deadline, f"server did not become idle: {m}"
        time.sleep(0.05)


def _prompts(n: int, seed: int) -> list[str]:
    return [" ".join(WORDS[(seed * 7 + i * 5 + j * 3) % len(WORDS)] for j in range(1 + (i + seed) % 6))
            + f" {i}" for i in range(n)]


def _stream_text(stream) -> tuple[str, str | None, object]:
    """(text, finish_reason, usage) of a streamed completion."""
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return text, finish, usage


# ---- the HTTP surface ----------------------------------------------------------------------------


def test_models_health_version_and_auth(stack):
    models = stack.client.models.list()
    assert models.data[0].id == NAME and models.data[0].model_extra["root"] == str(stack.target)
    health = httpx.get(stack.url + "/health")  # open without a key (load balancer probes)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(stack.url + "/version").json()["version"]
    assert httpx.get(stack.url + "/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(stack.url + "/v1/completions", headers=headers,
                       json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert "API key" in r.json()["error"]["message"]
    assert httpx.get(stack.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="nope", max_retries=0).models.list()
    info = stack.http().get("/server_info").json()
    assert info["num_speculative_tokens"] == K and info["speculative_method"] == "dflash"
    with stack.http() as http:
        assert http.get("/load").json() == {"server_load": 0}
        model = http.get("/get_model_info").json()
        assert model["model_path"] == str(stack.target) and model["is_generation"] is True
    assert info["draft_from"].startswith("--speculative-draft-model-path")


def test_completions_equal_offline_greedy_streamed_and_not(stack):
    prompts = ["def quicksort(arr):", "The quick brown fox", "import os\nimport sys\n"]
    want = stack.greedy(prompts)
    for prompt, ref in zip(prompts, want):
        full = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                               temperature=0)
        assert full.object == "text_completion" and full.id.startswith("cmpl-")
        assert full.model == NAME and isinstance(full.created, int)
        assert full.choices[0].text == ref.text
        assert full.choices[0].finish_reason == ref.finish_reason
        assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert full.usage.completion_tokens == len(ref.token_ids)
        spec = full.model_extra["metrics"]["speculative_decoding"]
        assert spec["num_spec_tokens"] == K and spec["num_draft_tokens"] == K * spec["num_spec_steps"]
        stream = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        text, finish, usage = _stream_text(stream)
        assert text == full.choices[0].text and finish == ref.finish_reason
        assert usage.completion_tokens == len(ref.token_ids)


def test_chat_equals_offline_greedy_streamed_and_not(stack):
    tok = stack.offline.tokenizer
    for messages in ([{"role": "user", "content": "hello there"}],
                     [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": [{"type": "text", "text": "sort a list"}]}]):
        flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else m["content"][0]["text"]} for m in messages]
        ids = tok.encode(tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        ref = stack.greedy(ids=[ids], max_tokens=20)[0]
        full = stack.client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                                    temperature=0)
        assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
        assert full.choices[0].message.role == "assistant"
        assert full.choices[0].message.content == ref.text
        assert full.choices[0].finish_reason == ref.finish_reason
        assert full.usage.prompt_tokens == len(ids)
        chunks = list(stack.client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason


def test_token_id_prompts_and_returned_token_ids(stack):
    ids = [[11, 57, 300, 42, 9], [200]]
    refs = stack.greedy(ids=ids, max_tokens=16)
    for prompt in (ids[0], [ids[0]]):
        out = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=16,
                                              temperature=0, extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == refs[0].token_ids
        assert out.choices[0].model_extra["prompt_token_ids"] == ids[0]
        assert out.choices[0].text == refs[0].text
    out = stack.client.completions.create(model=NAME, prompt=["The quick brown fox"], max_tokens=8,
                                          temperature=0)
    assert out.choices[0].text == stack.greedy(["The quick brown fox"], max_tokens=8)[0].text


def test_stop_strings_and_stop_token_ids(stack):
    prompt = "class Node:"
    ref = stack.greedy([prompt], max_tokens=40, ignore_eos=True)[0]
    text = ref.text
    # a two-character stop string from the middle of the text, without replacement characters
    start = next(i for i in range(6, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = text.index(stop)
    for include, expected in ((False, text[:cut]), (True, text[: cut + 2])):
        body = {"ignore_eos": True, "include_stop_str_in_output": include}
        full = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                                               temperature=0, stop=[stop, "\x00never"],
                                               extra_body=body)
        assert full.choices[0].text == expected
        assert full.choices[0].finish_reason == "stop"
        assert full.choices[0].model_extra["stop_reason"] == stop
        assert full.usage.completion_tokens < len(ref.token_ids)
        streamed, finish, _ = _stream_text(stack.client.completions.create(
            model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True,
            extra_body=body))
        assert streamed == expected and finish == "stop"
    stop_id = ref.token_ids[7]
    first = ref.token_ids.index(stop_id)
    out = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                          extra_body={"stop_token_ids": [stop_id],
                                                      "ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop_id
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids[: first + 1]
    _wait_idle(stack)  # the engine requests stopped by a stop string were aborted and freed


def test_logprobs(stack):
    prompt = "def main():"
    ref = stack.offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=2))[0]
    full = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                           logprobs=2)
    lp = full.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ref.token_ids)
    for got, tok, want in zip(lp.token_logprobs, ref.token_ids, ref.logprobs):
        assert got == pytest.approx(want[tok], abs=1e-4)
    # keyed by token text: distinct byte tokens that decode to the same U+FFFD collapse
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert any(len(t) >= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = []
    for chunk in stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                                 temperature=0, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == lp.token_logprobs
    chat = stack.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(stack):
    """lm-evaluation-harness's loglikelihood request (token ids, ``echo``, ``logprobs: 1``,
    ``max_tokens: 1``): the choice starts with the prompt, whose per-token logprobs (None
    first) are the offline engine's prompt logprobs; ``max_tokens: 0`` returns the prompt
    only; streamed, the first chunk carries the prompt."""
    tok = stack.offline.tokenizer
    text = "def add(a, b):\n    return a + b"
    ids = tok.encode(text, add_special_tokens=False)
    ref = stack.offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    with stack.http() as http:
        body = {"model": NAME, "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                "temperature": 0, "seed": 1234}
        r = http.post("/v1/completions", json=body).json()
        choice = r["choices"][0]
        assert choice["text"] == tok.decode(ids) + tok.decode(ref.token_ids)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        for got, tid, want in zip(lp["token_logprobs"][1:], ids[1:] + ref.token_ids,
                                  ref.prompt_logprobs[1:] + ref.logprobs):
            assert got == pytest.approx(want[tid], abs=1e-4)
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 1
        only = http.post("/v1/completions", json={**body, "prompt": text, "max_tokens": 0}).json()
        assert only["choices"][0]["text"] == text and only["usage"]["completion_tokens"] == 0
        assert len(only["choices"][0]["logprobs"]["tokens"]) == len(ids)
        assert only["choices"][0]["finish_reason"] == "length"
        plain = http.post("/v1/completions", json={"model": NAME, "prompt": text, "echo": True,
                                                   "max_tokens": 4, "temperature": 0}).json()
        assert plain["choices"][0]["text"].startswith(text) and plain["choices"][0]["logprobs"] is None
        bad = http.post("/v1/completions", json={"model": NAME, "prompt": text, "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    streamed, finish, _ = _stream_text(stack.client.completions.create(
        model=NAME, prompt=text, echo=True, max_tokens=4, temperature=0, stream=True))
    assert streamed == plain["choices"][0]["text"] and finish == plain["choices"][0]["finish_reason"]


def test_prompt_logprobs_as_in_vllm(stack):
    """vLLM's ``prompt_logprobs`` (it was a 400): per completions choice, and on the chat
    response, one entry per prompt token, None first, ``{"<id>": {logprob, rank,
    decoded_token}}`` with the prompt token and the n most likely, equal to the offline
    engine's; with ``echo`` and a smaller ``logprobs`` the echoed prompt keeps its own count;
    streaming it, or more than --max-logprobs, is a 400 naming the field."""
    tok = stack.offline.tokenizer
    ids = tok.encode("def add(a, b):\n    return a + b", add_special_tokens=False)
    ref = stack.offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=2, prompt_logprobs=3))[0]

    def check(entries: list, n: int = 3) -> None:
        assert len(entries) == len(ids) and entries[0] is None
        for tid, got, want in zip(ids[1:], entries[1:], ref.prompt_logprobs[1:]):
            top = {t for t, v in want.items() if v.rank <= n}
            assert set(got) == {str(t) for t in top | {tid}}
            for key, entry in got.items():
                t = int(key)
                assert entry["logprob"] == pytest.approx(float(want[t]), abs=1e-4)
                assert entry["rank"] == want[t].rank and entry["decoded_token"] == want[t].decoded_token

    with stack.http() as http:
        body = {"model": NAME, "prompt": [ids], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
        r = http.post("/v1/completions", json={**body, "n": 2}).json()
        for choice in r["choices"]:
            check(choice["prompt_logprobs"])
        assert r["choices"][0]["text"] == tok.decode(ref.token_ids)
        echoed = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()
        choice = echoed["choices"][0]
        check(choice["prompt_logprobs"])
        assert all(t is None or len(t) <= 2 for t in choice["logprobs"]["top_logprobs"])  # its own 1
        plain = http.post("/v1/completions", json={k: v for k, v in body.items() if k != "prompt_logprobs"})
        assert "prompt_logprobs" not in plain.json()["choices"][0]
        text = tok.decode(ids)
        chat = http.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 0}).json()
        entries = chat["prompt_logprobs"]
        assert entries[0] is None and len(entries) == chat["usage"]["prompt_tokens"]
        assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])
        for extra, needle in (({"stream": True}, "stream=true"), ({"prompt_logprobs": 21}, "--max-logprobs"),
                              ({"prompt_logprobs": -2}, "--max-logprobs")):
            bad = http.post("/v1/completions", json={**body, **extra})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
            assert needle in bad.json()["error"]["message"]


def test_chat_truncate_prompt_tokens_keeps_the_rendered_prompts_tail(stack):
    """Chat's ``truncate_prompt_tokens`` cuts the rendered conversation's tokens (vLLM's)."""
    with stack.http() as http:
        body = {"model": NAME, "messages": [{"role": "user", "content": "def add(a, b): return a + b"}],
                "max_tokens": 3, "temperature": 0, "return_token_ids": True}
        whole = http.post("/v1/chat/completions", json=body).json()
        cut = http.post("/v1/chat/completions", json={**body, "truncate_prompt_tokens": 3}).json()
    assert whole["usage"]["prompt_tokens"] > 3 and cut["usage"]["prompt_tokens"] == 3
    assert cut["prompt_token_ids"] == whole["prompt_token_ids"][-3:]


def test_several_prompts_in_one_completions_request(stack):
    """A list of prompts (strings or token ids) with ``n = 2``: choice ``k * n + j`` is prompt
    ``k``'s choice ``j``, each the offline greedy output, streamed and not; usage counts each
    prompt once. With ``echo`` and logprobs (lm-eval batches its loglikelihood requests this
    way) each choice starts with its own prompt."""
    prompts = ["def main():", "class Foo:", "import os"]
    want = [o.text for o in stack.greedy(prompts, max_tokens=8, ignore_eos=True)]
    kw = dict(model=NAME, prompt=prompts, max_tokens=8, temperature=0, n=2,
              extra_body={"ignore_eos": True})
    got = stack.client.completions.create(**kw)
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w for w in want for _ in range(2)]
    tok = stack.offline.tokenizer
    assert got.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert got.usage.completion_tokens == 6 * 8
    texts = [""] * 6
    for chunk in stack.client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [w for w in want for _ in range(2)]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    with stack.http() as http:
        r = http.post("/v1/completions", json={"model": NAME, "prompt": ids, "echo": True, "logprobs": 1,
                                               "max_tokens": 1, "temperature": 0}).json()
    for c, p in zip(sorted(r["choices"], key=lambda c: c["index"]), ids):
        assert c["text"].startswith(tok.decode(p)) and len(c["logprobs"]["tokens"]) == len(p) + 1


def test_penalties_and_min_tokens_over_http(stack):
    """The penalty fields and min_tokens reach the engine: the output is the offline engine's
    with the same settings, and differs from the plain one."""
    kw = dict(presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=1.3,
              logit_bias={100: 12.0})  # the bias makes token 100 likely, the penalties its repeats not
    prompt = "def main():"
    want = stack.greedy([prompt], max_tokens=24, ignore_eos=True, **kw)[0].token_ids
    plain = stack.greedy([prompt], max_tokens=24, ignore_eos=True)[0].token_ids
    got = stack.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=24, temperature=0,
        presence_penalty=kw["presence_penalty"], frequency_penalty=kw["frequency_penalty"],
        logit_bias={"100": 12.0},
        extra_body={"ignore_eos": True, "repetition_penalty": kw["repetition_penalty"],
                    "return_token_ids": True})
    assert got.choices[0].token_ids == want != plain and 100 in want
    first = stack.greedy([prompt], max_tokens=4, ignore_eos=True)[0].token_ids[0]
    held = stack.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0,
        extra_body={"stop_token_ids": [first], "min_tokens": 5, "return_token_ids": True})
    assert len(held.choices[0].token_ids) >= 5 and first not in held.choices[0].token_ids[:5]


def test_seeded_sampling_is_reproducible_streamed_and_not(stack):
    kw = dict(model=NAME, prompt="lambda x:", max_tokens=24, temperature=0.9, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = stack.client.completions.create(**kw).choices[0].text
    b = stack.client.completions.create(**kw).choices[0].text
    streamed, _, _ = _stream_text(stack.client.completions.create(stream=True, **kw))
    assert a == b == streamed


def test_tokenize_and_detokenize(stack):
    tok = stack.offline.tokenizer
    with stack.http() as http:
        r = http.post("/tokenize", json={"model": NAME, "prompt": "def f(x):"}).json()
        assert r["tokens"] == tok.encode("def f(x):") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == MAX_MODEL_LEN
        r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert r["tokens"][0] == tok.bos_token_id and r["tokens"][-1] == 6  # <|assistant|>
        assert r["token_strs"] is None
        # vLLM's return_token_strs and continue_final_message (both were ignored)
        r = http.post("/tokenize", json={"prompt": "def f(x):", "return_token_strs": True}).json()
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def"}]
        r = http.post("/tokenize", json={"messages": turns, "add_generation_prompt": False,
                                         "continue_final_message": True}).json()
        closed = http.post("/tokenize", json={"messages": turns,
                                              "add_generation_prompt": False}).json()
        assert tok.decode(r["tokens"]).endswith("def")
        assert r["tokens"] == closed["tokens"][: len(r["tokens"])] and r["count"] < closed["count"]
        assert http.post("/detokenize", json={"tokens": tok.encode("héllo")}).json() == {
            "prompt": "héllo"}
        assert http.post("/detokenize", json={"tokens": [9999]}).status_code == 400


# ---- load, metrics, disconnects ------------------------------------------------------------------


async def _one_stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int):
    stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    text, finish, usage, spec, chunks = "", None, None, None, 0
    async for chunk in stream:
        if chunk.choices:
            chunks += 1
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
            spec = chunk.model_extra["metrics"]["speculative_decoding"]
    return text, finish, usage, spec, chunks


async def _wave(url: str, prompts: list[str], max_tokens: int):
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                                  timeout=120) as client:
        return await asyncio.gather(*[_one_stream(client, p, max_tokens) for p in prompts])


def test_load_64_concurrent_streams_in_waves(stack, caplog):
    caplog.set_level(logging.INFO, logger="laguna_dflash.server.stats_log")
    waves = [_prompts(64, seed) for seed in range(3)]
    max_tokens = 24
    before = _wait_idle(stack)
    results = []
    for prompts in waves:
        want = stack.greedy(prompts, max_tokens=max_tokens)
        got = asyncio.run(_wave(stack.url, prompts, max_tokens))
        for ref, (text, finish, usage, _, _) in zip(want, got):
            assert (text, finish) == (ref.text, ref.finish_reason)
            assert usage.completion_tokens == len(ref.token_ids)
        results += got
    after = _wait_idle(stack)  # every KV block is free again
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    n = sum(len(w) for w in waves)
    specs = [r[3] for r in results]
    # the engine-wide counters add up to the per-request ones
    assert d["vllm:spec_decode_num_drafts_total"] == sum(s["num_spec_steps"] for s in specs) > 0
    assert d["vllm:spec_decode_num_draft_tokens_total"] == K * d["vllm:spec_decode_num_drafts_total"]
    accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
    assert accepted == sum(s["num_accepted_draft_tokens"] for s in specs)
    assert 0 < accepted <= d["vllm:spec_decode_num_draft_tokens_total"]
    per_pos = [d[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
               for i in range(K)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert d["vllm:generation_tokens_total"] == sum(r[2].completion_tokens for r in results)
    assert d["vllm:prompt_tokens_total"] == sum(r[2].prompt_tokens for r in results)
    # every admission looks its tokens up (a preempted request's again, outputs included)
    assert d["vllm:prefix_cache_queries_total"] >= d["vllm:prompt_tokens_total"]
    assert 0 <= d["vllm:prefix_cache_hits_total"] < d["vllm:prefix_cache_queries_total"]
    finished = sum(d[f'vllm:request_success_total{{finished_reason="{r}"}}'] for r in
                   ("stop", "length"))
    assert finished == n and d['vllm:request_success_total{finished_reason="error"}'] == 0
    assert d["vllm:time_to_first_token_seconds_count"] == n
    assert d["vllm:e2e_request_latency_seconds_count"] == n
    assert d["vllm:num_preemptions_total"] > 0  # the small cache made requests wait and preempt
    assert any(r[4] < r[2].completion_tokens for r in results)  # multi-token chunks happened
    deadline = time.monotonic() + 5
    while "SpecDecoding metrics: Mean acceptance length:" not in caplog.text:
        assert time.monotonic() < deadline, "no periodic SpecDecoding log line"
        time.sleep(0.1)


@pytest.fixture
def slow_engine(stack, monkeypatch):
    """Make each engine step take >= 20 ms so long requests are surely still running."""
    step = stack.engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(stack.engine, "step", slow_step)


def test_disconnects_abort_requests_and_free_their_blocks(stack, slow_engine):
    before = _wait_idle(stack)
    body = {"model": NAME, "prompt": "print", "max_tokens": 220, "temperature": 0,
            "ignore_eos": True}
    with stack.http() as http:
        streams = []
        for _ in range(4):
            r = http.send(http.build_request("POST", "/v1/completions",
                                             json={**body, "stream": True}), stream=True)
            assert r.status_code == 200
            lines = r.iter_lines()  # kept alive: closing it would close the response
            line = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
            streams.append((r, lines))
        m = _metrics(stack)
        assert m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 4
        assert m["vllm:kv_cache_usage_perc"] > 0
        for r, _ in streams:
            r.close()  # the client goes away mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        with stack.http(timeout=0.5) as http:
            http.post("/v1/completions", json=body)
    after = _wait_idle(stack)
    assert after['vllm:request_success_total{finished_reason="abort"}'] - before.get(
        'vllm:request_success_total{finished_reason="abort"}', 0) == 5
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 5 * 220  # they really stopped early


@pytest.mark.parametrize("held", ["stop string", "waiting"])
def test_a_stream_that_sent_nothing_yet_is_aborted_when_its_client_leaves(stack, slow_engine, held):
    """A streamed request that has sent no chunk (its text all held back for a long stop
    string, or still waiting for a slot behind a full batch) is aborted when its client goes
    away, not run on to max_tokens and counted as served ("length"). Starlette watches for it
    under uvicorn's ASGI spec 2.3; the response's own watcher covers servers of spec 2.4
    (tests/test_server_units.py)."""
    before = _wait_idle(stack)
    body = {"model": NAME, "prompt": "print", "max_tokens": 220, "temperature": 0,
            "ignore_eos": True, "stream": True}
    others = []
    with stack.http() as http:
        if held == "stop string":
            body["stop"] = ["#" * 1000]  # the last 999 characters wait: all of this output
        else:  # fill every slot first (max_num_seqs is 64), each streaming as it should
            for _ in range(64):
                r = http.send(http.build_request("POST", "/v1/completions", json={
                    **body, "max_tokens": 40}), stream=True)
                others.append(r)
        r = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        assert r.status_code == 200
        time.sleep(0.5)  # ~25 steps of the slow engine: nothing of it sent, or not yet running
        r.close()
        for other in others:
            other.read()
    after = _wait_idle(stack, timeout=30)
    aborted = after['vllm:request_success_total{finished_reason="abort"}'] - before.get(
        'vllm:request_success_total{finished_reason="abort"}', 0)
    assert aborted == 1
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 220 + 40 * len(others)  # it stopped early (or never ran)


# ---- bad input and failures ----------------------------------------------------------------------


def _good_request_in_background(stack, max_tokens: int = 80):
    """A streamed request running while the test does something else; returns (thread, result)."""
    result: dict = {}
    started = threading.Event()

    def run():
        text = ""
        for chunk in stack.client.completions.create(
                model=NAME, prompt="def good(x):", max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                result["finish"] = chunk.choices[0].finish_reason
            started.set()
        result["text"] = text

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30)
    return thread, result


LONG = list(range(10, 10 + MAX_MODEL_LEN))

BAD_REQUESTS = [
    # (path, body or raw bytes, status, param, message needle)
    ("/v1/completions", b"{not json", 400, None, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": NAME, "max_tokens": 4}, 400, "prompt", "Field required"),
    ("/v1/chat/completions", {"model": NAME}, 400, "messages", "Field required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
     404, "model", "does not exist"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "messages", "maximum context length"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 254}, 400, "max_tokens",
     "maximum context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10**6}, 400, "max_completion_tokens",
     "maximum context length"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_k": -7}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "in [1, 64]"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": ["a"] * 257}, 400, "prompt", "at most 256 prompts"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", ""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty",
     "[-2, 2]"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "> 0"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"tok": 1}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias",
     "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages", "'image_url' is not supported: only text content parts are; send"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "structural_tag"}}, 400,
     "response_format", "structural tags) is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "guided_grammar": "root ::= [a-z]+ undefined"}, 400, "guided_grammar",
     "guided_grammar is not a valid Lark or GBNF grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "functions": [{"name": "f"}]}, 400, "functions", "leave functions out"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "echo", "leave echo out"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [5, 99999]}, 400, "stop_token_ids",
     "outside the vocabulary"),
    ("/v1/nope", {}, 404, None, "Not Found"),
]


def test_bad_inputs_get_openai_errors_while_a_good_request_succeeds(stack):
    want = stack.greedy(["def good(x):"], max_tokens=80, ignore_eos=True)[0]
    thread, result = _good_request_in_background(stack)
    with stack.http() as http:
        for path, body, status, param, needle in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == status and error["param"] == param, (body, error)
            assert needle in error["message"], (body, error)
        r = http.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 0})
        assert r.status_code == 400  # streamed requests are checked before the stream starts
        assert http.get("/v1/completions").status_code == 405
    with pytest.raises(openai.BadRequestError, match="temperature"):
        stack.client.completions.create(model=NAME, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        stack.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    thread.join(60)
    assert result["text"] == want.text and result["finish"] == "length"
    _wait_idle(stack)


def test_engine_failure_fails_only_that_request(stack, monkeypatch):
    poison = [3, 1, 4, 1, 5, 9, 2, 6]
    prefill = stack.engine._prefill

    def failing_prefill(seqs, num_new_tokens):
        if any(s.prompt_token_ids == poison for s in seqs):
            raise RuntimeError("injected failure")
        return prefill(seqs, num_new_tokens)

    monkeypatch.setattr(stack.engine, "_prefill", failing_prefill)
    want = stack.greedy(["def good(x):"], max_tokens=60, ignore_eos=True)[0]
    before = _metrics(stack)
    thread, result = _good_request_in_background(stack, max_tokens=60)
    with stack.http() as http:
        r = http.post("/v1/completions", json={"prompt": poison, "max_tokens": 8})
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": poison, "max_tokens": 8, "stream": True})
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 500
        assert http.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 3}).status_code == 200
    thread.join(60)
    assert result["text"] == want.text  # the request sharing the engine was not disturbed
    after = _wait_idle(stack)
    assert after['vllm:request_success_total{finished_reason="error"}'] - before[
        'vllm:request_success_total{finished_reason="error"}'] == 2
    assert httpx.get(stack.url + "/health").status_code == 200


def test_metrics_expose_the_vllm_names(stack):
    names = set(re.sub(r"\{.*", "", k) for k in _metrics(stack))
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:request_success_total", "vllm:prompt_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:generation_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
                 "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_sum",
                 "vllm:request_decode_time_seconds_bucket",
                 "vllm:request_inference_time_seconds_count", "vllm:request_prompt_tokens_sum",
                 "vllm:request_generation_tokens_count", "vllm:request_params_max_tokens_count",
                 "vllm:iteration_tokens_total_bucket"):
        assert name in names, name


def test_cli_serve_runs_a_server_with_the_vllm_spelling(stack, tmp_path):
    """``python -m laguna_dflash serve`` end to end in a subprocess (stopped by its pid)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = json.dumps({"method": "dflash", "model": str(stack.draft), "num_speculative_tokens": 2})
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "laguna_dflash", "serve", "--model", str(stack.target),
           "--speculative-config", spec, "--port", str(port), "--max-model-len", "128",
           "--block-size", "8", "--num-kv-blocks", "40"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, log, timeout_s=90)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=str(stack.target), prompt="def f(x):", max_tokens=12,
                                        temperature=0)
        assert out.choices[0].text == stack.greedy(["def f(x):"], max_tokens=12)[0].text
        assert out.model_extra["metrics"]["speculative_decoding"]["num_spec_tokens"] == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    text = log.read_text()
    assert text.count("resolved serve configuration") == 1, text
    assert "num_speculative_tokens=2" in text and "draft_from=--speculative-config model" in text


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(stack):
    """The same prompt twice: the second response's usage counts its cached prompt tokens
    (OpenAI's ``prompt_tokens_details.cached_tokens``), streamed and not; its text is the
    first's. After ``POST /flush_cache`` or ``/reset_prefix_cache`` nothing is cached."""
    bs = stack.engine.config.block_size
    rng = random.Random(11)
    ids = [rng.randrange(5, 200) for _ in range(3 * bs + 5)]
    first = stack.client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = stack.client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * bs
    assert again.choices[0].text == first.choices[0].text
    stream = stack.client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    _, _, usage = _stream_text(stream)
    assert usage.prompt_tokens_details.cached_tokens == 3 * bs
    assert httpx.post(stack.url + "/flush_cache", timeout=10).status_code == 401  # needs the key
    with stack.http() as http:
        for route in ("/flush_cache", "/reset_prefix_cache"):  # SGLang's and vLLM's names
            assert http.post(route).status_code == 200
            after = stack.client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
            assert after.usage.prompt_tokens_details.cached_tokens == 0, route
            assert after.choices[0].text == first.choices[0].text


def test_n_choices_streamed_and_not(stack):
    """``n = 3``: three choices of one prompt. Greedy: each equals the offline greedy output.
    Seeded sampling: choice ``i`` samples with ``seed + i``, so the choices differ and a second
    request draws the same three; streamed chunks carry each choice's index and add up to the
    non-streamed texts. Usage counts the prompt once and every choice's tokens."""
    prompt = "def quicksort(arr):"
    ref = stack.greedy([prompt], max_tokens=12)[0]
    full = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, n=3,
                                           temperature=0)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert all(c.text == ref.text for c in full.choices)
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert full.usage.completion_tokens == 3 * len(ref.token_ids)
    sampled = [stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, n=3,
                                               temperature=1.0, seed=7) for _ in range(2)]
    texts = [c.text for c in sampled[0].choices]
    assert texts == [c.text for c in sampled[1].choices] and len(set(texts)) > 1
    stream = stack.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, n=3,
                                             temperature=1.0, seed=7, stream=True,
                                             stream_options={"include_usage": True})
    parts, usage = ["", "", ""], None
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.text
        usage = chunk.usage or usage
    assert parts == texts
    assert usage.completion_tokens == sampled[0].usage.completion_tokens
    chat = stack.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2,
        temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]
    chunks = list(stack.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2,
        temperature=1.0, seed=3, stream=True))
    streamed = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]


def test_stop_token_text_is_left_out_unless_include_stop_str_in_output(stack):
    """As vLLM: a request that stopped on a stop token (``stop_token_ids`` or EOS) has that
    token in its token ids but not its text in the output, unless
    ``include_stop_str_in_output``; streamed and not."""
    tok = stack.offline.tokenizer

    def clean_stop(ids: list[int]) -> int | None:
        """A position whose token is new there, has text of its own and follows clean text."""
        return next((i for i in range(2, len(ids)) if ids[i] not in ids[:i]
                     and "\ufffd" not in tok.decode(ids[: i + 1])
                     and tok.decode(ids[: i + 1]) == tok.decode(ids[:i]) + tok.decode([ids[i]])
                     != tok.decode(ids[:i])), None)

    refs = stack.greedy(["import os", "The quick brown fox", "def main():"], max_tokens=40,
                        ignore_eos=True)
    prompt, ref, k = next((r.prompt, r, clean_stop(r.token_ids)) for r in refs
                          if clean_stop(r.token_ids) is not None)
    stop_id = ref.token_ids[k]
    before, with_stop = tok.decode(ref.token_ids[:k]), tok.decode(ref.token_ids[: k + 1])
    for include, expected in ((False, before), (True, with_stop)):
        kw = dict(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                  extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                              "include_stop_str_in_output": include, "return_token_ids": True})
        full = stack.client.completions.create(**kw)
        assert full.choices[0].text == expected, include
        assert full.choices[0].model_extra["token_ids"] == ref.token_ids[: k + 1]
        assert full.choices[0].model_extra["stop_reason"] == stop_id
        streamed, finish, _ = _stream_text(stack.client.completions.create(stream=True, **kw))
        assert (streamed, finish) == (expected, "stop")
    eos = tok.eos_token_id  # forced first, shown as text only when asked for
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "logit_bias": {str(eos): 100}, "skip_special_tokens": False,
            "return_token_ids": True, "logprobs": True}
    with stack.http() as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        r = whole["choices"][0]
        assert whole["prompt_token_ids"] == r["prompt_token_ids"]  # vLLM's place, and ours
        assert r["token_ids"] == [eos] and r["finish_reason"] == "stop"
        chunks = [json.loads(line[6:]) for line in http.post(
            "/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
            if line.startswith("data: {")]
        assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert r["message"]["content"] == ""
        assert len(r["logprobs"]["content"]) == 1  # the token is still scored
        r = http.post("/v1/chat/completions",
                      json={**body, "include_stop_str_in_output": True}).json()["choices"][0]
        assert r["message"]["content"] == tok.eos_token


MORE_BAD_REQUESTS = [
    # (body or raw bytes, path, param, message needles)
    ({"prompt": [1, "a"]}, "/v1/completions", "prompt", ("list[int]",)),
    ({"prompt": "x", "stop": 7}, "/v1/completions", "stop", ("list[str]",)),
    ({"messages": [{"role": "user", "content": 5}]}, "/v1/chat/completions",
     "messages.0.content", ("str",)),
    ({"prompt": "x", "seed": 2**64}, "/v1/completions", "seed", ("seed",)),
    ({"prompt": "x", "n": 2, "seed": -(2**63) - 1}, "/v1/completions", "seed", ("seed",)),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1},
     "/v1/chat/completions", "top_logprobs", ("[0, 20]",)),
    (b'{"prompt": "ab\\ud800c", "max_tokens": 2}', "/v1/completions", "prompt",
     ("surrogate",)),
    (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "/v1/completions", "prompt.1",
     ("surrogate",)),
    ({"prompt": [[1, 2], [3, 10**9]], "max_tokens": 2}, "/v1/completions", "prompt.1",
     ("outside the vocabulary",)),
    ({"prompt": ["ok", ""], "max_tokens": 2, "add_special_tokens": False}, "/v1/completions",
     "prompt.1", ("empty",)),
    (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "/v1/chat/completions",
     "messages", ("surrogate",)),
    (b'{"prompt": "\\ud800"}', "/tokenize", "prompt", ("surrogate",)),
]


def test_more_bad_inputs_are_400_naming_the_field_on_a_connection_that_stays_usable(stack):
    """Wrongly typed multi-shape fields, seeds torch cannot take, a negative top_logprobs and
    text with lone UTF-16 surrogates (valid JSON escapes, not Unicode text: the tokenizer
    raised a TypeError, answered 500, and uvicorn closed the keep-alive connection) are 400s
    naming the field; the same connection then serves a good request."""
    with stack.http() as http:
        for body, path, param, needles in MORE_BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "BadRequestError", (body, error)
            assert all(n in error["message"] for n in needles), (body, error)
            ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_chat_template_kwargs_override_the_template_flags_and_reserved_ones_are_named(stack):
    """As vLLM, ``chat_template_kwargs`` reach the template after the request's own flags, so
    ``{"add_generation_prompt": false}`` there equals the top-level field; keys the renderer
    itself owns (``tokenize``, ``conversation``, ...) are a 400 naming ``chat_template_kwargs``
    (was: a TypeError blamed on ``messages``)."""
    messages = [{"role": "user", "content": "hi"}]
    with stack.http() as http:
        def prompt_tokens(**fields) -> int:
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                        **fields})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        plain = prompt_tokens(add_generation_prompt=False)
        assert plain == prompt_tokens(chat_template_kwargs={"add_generation_prompt": False})
        assert plain < prompt_tokens()
        for key in ("tokenize", "conversation", "messages"):
            r = http.post("/v1/chat/completions", json={
                "messages": messages, "chat_template_kwargs": {key: True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
            assert key in r.json()["error"]["message"]


def test_a_stream_whose_client_left_before_its_first_chunk_is_aborted(stack, slow_engine):
    """The client sends a streamed request and hangs up at once: the response's event generator
    may never start, and its requests must be aborted all the same, not run to max_tokens."""
    before = _wait_idle(stack)
    host, port = stack.url.removeprefix("http://").split(":")
    body = json.dumps({"model": NAME, "prompt": "print", "max_tokens": 220, "temperature": 0,
                       "ignore_eos": True, "stream": True, "n": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)  # the request is complete, and the client is gone
    deadline = time.monotonic() + 15
    while _metrics(stack)["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"]:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    after = _wait_idle(stack, timeout=30)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d['vllm:request_success_total{finished_reason="abort"}'] == 2, d
    assert d["vllm:generation_tokens_total"] < 2 * 220


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response with a Content-Length, read off ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(head.split()[1]), body[:length]


def test_an_unhandled_error_is_a_500_and_the_connection_stays_usable(stack, monkeypatch):
    """A bug in a route answers that request with an OpenAI-shaped 500; the next request on the
    same keep-alive connection is served (an ``exception_handler(Exception)`` made Starlette
    re-raise, and uvicorn closed the connection)."""
    import laguna_dflash.server.app as app_module

    async def broken(serving, request):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(app_module, "create_completion", broken)
    host, port = stack.url.removeprefix("http://").split(":")

    def request(path: str, body: bytes = b"") -> bytes:
        method = "POST" if body else "GET"
        return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request("/v1/completions", b'{"prompt": "x", "max_tokens": 2}'))
        status, body = _read_response(sock)
        error = json.loads(body)["error"]
        assert status == 500 and error["code"] == 500 and "injected bug" in error["message"]
        sock.sendall(request("/v1/models"))
        status, body = _read_response(sock)
        assert status == 200 and json.loads(body)["data"][0]["id"] == NAME
