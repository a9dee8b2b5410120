"""OpenAI tool calling on ``/v1/chat/completions`` (server/tool_calls.py), as vLLM serves it.

The Hermes parser on text alone (blocks, invalid JSON, text before them, the hold-back of a
``<tool_call`` prefix while streaming), the request checks (plan_tools) and the flags. Then one
speculative server started with ``--enable-auto-tool-choice --tool-call-parser hermes`` and a
tool-aware chat template: a named tool choice's arguments parse and satisfy the tool's schema,
streamed the same; ``"required"`` gives calls of the tools; ``"auto"`` (forced to write a
``<tool_call>`` block by ``guided_regex``) gives the call and ``finish_reason: "tool_calls"``,
streamed or not; a conversation holding a tool call and its result renders; every bad value is a
400 naming the field, after which the server serves on. A second server without the flags keeps
``"auto"`` a 400 with vLLM's wording and serves named and required tool choices.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from laguna_dflash.chat_template import ChatTemplateError, message_dict
from laguna_dflash.server.errors import APIError
from laguna_dflash.server.protocol import ChatCompletionRequest
from laguna_dflash.server.tool_calls import (
    HermesToolParser,
    ToolPlan,
    ToolStreamer,
    final_message,
    parse_hermes,
    plan_tools,
    required_schema,
)
from laguna_dflash.structured_outputs import StructuredOutputsParams

K = 3
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
#: bounded schemas: the tiny model finishes them within max_tokens
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "enum": [1, 2, 3]},
}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
#: a hermes block the model is made to write
HERMES_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'
                r"\n</tool_call>")
#: writes tools, assistant tool calls (arguments as objects) and tool results
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}, \"city\": \"{{ c.function.arguments.city }}\"}</tool_call>"
    "{% endfor %}<|end|>"
    "{% elif m.role == 'tool' %}<|user|><tool_response {{ m.tool_call_id }}>{{ m.content }}"
    "</tool_response><|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


# ---- the hermes parser (text only) --------------------------------------------------------------


def _block(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_text_without_tool_calls_is_content_as_written():
    for text in ("", "hello", "  a <tool and </tool_call> >  ", "<tool_cal"):
        assert parse_hermes(text) == (text, [])


def test_blocks_become_calls_and_text_before_them_content():
    text = "Let me look.\n\n" + _block("get_weather", {"city": "Rome"}) + "\n" + _block("get_time", {})
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert calls == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    # blocks alone: no content; arguments keep non-ASCII text (ensure_ascii off, as vLLM)
    assert parse_hermes(_block("f", {"s": "é"})) == (None, [("f", '{"s": "é"}')])
    # a block left open at the end (the model stopped after the JSON) is still a call
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}') == (None, [("f", '{"a": 1}')])
    # no arguments: {}
    assert parse_hermes('<tool_call>{"name": "f"}</tool_call>') == (None, [("f", "{}")])


def test_an_invalid_block_stays_in_the_content():
    bad = "<tool_call>{not json}</tool_call>"
    assert parse_hermes("x " + bad) == ("x " + bad, [])  # no call: the text as written
    content, calls = parse_hermes("x " + bad + "\n" + _block("f", {"a": 1}))
    assert calls == [("f", '{"a": 1}')] and content == "x " + bad
    for body in ('{"arguments": {}}', '{"name": "", "arguments": {}}', '{"name": "f", "arguments": 3}',
                 '["f"]'):
        assert parse_hermes(f"<tool_call>{body}</tool_call>")[1] == [], body
    # text after the blocks is content too (whitespace between them is not)
    assert parse_hermes(_block("f", {}) + "\n\n" + _block("g", {}) + "\ndone") == (
        "done", [("f", "{}"), ("g", "{}")])


def test_streaming_holds_back_a_possible_marker_and_nothing_else():
    parser = HermesToolParser()
    assert parser.feed("Sure <tool") == ("Sure ", [])  # "<tool" may start a marker
    assert parser.feed("s>") == ("<tools>", [])  # it did not
    assert parser.feed(" <") == (" ", [])
    assert parser.feed("tool_call>\n{\"name\": \"f\", ") == ("", [])  # inside a block: held
    assert parser.feed('"arguments": {"a": 1}}\n</tool_') == ("", [])
    assert parser.feed("call>\n") == ("", [("f", '{"a": 1}')])  # whitespace after it: held
    assert parser.feed("", final=True) == ("", [])


def test_streaming_one_character_at_a_time_gives_the_whole_parse():
    text = "I will call it.\n" + _block("get_weather", {"city": "Paris"}) + "\n" + _block("get_time", {})
    parser, content, calls = HermesToolParser(), "", []
    for ch in text:
        piece, new = parser.feed(ch)
        assert "<" not in piece or piece.startswith("<tools"), piece
        content, calls = content + piece, calls + new
    piece, new = parser.feed("", final=True)
    assert content + piece == "I will call it.\n"
    assert calls + new == parse_hermes(text)[1] and len(calls + new) == 2


# ---- the request: plan_tools -------------------------------------------------------------------


def _plan(auto: bool = True, **fields) -> ToolPlan:
    return plan_tools(ChatCompletionRequest(messages=MESSAGES, **fields), auto)


def test_plans_of_each_tool_choice():
    assert _plan() == _plan(tools=TOOLS, tool_choice="none") == _plan(tool_choice="auto") == ToolPlan()
    assert _plan(tools=[], tool_choice="required") == ToolPlan()  # nothing to require (vLLM's)
    assert _plan(tools=TOOLS).mode == _plan(tools=TOOLS, tool_choice="auto").mode == "auto"
    assert _plan(tools=TOOLS, parallel_tool_calls=False).max_calls == 1
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name, named.constraint) == ("named", "get_time", StructuredOutputsParams(json=TIME))
    assert named.path == "tools[1].function.parameters"
    bare = [{"type": "function", "function": {"name": "f"}}]
    assert _plan(tools=bare, tool_choice={"type": "function", "function": {"name": "f"}}).constraint == (
        StructuredOutputsParams(json_object=True))
    required = _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.constraint == StructuredOutputsParams(json=required_schema(
        [("get_weather", WEATHER), ("get_time", TIME)], 1))
    # named and required need no flags (as in vLLM)
    assert _plan(False, tools=TOOLS, tool_choice="required").mode == "required"
    assert _plan(False, tools=TOOLS, tool_choice=NAMED).mode == "named"


def test_the_required_schema_takes_arrays_of_the_tools_calls():
    pattern = re.compile(StructuredOutputsParams(json=required_schema(
        [("get_weather", WEATHER), ("get_time", TIME), ("ping", None)])).to_regex())
    for text in ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]',
                 '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "ping", "parameters": {}}]'):
        assert pattern.fullmatch(text), text
    for text in ("[]", '{"name": "ping", "parameters": {}}', '[{"name": "ping", "parameters": {"a": 1}}]',
                 '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]',
                 '[{"name": "nope", "parameters": {}}]'):
        assert not pattern.fullmatch(text), text
    one = re.compile(StructuredOutputsParams(json=required_schema([("ping", None)], 1)).to_regex())
    assert one.fullmatch('[{"name": "ping", "parameters": {}}]')
    assert not one.fullmatch('[{"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {}}]')
    # the tools' $defs are gathered at the top
    ref = {"type": "object", "properties": {"u": {"$ref": "#/$defs/unit"}}, "required": ["u"],
           "$defs": {"unit": {"enum": ["C", "F"]}}}
    schema = required_schema([("t", ref)])
    assert schema["$defs"] == {"unit": {"enum": ["C", "F"]}} and '"$defs":' not in json.dumps(schema["items"])
    assert re.fullmatch(StructuredOutputsParams(json=schema).to_regex(), '[{"name": "t", "parameters": {"u": "F"}}]')
    assert "$defs" in ref  # the request's own schema is left alone


PLAN_ERRORS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice", "names no function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", '"function": {"name"'),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"none", "auto", "required"'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": NAMED}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "tools[0].function.name"),
    ({"tools": [TOOLS[0], {"type": "function"}]}, "tools", "tools[1] is not a function tool"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "not a function tool"),
    ({"tools": ["f"]}, "tools", "not a function tool"),
    ({"tools": [{"function": {"name": "f", "parameters": [1]}}]}, "tools", "must be a JSON schema"),
    ({"tools": [{"function": {"name": "a", "parameters": {"$defs": {"x": {"type": "integer"}}}}},
                {"function": {"name": "b", "parameters": {"$defs": {"x": {"type": "string"}}}}}],
      "tool_choice": "required"}, "tools", "$defs.x differently"),
]


@pytest.mark.parametrize("fields, param, needle", PLAN_ERRORS,
                         ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(PLAN_ERRORS)])
def test_bad_tools_and_tool_choices_name_the_field(fields, param, needle):
    with pytest.raises(APIError) as info:
        _plan(**fields)
    assert info.value.status == 400 and info.value.param == param and needle in info.value.message


def test_auto_without_the_flags_says_which_flags():
    for fields, param in (({"tools": TOOLS}, "tools"), ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice")):
        with pytest.raises(APIError) as info:
            _plan(False, **fields)
        assert info.value.param == param
        assert "--enable-auto-tool-choice --tool-call-parser hermes" in info.value.message


def test_tool_call_parser_flags():
    from laguna_dflash.cli import build_parser
    from laguna_dflash.server.args import tool_call_settings

    def settings(*flags):
        return tool_call_settings(build_parser().parse_args(["serve", "--model", "m", *flags]))

    assert settings() == {"enable_auto_tool_choice": False, "tool_call_parser": None}
    assert settings("--enable-auto-tool-choice", "--tool-call-parser", "hermes") == {
        "enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    with pytest.raises(ValueError, match="'pythonic' is not supported; this server has hermes"):
        settings("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    with pytest.raises(ValueError, match="add --tool-call-parser hermes"):
        settings("--enable-auto-tool-choice")


# ---- responses from text (no server) -----------------------------------------------------------


def test_messages_and_finish_reasons_of_each_mode():
    named = ToolPlan("named", "get_weather")
    message, finish = final_message(named, '{"city": "Rome"}', "stop")
    call, = message["tool_calls"]
    assert message["content"] == "" and finish == "stop"
    assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call["id"]) and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert final_message(named, '{"ci', "length")[1] == "length"
    required = ToolPlan("required")
    message, finish = final_message(required, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
                                    "stop")
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "a", "arguments": '{"x": 1}'},
                                                             {"name": "b", "arguments": "{}"}]
    assert finish == "tool_calls" and message["content"] == ""
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert final_message(required, '[{"name": "a", "param', "length") == (
        {"role": "assistant", "content": '[{"name": "a", "param'}, "length")
    auto = ToolPlan("auto", max_calls=1)
    message, finish = final_message(auto, "hm " + _block("a", {}) + _block("b", {}), "stop")
    assert finish == "tool_calls" and message["content"] == "hm"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a"]  # parallel_tool_calls false
    assert final_message(auto, "plain", "length") == ({"role": "assistant", "content": "plain"}, "length")
    assert final_message(ToolPlan(), "plain", "stop") == ({"role": "assistant", "content": "plain"}, "stop")


def test_streamed_deltas_of_each_mode():
    named = ToolStreamer(ToolPlan("named", "f"))
    head, = named.header()["tool_calls"]
    assert head["index"] == 0 and head["function"] == {"name": "f", "arguments": ""} and head["type"] == "function"
    assert named.feed('{"a"', False) == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert named.feed("", True) == {} and named.finish_reason("stop") == "stop"
    required = ToolStreamer(ToolPlan("required"))
    assert required.header() is None
    assert required.feed('[{"name": "a", ', False) == {} and required.finish_reason(None) is None
    calls = required.feed('"parameters": {}}]', True)["tool_calls"]
    assert [(c["index"], c["function"]) for c in calls] == [(0, {"name": "a", "arguments": "{}"})]
    assert required.finish_reason("stop") == "tool_calls"
    auto = ToolStreamer(ToolPlan("auto"))
    assert auto.feed("Hi <tool_", False) == {"content": "Hi "}
    delta = auto.feed('call>{"name": "a", "arguments": {}}</tool_call>', False)
    assert "content" not in delta and delta["tool_calls"][0]["function"] == {"name": "a", "arguments": "{}"}
    assert auto.feed(_block("b", {}), True)["tool_calls"][0]["index"] == 1
    assert auto.finish_reason("stop") == "tool_calls"
    plain = ToolStreamer(ToolPlan("auto"))
    assert plain.feed("no <b>call</b>", True) == {"content": "no <b>call</b>"}
    assert plain.finish_reason("length") == "length"


def test_history_arguments_reach_templates_as_objects():
    """vLLM's: an assistant's tool call arguments, sent as JSON text, are dicts in templates."""
    data = message_dict(HISTORY[1])
    assert data["content"] == "" and data["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"].startswith("{")  # the caller's: unchanged
    empty = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}
    assert message_dict(empty)["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(ChatTemplateError, match="function.arguments is not valid JSON"):
        message_dict({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]})


# ---- one live server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_served_pair(tmp_path_factory.mktemp("tools"), K + 1, distill_steps=200)


@pytest.fixture(scope="module")
def http(pair, tmp_path_factory):
    import dflash_fixtures as df

    template = tmp_path_factory.mktemp("tools_template") / "template.jinja"
    template.write_text(TEMPLATE)
    target, draft = pair
    with df.tiny_http_server(target, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "160",
                             "--draft", str(draft), "--num-speculative-tokens", str(K),
                             "--chat-template", str(template),
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as client:
        yield client


def _ok(http: httpx.Client, body: dict) -> dict:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(http: httpx.Client, body: dict) -> list[dict]:
    """Choice 0's streamed chunks (each ``choices[0]``)."""
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            out += [c for c in chunk["choices"] if c["index"] == 0]
    return out


def _streamed_calls(chunks: list[dict]) -> tuple[str, list[dict], str | None]:
    """(content, tool calls, finish_reason) of streamed chunks, the calls merged by index as
    OpenAI clients do (name once, arguments appended)."""
    content, calls, finish = "", {}, None
    for c in chunks:
        content += c["delta"].get("content") or ""
        for d in c["delta"].get("tool_calls") or []:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = d.get("id") or call["id"]
            fn = d.get("function") or {}
            call["name"] = fn.get("name") or call["name"]
            call["arguments"] += fn.get("arguments") or ""
        finish = c["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _check_weather(arguments: dict) -> None:
    assert set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome"), arguments
    assert arguments["days"] in (1, 2, 3), arguments


def _check_time(arguments: dict) -> None:
    assert set(arguments) == {"zone"} and isinstance(arguments["zone"], str) and len(arguments["zone"]) <= 6


CHECKS = {"get_weather": _check_weather, "get_time": _check_time}


def test_named_tool_choice_gives_the_tools_arguments_streamed_or_not(http):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 100, "temperature": 0}
    out = _ok(http, body)
    choice = out["choices"][0]
    message = choice["message"]
    assert message["content"] == "" and choice["finish_reason"] == "stop", choice
    call, = message["tool_calls"]
    assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call["id"]) and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    _check_weather(json.loads(call["function"]["arguments"]))
    assert out["metrics"]["speculative_decoding"]["num_spec_steps"] > 0
    chunks = _chunks(http, body)
    first = chunks[1]["delta"]["tool_calls"][0]  # after the role's chunk
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"].startswith("chatcmpl-tool-")
    assert all(set(c["delta"]) <= {"tool_calls"} for c in chunks[2:]), chunks
    content, calls, finish = _streamed_calls(chunks)
    assert content == "" and finish == "stop" and len(calls) == 1
    assert calls[0]["arguments"] == call["function"]["arguments"] and calls[0]["name"] == "get_weather"
    assert len([c for c in chunks if c["delta"].get("tool_calls")]) > 2  # arguments arrive in pieces
    # a sampled choice is within the schema too
    sampled = _ok(http, {**body, "temperature": 1.0, "seed": 5, "n": 2})
    for choice in sampled["choices"]:
        _check_weather(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]))


def test_required_tool_choice_gives_calls_of_the_tools(http):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "temperature": 0}
    choice = _ok(http, body)["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "" and calls, choice
    for call in calls:
        CHECKS[call["function"]["name"]](json.loads(call["function"]["arguments"]))
    content, streamed, finish = _streamed_calls(_chunks(http, body))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for seed in range(3):
        one = _ok(http, {**body, "parallel_tool_calls": False, "temperature": 1.0, "seed": seed})
        calls = one["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1, calls
        CHECKS[calls[0]["function"]["name"]](json.loads(calls[0]["function"]["arguments"]))


def test_auto_parses_a_hermes_block_streamed_or_not(http):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 150, "temperature": 0,
            "guided_regex": HERMES_REGEX}
    for extra in ({}, {"tool_choice": "auto"}):
        choice = _ok(http, {**body, **extra})["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None, choice
        call, = message["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    chunks = _chunks(http, body)
    content, calls, finish = _streamed_calls(chunks)
    assert content == "" and finish == "tool_calls", chunks
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call["function"]["arguments"])]
    # without a call, the text is the content, as written
    plain = _ok(http, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 12, "temperature": 0,
                       "guided_regex": "[a-z ]{12}"})["choices"][0]
    assert "tool_calls" not in plain["message"] and re.fullmatch("[a-z ]{12}", plain["message"]["content"])
    assert plain["finish_reason"] in ("stop", "length")
    content, calls, finish = _streamed_calls(_chunks(http, {"messages": MESSAGES, "tools": TOOLS,
                                                           "max_tokens": 12, "temperature": 0,
                                                           "guided_regex": "[a-z ]{12}"}))
    assert (content, calls, finish) == (plain["message"]["content"], [], plain["finish_reason"])


def test_history_with_a_tool_call_and_its_result_renders(http):
    body = {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4,
            "temperature": 0}
    out = _ok(http, body)
    assert out["choices"][0]["finish_reason"] in ("stop", "length") and out["usage"]["prompt_tokens"] > 20
    ids = http.post("/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()["tokens"]
    prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    # the arguments reached the template as an object (written as JSON, and indexable)
    assert '"arguments": {"city": "Paris", "days": 1}, "city": "Paris"' in prompt, prompt
    assert "<tool_response call_1>sunny</tool_response>" in prompt and "tools: get_weather get_time" in prompt
    named = _ok(http, {**body, "tool_choice": NAMED, "max_tokens": 80})
    _check_weather(json.loads(named["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]))


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", '"none", "auto", "required"'),
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools",
     "tools[0].function.parameters: Unsupported type"),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "guided_regex", "leave guided_regex out"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "leave response_format out"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages",
     "not valid JSON"),
    ({"tools": TOOLS, "parallel_tool_calls": "sometimes"}, "parallel_tool_calls", "boolean"),
]


@pytest.mark.parametrize("extra, param, needle", BAD, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_tool_requests_are_a_400_naming_the_field(http, extra, param, needle):
    body = {"messages": MESSAGES, "max_tokens": 8} | extra
    for stream in (False, True):  # streamed requests are checked before the stream starts
        r = http.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and needle in error["message"], error
    ok = _ok(http, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 100,
                    "temperature": 0})
    _check_weather(json.loads(ok["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]))


def test_a_server_without_the_flags(pair):
    """``"auto"`` (tools sent without a tool_choice too) is a 400 with vLLM's wording; named and
    required tool choices need no flags; an unknown parser stops the server at start."""
    import dflash_fixtures as df

    with pytest.raises(ValueError, match="--tool-call-parser 'mistral' is not supported"):
        with df.tiny_http_server(pair[0], "--tool-call-parser", "mistral"):
            pass
    with df.tiny_http_server(pair[0], "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64") as bare:
        for extra, param in (({}, "tools"), ({"tool_choice": "auto"}, "tool_choice")):
            r = bare.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, **extra})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and '"auto" tool choice requires --enable-auto-tool-choice' in (
                error["message"]), error
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
        named = _ok(bare, {**body, "tool_choice": NAMED})["choices"][0]
        _check_weather(json.loads(named["message"]["tool_calls"][0]["function"]["arguments"]))
        required = _ok(bare, {**body, "tool_choice": "required"})["choices"][0]
        assert required["finish_reason"] == "tool_calls" and required["message"]["tool_calls"]
        plain = _ok(bare, {**body, "tool_choice": "none", "max_tokens": 4})["choices"][0]
        assert "tool_calls" not in plain["message"] and isinstance(plain["message"]["content"], str)
