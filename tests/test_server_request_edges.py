"""Server request edges on a live server over a model without a tokenizer: ``stop`` (matched in
text there is none of) and a JSON body nested past the parser's recursion limit."""

from __future__ import annotations

import time

import pytest

# ---- a live server on a model without a tokenizer ---------------------------------------------


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """A target-only server over a checkpoint without tokenizer files (token-id prompts only)."""
    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path_factory.mktemp("bare") / "target", seed=0)
    assert not (target / "tokenizer.json").exists() and not (target / "tokenizer_config.json").exists()
    with df.tiny_http_server(target, "--max-model-len", "64") as http:
        yield http


def test_stop_strings_without_a_tokenizer_are_a_400_naming_stop(bare_server):
    """Stop strings are matched in the output text, and a model without a tokenizer has none:
    ``stop`` was silently ignored (the request ran to max_tokens, finish_reason "length"), while
    ``LLM.generate`` refuses it. Now a 400 naming ``stop`` and the way out (stop_token_ids); the
    same connection then serves requests without ``stop``, streamed or not."""
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for extra in ({"stop": "x"}, {"stop": ["a", "b"]}, {"stop": "x", "stream": True},
                  {"stop": ["x"], "n": 2}):
        r = bare_server.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == "stop" and "stop_token_ids" in error["message"], error
    ok = bare_server.post("/v1/completions", json={**body, "stop": []})  # no stop strings
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    first = ok.json()["choices"][0]
    assert first["finish_reason"] == "length"
    r = bare_server.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    deadline = time.monotonic() + 15  # the engine thread publishes /health after its step
    while (h := bare_server.get("/health").json())["kv_cache_free_blocks"] != h[
            "kv_cache_total_blocks"] or h["num_requests_running"] or h["num_requests_waiting"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_a_body_nested_past_the_parsers_recursion_limit_is_a_400(bare_server):
    """JSON nested deeper than Python's recursion limit made ``json.loads`` raise a
    RecursionError, answered as a 500 internal error; it is a malformed request (400)."""
    depth = 100_000
    raw = ('{"prompt": ' + "[" * depth + "]" * depth + "}").encode()
    r = bare_server.post("/v1/completions", content=raw,
                         headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and "nested too deeply" in error["message"]
    ok = bare_server.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_an_integer_past_pythons_digit_limit_is_a_400_on_every_body_route(bare_server):
    """``json.loads`` raises a plain ValueError (not a JSONDecodeError) for an integer literal of
    more than 4300 digits, which was answered as a 500 internal error; it is a 400 on every
    route that reads a body, wherever the number stands (an ignored field too)."""
    huge = "1" * 5000
    bodies = {
        "/v1/completions": ['{"prompt": "hi", "max_tokens": %s}', '{"prompt": [1, %s]}',
                            '{"prompt": [1, 2], "junk": %s}'],
        "/v1/chat/completions": ['{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}'],
        "/tokenize": ['{"prompt": "hi", "junk": %s}'],
        "/detokenize": ['{"tokens": [1, %s]}'],
    }
    for route, templates in bodies.items():
        for template in templates:
            r = bare_server.post(route, content=(template % huge).encode(),
                                 headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (route, template, r.text)
            error = r.json()["error"]
            assert error["type"] == "BadRequestError" and "malformed JSON body" in error["message"], error
    ok = bare_server.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_generation_configs_max_new_tokens_caps_every_completion(tmp_path):
    """vLLM's server caps a request's completion budget by the model's generation_config.json
    ``max_new_tokens`` (the request's ``max_tokens`` when smaller, the default 16 when left out);
    before, the server dropped the key. ``--generation-config vllm`` lifts the cap."""
    import json

    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path / "target", seed=0)
    (target / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))

    def served(*flags: str) -> dict[str, int]:
        """usage.completion_tokens for max_tokens 10, 2 and left out."""
        with df.tiny_http_server(target, "--max-model-len", "64", *flags) as http:
            counts = {}
            for max_tokens in (10, 2, None):
                body = {"prompt": [3, 1, 4], "temperature": 0, "ignore_eos": True}
                if max_tokens is not None:
                    body["max_tokens"] = max_tokens
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["finish_reason"] == "length"
                counts[str(max_tokens)] = r.json()["usage"]["completion_tokens"]
            return counts

    assert served() == {"10": 3, "2": 2, "None": 3}
    assert served("--generation-config", "vllm") == {"10": 10, "2": 2, "None": 16}


@pytest.fixture(scope="module")
def id_server(tmp_path_factory):
    """A target-only server on a tokenizer-less checkpoint with ``--enable-request-id-headers``."""
    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path_factory.mktemp("ids") / "target", seed=0)
    with df.tiny_http_server(target, "--max-model-len", "64", "--enable-request-id-headers") as http:
        yield http


def test_request_ids_come_from_x_request_id_or_the_body_as_in_vllm(id_server, bare_server):
    """vLLM's response ``id`` is ``cmpl-<X-Request-Id>`` (else the body's ``request_id``, else
    random); ours was always random. Two prompts of one request, and n choices, share the
    client's id, yet the engine's ids stay distinct (the same id twice would have crossed their
    outputs). ``--enable-request-id-headers`` echoes the header, or sends a fresh one, on every
    response (errors too); without the flag there is none."""
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = id_server.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-7"
    assert r.headers["x-request-id"] == "trace-7"
    alone = r.json()["choices"][0]["text"]
    r = id_server.post("/v1/completions", json={**body, "request_id": "from-body"})
    assert r.json()["id"] == "cmpl-from-body" and len(r.headers["x-request-id"]) == 32
    r = id_server.post("/v1/completions", json={**body, "request_id": "from-body"},
                       headers={"X-Request-Id": "from-header"})
    assert r.json()["id"] == "cmpl-from-header"
    r = id_server.post("/v1/completions", json=body)
    assert r.json()["id"].startswith("cmpl-") and len(r.json()["id"]) == 5 + 32
    # two prompts and n=2 under one client id: four engine requests, each its own output
    other = id_server.post("/v1/completions", json={**body, "prompt": [9, 2, 6]}).json()
    r = id_server.post("/v1/completions", json={**body, "prompt": [[3, 1, 4, 1, 5], [9, 2, 6]], "n": 2},
                       headers={"X-Request-Id": "same"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-same"
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == [alone, alone, other["choices"][0]["text"], other["choices"][0]["text"]]
    bad = id_server.post("/v1/completions", json={**body, "max_tokens": 0},
                         headers={"X-Request-Id": "bad-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
    assert id_server.get("/health").headers["x-request-id"]
    plain = bare_server.post("/v1/completions", json=body, headers={"X-Request-Id": "t"})
    assert plain.json()["id"] == "cmpl-t" and "x-request-id" not in plain.headers


def test_a_priority_other_than_zero_is_a_400(bare_server):
    """vLLM refuses ``priority`` != 0 unless started with ``--scheduling-policy priority``; ours
    took it silently (first come, first served anyway)."""
    body = {"prompt": [3, 1, 4], "max_tokens": 2}
    r = bare_server.post("/v1/completions", json={**body, "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "leave priority out or 0" in r.json()["error"]["message"]
    assert bare_server.post("/v1/completions", json={**body, "priority": 0}).status_code == 200


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(bare_server):
    """vLLM's ``truncate_prompt_tokens`` (a 400 before): only the prompt's last N tokens are
    prefilled, so the output is that of the cut prompt; -1 keeps max_model_len of them (64
    here: no room left, a 400 naming the prompt); outside [1, max_model_len] is a 400 naming
    the field."""
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompt = [(5 * i + 3) % 60 for i in range(20)]
    cut = bare_server.post("/v1/completions", json={**body, "prompt": prompt, "truncate_prompt_tokens": 4,
                                                    "return_token_ids": True})
    assert cut.status_code == 200, cut.text
    alone = bare_server.post("/v1/completions", json={**body, "prompt": prompt[-4:], "return_token_ids": True})
    whole = bare_server.post("/v1/completions", json={**body, "prompt": prompt, "return_token_ids": True})
    assert cut.json()["usage"]["prompt_tokens"] == 4
    assert cut.json()["choices"][0]["token_ids"] == alone.json()["choices"][0]["token_ids"]
    assert cut.json()["choices"][0]["prompt_token_ids"] == prompt[-4:]
    assert alone.json()["choices"][0]["token_ids"] != whole.json()["choices"][0]["token_ids"]
    many = bare_server.post("/v1/completions", json={**body, "prompt": [prompt, prompt[:3]],
                                                     "truncate_prompt_tokens": 4}).json()
    assert many["usage"]["prompt_tokens"] == 4 + 3  # a shorter prompt is kept whole
    long = bare_server.post("/v1/completions", json={**body, "prompt": prompt * 4, "truncate_prompt_tokens": -1})
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    assert "your prompt has 64 tokens" in long.json()["error"]["message"]
    for bad in (0, -2, 65):
        r = bare_server.post("/v1/completions", json={**body, "prompt": prompt, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (bad, r.text)


def test_several_served_model_names_as_in_vllm(tmp_path):
    """vLLM's ``--served-model-name A B``: requests may name either, responses and the metrics
    carry the first, /v1/models lists both; another name is a 404 naming ``model``. The flag
    took one name only (a second was an argparse error)."""
    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path / "target", seed=0)
    with df.tiny_http_server(target, "--max-model-len", "64", "--served-model-name", "laguna", "xs") as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["laguna", "xs"]
        body = {"prompt": [3, 1, 4], "max_tokens": 2}
        for name in ("laguna", "xs", None):
            r = http.post("/v1/completions", json={**body, **({"model": name} if name else {})})
            assert r.status_code == 200 and r.json()["model"] == "laguna", (name, r.text)
        r = http.post("/v1/completions", json={**body, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert 'model_name="laguna"' in http.get("/metrics").text


def test_enable_log_requests_logs_one_line_a_request(tmp_path, caplog):
    """vLLM's --enable-log-requests: an INFO line per request with its id, prompt length and
    sampling parameters; off by default."""
    import logging

    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path / "target", seed=0)
    body = {"prompt": [3, 1, 4], "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="laguna_dflash.server.serving"):
        with df.tiny_http_server(target, "--max-model-len", "64") as http:
            assert http.post("/v1/completions", json=body).status_code == 200
        assert not [r for r in caplog.records if "prompt tokens" in r.getMessage()]
        with df.tiny_http_server(target, "--max-model-len", "64", "--enable-log-requests") as http:
            rid = http.post("/v1/completions", json=body, headers={"X-Request-Id": "logged"}).json()["id"]
    lines = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"request {rid}: 3 prompt tokens, n=1")
    assert "max_tokens=2" in lines[0]
