"""Structured outputs over HTTP (server/structured.py, Serving.structured_constraint): OpenAI's
``response_format`` (json_object, json_schema), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_whitespace_pattern`` and its ``structured_outputs`` dict, on
``/v1/completions`` and ``/v1/chat/completions``.

One speculative server (the tiny Laguna target with its tokenizer and a z-lab drafter) and the
target alone offline: a constrained output matches its constraint, ends with ``stop``, is the
target-only output token for token at temperature 0 (drafts are accepted under a constraint
too), and is the same streamed or not. Every bad value is a 400 naming the field, after which
the server serves on; a model without a tokenizer, a server without outlines-core and a slow
compile (off the event loop) are checked too.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

import laguna_dflash.structured_outputs as so_module
from laguna_dflash import LLM, SamplingParams
from laguna_dflash.server.errors import APIError
from laguna_dflash.server.protocol import ChatCompletionRequest, CompletionRequest
from laguna_dflash.server.structured import requested_constraint
from laguna_dflash.structured_outputs import StructuredOutputCompiler, StructuredOutputsParams

K = 3
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "Describe a widget as JSON."}]
#: finishes within a few dozen tokens on the tiny model: every value is bounded
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "color": {"enum": ["red", "blue"]},
    "ok": {"type": "boolean"},
    "size": {"type": "integer", "enum": [1, 2, 3]},
}, "required": ["name", "color", "ok", "size"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "widget", "schema": SCHEMA, "strict": True}}
#: (prompt, regex): finite languages, and wide ones the target's own tokens often fit (so drafts
#: are accepted under the constraint)
REGEX_CASES = [
    ("def f(x):", r"(ab|cd){2,4}x"),
    ("def f(x):", r"[0-9]{3}-[0-9]{2}"),
    ("import os", r"[\s\S]{10,60}"),
    ("import os", r"[^0-9]{10,60}"),
]
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_served_pair(tmp_path_factory.mktemp("structured"), K + 1, distill_steps=200)


@pytest.fixture(scope="module")
def http(pair):
    import dflash_fixtures as df

    target, draft = pair
    with df.tiny_http_server(target, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "160",
                             "--draft", str(draft), "--num-speculative-tokens", str(K)) as client:
        yield client


@pytest.fixture(scope="module")
def offline(pair):
    """The target alone (no drafter), offline: the reference outputs."""
    return LLM(str(pair[0]), block_size=8, max_model_len=MAX_MODEL_LEN)


def _ok(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(http: httpx.Client, path: str, body: dict) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish_reason) of choice 0 of a streamed request (``return_token_ids``)."""
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    text, tokens, finish = "", [], None
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            text += c["text"] if "text" in c else c["delta"].get("content", "")
            tokens += c.get("token_ids") or []
            finish = c["finish_reason"] or finish
    return text, tokens, finish


def _target_only(offline: LLM, prompt: str | None, max_tokens: int, constraint: dict) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    if prompt is None:
        return offline.chat(MESSAGES, params)[0].token_ids
    return offline.generate([prompt], params)[0].token_ids


# ---- completions -------------------------------------------------------------------------------


def test_guided_regex_matches_and_equals_target_only_streamed_or_not(http, offline):
    """Each regex: the text fullmatches it and ends with "stop"; the speculative server's tokens
    are the target-only tokens; streamed the same; ``structured_outputs: {"regex"}`` is the
    same constraint. Some drafts are accepted along the way (speculation ran)."""
    accepted = 0
    for prompt, regex in REGEX_CASES:
        body = {"prompt": prompt, "max_tokens": 100, "temperature": 0, "return_token_ids": True}
        out = _ok(http, "/v1/completions", {**body, "guided_regex": regex})
        choice = out["choices"][0]
        assert re.fullmatch(regex, choice["text"]) and choice["finish_reason"] == "stop", choice
        assert choice["token_ids"] == _target_only(offline, prompt, 100, {"regex": regex}), regex
        accepted += out["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"]
        assert _streamed(http, "/v1/completions", {**body, "guided_regex": regex}) == (
            choice["text"], choice["token_ids"], "stop")
        same = _ok(http, "/v1/completions", {**body, "structured_outputs": {"regex": regex}})
        assert same["choices"][0]["token_ids"] == choice["token_ids"]
    assert accepted > 0


def test_sampled_choices_match_the_regex(http):
    regex = r"[0-9]{3}-[0-9]{2}"
    out = _ok(http, "/v1/completions", {"prompt": "phone:", "max_tokens": 40, "temperature": 1.0,
                                        "seed": 7, "n": 4, "guided_regex": regex})
    assert len(out["choices"]) == 4
    for choice in out["choices"]:
        assert re.fullmatch(regex, choice["text"]) and choice["finish_reason"] == "stop", choice


def test_guided_choice_gives_one_of_the_choices(http, offline):
    body = {"prompt": "hello", "max_tokens": 20, "temperature": 0, "return_token_ids": True,
            "guided_choice": CHOICES}
    choice = _ok(http, "/v1/completions", body)["choices"][0]
    assert choice["text"] in CHOICES and choice["finish_reason"] == "stop", choice
    assert choice["token_ids"] == _target_only(offline, "hello", 20, {"choice": CHOICES})
    sampled = _ok(http, "/v1/completions", {**body, "temperature": 1.0, "seed": 3, "n": 4})
    assert all(c["text"] in CHOICES and c["finish_reason"] == "stop" for c in sampled["choices"])
    chat = _ok(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20,
                                              "temperature": 0, "guided_choice": CHOICES})
    assert chat["choices"][0]["message"]["content"] in CHOICES


def test_a_complete_choice_under_ignore_eos_keeps_its_last_token(http, offline):
    """With ignore_eos nothing may follow a complete choice: the request ends with "stop" and
    the whole choice as its text (the last token is not a stop token to leave out), streamed
    or not, the target-only tokens."""
    body = {"prompt": "hello", "max_tokens": 20, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, "guided_choice": CHOICES}
    choice = _ok(http, "/v1/completions", body)["choices"][0]
    assert choice["text"] in CHOICES and choice["finish_reason"] == "stop", choice
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            structured_outputs={"choice": CHOICES})
    assert choice["token_ids"] == offline.generate(["hello"], params)[0].token_ids
    assert _streamed(http, "/v1/completions", body) == (choice["text"], choice["token_ids"], "stop")


#: a context-free language (a^n c b^n): no regex describes it, so it takes the grammar backend
NESTED_GBNF = 'root ::= "a" root "b" | "c"'


def test_guided_grammar_matches_and_equals_target_only_streamed_or_not(http, offline):
    """``guided_grammar`` (GBNF) and ``structured_outputs: {"grammar"}`` (Lark): the text is a
    word of the grammar, ends with "stop", and is the target-only tokens, streamed the same."""
    words = re.compile(r"(a*)c(b*)")
    for extra in ({"guided_grammar": NESTED_GBNF},
                  {"structured_outputs": {"grammar": 'start: "a" start "b" | "c"'}}):
        body = {"prompt": "def f(x):", "max_tokens": 40, "temperature": 0, "return_token_ids": True, **extra}
        choice = _ok(http, "/v1/completions", body)["choices"][0]
        m = words.fullmatch(choice["text"])
        assert m and len(m.group(1)) == len(m.group(2)) and choice["finish_reason"] == "stop", choice
        assert choice["token_ids"] == _target_only(offline, "def f(x):", 40, {"grammar": NESTED_GBNF})
        assert _streamed(http, "/v1/completions", body) == (choice["text"], choice["token_ids"], "stop")
    chat = _ok(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "temperature": 1.0,
                                              "seed": 5, "n": 3, "guided_grammar": NESTED_GBNF})
    for c in chat["choices"]:
        m = words.fullmatch(c["message"]["content"])
        assert m and len(m.group(1)) == len(m.group(2)), c


# ---- chat and JSON ----------------------------------------------------------------------------


def _check_widget(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "color", "ok", "size"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert obj["color"] in ("red", "blue") and isinstance(obj["ok"], bool) and obj["size"] in (1, 2, 3)


def test_chat_json_schema_gives_the_schema_as_target_only_streamed_or_not(http, offline):
    body = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0, "return_token_ids": True}
    out = _ok(http, "/v1/chat/completions", {**body, "response_format": RESPONSE_FORMAT})
    choice = out["choices"][0]
    text = choice["message"]["content"]
    _check_widget(text)
    assert choice["finish_reason"] == "stop", choice
    assert choice["token_ids"] == _target_only(offline, None, 200, {"json": SCHEMA})
    assert _streamed(http, "/v1/chat/completions", {**body, "response_format": RESPONSE_FORMAT}) == (
        text, choice["token_ids"], "stop")
    # vLLM's spellings of the same constraint: a dict, its JSON text, structured_outputs
    for extra in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                  {"structured_outputs": {"json": SCHEMA, "backend": "xgrammar"}},
                  {"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}):
        again = _ok(http, "/v1/chat/completions", {**body, **extra})["choices"][0]
        assert again["message"]["content"] == text, extra


def test_json_schema_on_completions_and_whitespace_pattern(http):
    body = {"prompt": "def f(x):", "max_tokens": 200, "temperature": 0}
    loose = _ok(http, "/v1/completions", {**body, "response_format": RESPONSE_FORMAT})["choices"][0]
    _check_widget(loose["text"])
    assert loose["finish_reason"] == "stop"
    # no whitespace between JSON tokens: the same fields, written tight
    for extra in ({"guided_json": SCHEMA, "guided_whitespace_pattern": ""},
                  {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}):
        tight = _ok(http, "/v1/completions", {**body, **extra})["choices"][0]
        _check_widget(tight["text"])
        assert tight["text"].startswith('{"name":"') and '" :' not in tight["text"], tight


def test_json_object_gives_a_json_object(http):
    """Any JSON object (the tiny model closes it at once: ``{}``)."""
    chat = _ok(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "temperature": 0,
                                              "response_format": {"type": "json_object"}})
    choice = chat["choices"][0]
    assert isinstance(json.loads(choice["message"]["content"]), dict) and choice["finish_reason"] == "stop"
    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        out = _ok(http, "/v1/completions", {"prompt": "import os", "max_tokens": 200, "temperature": 0,
                                            **extra})["choices"][0]
        assert isinstance(json.loads(out["text"]), dict) and out["finish_reason"] == "stop", out
    text = _ok(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "temperature": 0,
                                              "response_format": {"type": "text"}})
    assert text["choices"][0]["message"]["content"] != choice["message"]["content"]  # unconstrained


# ---- errors -----------------------------------------------------------------------------------

BAD = [
    ({"guided_grammar": 'root ::= "a" undefined'}, "guided_grammar", "guided_grammar is not a valid Lark or GBNF"),
    ({"guided_grammar": ["root"]}, "guided_grammar", "guided_grammar must be a Lark or GBNF grammar"),
    ({"guided_grammar": "start: 'a'", "guided_regex": "a"}, "guided_regex", "guided_regex, guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format",
     "structural tags) is not supported"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be one of text, json_object, json_schema"),
    ({"response_format": {"json_schema": {"schema": SCHEMA}}}, "response_format", "response_format.type"),
    ({"response_format": "json"}, "response_format", "valid dictionary"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format", "response_format.json_schema.schema: Unsupported type"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex", "guided_regex, guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "send only one"),
    ({"guided_regex": "("}, "guided_regex", "cannot be compiled"),
    ({"guided_regex": 5}, "guided_regex", "guided_regex must be a string"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_json": [1]}, "guided_json", "must be a JSON schema"),
    ({"guided_json": {"type": "foo"}}, "guided_json", "Unsupported type: foo"),
    ({"guided_whitespace_pattern": 5}, "guided_whitespace_pattern", "string"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "("}, "guided_json", "cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs",
     "structured_outputs.grammar is not a valid Lark or GBNF"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown fields ['pattern']"),
    ({"structured_outputs": "a+"}, "structured_outputs", "dict"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": 5}}, "structured_outputs",
     "whitespace_pattern"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param, needle", BAD, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_constraints_are_a_400_naming_the_field(http, path, extra, param, needle):
    body = ({"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}) | {"max_tokens": 8}
    for stream in (False, True):  # streamed requests are checked before the stream starts
        r = http.post(path, json={**body, **extra, "stream": stream})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and needle in error["message"], error
    ok = _ok(http, path, {**body, "guided_choice": CHOICES, "temperature": 0})
    assert ok["choices"][0]["finish_reason"] == "stop"


def test_a_schema_with_an_infinite_number_is_a_400(http):
    """Python's JSON parser reads 1e400 as infinity, which outlines-core's schema parser refuses
    (a TypeError): a 400 naming the field, not a 500."""
    body = '{"prompt": "x", "max_tokens": 4, "guided_json": {"type": "integer", "minimum": 1e400}}'
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_json"


def test_a_server_without_outlines_core_says_what_to_install(http, monkeypatch):
    """outlines-core missing (its import fails): a 400 naming the field with the pip line; the
    server serves constraints again once it is there."""
    def missing():
        raise ImportError("structured outputs need outlines-core==0.2.14: pip install "
                          "'laguna-dflash[structured]'")

    body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "guided_regex": "z{1,3}q"}  # not cached
    monkeypatch.setattr(so_module, "_backend", missing)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_regex" and "pip install 'laguna-dflash[structured]'" in error["message"]
    monkeypatch.undo()
    assert re.fullmatch("z{1,3}q", _ok(http, "/v1/completions", body)["choices"][0]["text"])


def test_compiling_does_not_block_the_event_loop(http, monkeypatch):
    """A slow compile runs in a thread: the server answers other requests meanwhile."""
    entered, release = threading.Event(), threading.Event()
    compile_ = StructuredOutputCompiler.compile

    def slow(self, params):
        entered.set()
        release.wait(20)
        return compile_(self, params)

    monkeypatch.setattr(StructuredOutputCompiler, "compile", slow)
    result = {}
    url = str(http.base_url.join("/v1/completions"))
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "guided_choice": CHOICES}
    worker = threading.Thread(target=lambda: result.update(r=httpx.post(url, json=body, timeout=60)))
    worker.start()
    try:
        assert entered.wait(20)
        other = httpx.post(url, json={"prompt": "x", "max_tokens": 4, "temperature": 0}, timeout=5)
        assert other.status_code == 200 and worker.is_alive()
    finally:
        release.set()
        worker.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] in CHOICES


def test_a_model_without_a_tokenizer_is_a_400(tmp_path_factory):
    import dflash_fixtures as df

    target = df.make_tiny_laguna_target(tmp_path_factory.mktemp("structured_bare") / "target", seed=0)
    body = {"prompt": [3, 1, 4], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with df.tiny_http_server(target, "--max-model-len", "64") as bare:
        for extra, param in (({"guided_regex": "a+"}, "guided_regex"),
                             ({"response_format": {"type": "json_object"}}, "response_format")):
            r = bare.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and "needs a tokenizer" in error["message"], error
        ok = _ok(bare, "/v1/completions", {**body, "response_format": {"type": "text"}})
        assert ok["usage"]["completion_tokens"] == 3


# ---- the fields -> StructuredOutputsParams (no server) -----------------------------------------


def test_requested_constraint_maps_the_fields():
    def of(**fields):
        return requested_constraint(CompletionRequest(prompt="x", **fields))

    assert of() is None and of(response_format={"type": "text"}) is None and of(response_format={}) is None
    assert of(guided_whitespace_pattern=" ") is None  # nothing to apply it to (as vLLM)
    assert of(response_format={"type": "json_object"}) == (
        StructuredOutputsParams(json_object=True), "response_format")
    assert of(response_format=RESPONSE_FORMAT) == (StructuredOutputsParams(json=SCHEMA), "response_format")
    assert of(guided_json=SCHEMA, guided_whitespace_pattern="[ ]*") == (
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern="[ ]*"), "guided_json")
    assert of(guided_regex="a+", guided_decoding_backend="xgrammar") == (
        StructuredOutputsParams(regex="a+"), "guided_regex")
    # structured_outputs' own whitespace_pattern wins over the older field
    assert of(structured_outputs={"json": SCHEMA, "whitespace_pattern": " ?",
                                  "disable_fallback": True}, guided_whitespace_pattern="") == (
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"), "structured_outputs")
    chat = ChatCompletionRequest(messages=MESSAGES, guided_choice=["a", "b"])
    assert requested_constraint(chat) == (StructuredOutputsParams(choice=["a", "b"]), "guided_choice")
    with pytest.raises(APIError) as info:
        of(guided_regex="a", guided_json=SCHEMA, response_format={"type": "json_object"})
    assert info.value.param == "response_format"
    assert "(response_format, guided_json, guided_regex)" in info.value.message


# ---- vLLM's launch flags ------------------------------------------------------------------------


@pytest.mark.parametrize("raw, message", [
    ("{not json", "is not valid JSON"),
    ('["auto"]', "must be a JSON object"),
    ('{"backend": "fast"}', "backend must be one of auto, outlines, xgrammar"),
    ('{"backnd": "auto"}', r"unknown keys \['backnd'\]"),
    ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace must be true or false"),
])
def test_structured_outputs_config_errors_name_the_flag(raw, message):
    from laguna_dflash.server.args import structured_outputs_defaults

    with pytest.raises(ValueError, match=f"--structured-outputs-config .*{message}|{message}"):
        structured_outputs_defaults(raw)
    assert structured_outputs_defaults(None) == {}
    assert structured_outputs_defaults('{"backend": "xgrammar", "disable_fallback": true}') == {}


def test_server_wide_disable_any_whitespace(pair):
    """``--structured-outputs-config '{"disable_any_whitespace": true}'`` (and vLLM's older
    ``--guided-decoding-backend``) start a server whose JSON constraints allow no whitespace,
    unless a request sends its own whitespace pattern."""
    import dflash_fixtures as df

    body = {"prompt": "def f(x):", "max_tokens": 80, "temperature": 0, "guided_json": SCHEMA}
    with df.tiny_http_server(pair[0], "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "160",
                             "--guided-decoding-backend",
                             "xgrammar", "--structured-outputs-config",
                             '{"backend": "xgrammar", "disable_any_whitespace": true}') as tight:
        out = _ok(tight, "/v1/completions", body)["choices"][0]
        assert out["finish_reason"] == "stop" and json.loads(out["text"]).keys() == SCHEMA["properties"].keys()
        assert not re.search(r"\s", out["text"]), out["text"]
        spaced = _ok(tight, "/v1/completions", {**body, "guided_whitespace_pattern": "[ ]"})["choices"][0]
        assert ": " in spaced["text"] and json.loads(spaced["text"]) is not None
