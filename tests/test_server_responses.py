"""OpenAI's Responses API, ``POST /v1/responses`` (server/responses.py, responses_input.py), on
the chat path.

Without a server: a request's input items become the chat messages a chat request would send
(a function call and its output as an assistant's ``tool_calls`` and a tool message), and the
output items and stream events of a text are the same fed whole or piece by piece (hermes tool
calls included); an error mid-stream is one ``error`` event.

One speculative server (the tiny Laguna target with its tokenizer, a z-lab drafter, a
tool-aware chat template, auto tool choice on) and the target alone offline: a greedy response's
text is the chat completion's for the same messages and the target-only chat's; ``instructions``
are a system message first; a stream is well-formed (increasing sequence numbers, items opened,
filled and closed in order) and ends in the non-streamed response; ``max_output_tokens`` makes
the response incomplete; ``text.format`` constrains the output like ``response_format``;
function tools give ``function_call`` items; every unsupported field is a 400 naming it, after
which the server serves on; the ``openai`` SDK parses responses and streams.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest

from laguna_dflash import LLM, SamplingParams
from laguna_dflash.server.chat import ChatRun
from laguna_dflash.server.errors import APIError
from laguna_dflash.server.protocol import ResponsesRequest
from laguna_dflash.server.responses import OutputItems, _events
from laguna_dflash.server.responses_input import chat_request, input_messages
from laguna_dflash.server.tool_calls import ToolPlan

K = 3
MAX_MODEL_LEN = 256
NAME = "tiny"
#: writes system prompts, tools, assistant tool calls (arguments as objects) and tool results
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>"
    "{% elif m.role == 'tool' %}<|user|><tool_response {{ m.tool_call_id }}>{{ m.content }}"
    "</tool_response><|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
#: bounded schemas: the tiny model finishes them within the token budget
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "enum": [1, 2, 3]},
}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
NAMED = {"type": "function", "name": "get_weather"}
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "color": {"enum": ["red", "blue"]},
    "size": {"type": "integer", "enum": [1, 2, 3]},
}, "required": ["name", "color", "size"]}
#: a function call and its output, as Responses input items and as chat messages
HISTORY_ITEMS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris", "days": 1}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


# ---- no server -----------------------------------------------------------------------------------


def test_input_items_become_the_chat_messages():
    assert input_messages(ResponsesRequest(input=HISTORY_ITEMS)) == HISTORY
    assert input_messages(ResponsesRequest(input="hi", instructions="Be brief.")) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    items = [{"type": "message", "role": "developer", "content": "rules"},
             {"role": "user", "content": parts},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "let me see", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": "two"}]
    assert input_messages(ResponsesRequest(input=items)) == [
        {"role": "system", "content": "rules"},  # developer messages are system messages
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        # the assistant's text and its calls: one chat message, as chat sends them
        {"role": "assistant", "content": [{"type": "text", "text": "let me see"}], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    chat = chat_request(ResponsesRequest(
        input="hi", tools=TOOLS, tool_choice=NAMED, max_output_tokens=7, top_k=3, seed=1,
        text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}))
    assert chat.tools == CHAT_TOOLS and chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.max_completion_tokens, chat.top_k, chat.seed) == (7, 3, 1)
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                           "strict": None}}


def _strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def _run_items(plan: ToolPlan, pieces: list[str], finish: str) -> tuple[list[dict], list[dict]]:
    out = OutputItems(plan)
    events = out.start()
    for i, piece in enumerate(pieces):
        events += out.feed(piece, i == len(pieces) - 1)
    return out.items, events + out.finish(finish)


def test_output_items_are_the_same_fed_whole_or_in_pieces():
    block = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    cases = [(ToolPlan(), "plain text", "stop"), (ToolPlan(), "cut sho", "length"),
             (ToolPlan(), "", "stop"),
             (ToolPlan("auto"), "Checking.\n" + block + "\n" + block.replace("UTC", "CET") + "\nDone.", "stop"),
             (ToolPlan("named", "get_time"), '{"zone": "UTC"}', "stop"),
             (ToolPlan("required"), '[{"name": "get_time", "parameters": {"zone": "UTC"}}]', "stop")]
    for plan, text, finish in cases:
        whole, _ = _run_items(plan, [text], finish)
        pieces, events = _run_items(plan, list(text) or [""], finish)
        assert _strip_ids(whole) == _strip_ids(pieces), (plan, text)
        assert _streamed_items(events) == pieces
    items, _ = _run_items(ToolPlan("auto"), [cases[3][1]], "stop")
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in items] == [
        ("message", None, None), ("function_call", "get_time", '{"zone": "UTC"}'),
        ("function_call", "get_time", '{"zone": "CET"}'), ("message", None, None)]
    assert items[0]["content"][0]["text"] == "Checking.\n" and items[3]["content"][0]["text"] == "\nDone."
    assert {i["status"] for i in items} == {"completed"}
    cut, _ = _run_items(ToolPlan(), ["cut sho"], "length")
    assert cut[0]["status"] == "incomplete" and cut[0]["content"][0]["text"] == "cut sho"
    empty, _ = _run_items(ToolPlan(), [""], "stop")  # no text: one empty message
    assert empty[0]["content"] == [{"type": "output_text", "text": "", "annotations": []}]


def test_an_error_mid_stream_is_one_error_event():
    """As chat streaming: the error ends the stream, as OpenAI's ``error`` event (with chat's
    ``error`` object, which the SDK raises)."""

    async def merged(jobs):
        yield 0, SimpleNamespace(text="partial", finish_reason=None)
        raise APIError(500, "the engine failed")

    job = SimpleNamespace(request_id="resp_x", created=1, params=SamplingParams(temperature=0))
    serving = SimpleNamespace(model_name=NAME, merged=merged, spec_metrics=lambda jobs: None)
    run = ChatRun([job], ToolPlan(), None, None)

    async def collect():
        return [chunk async for chunk in _events(serving, ResponsesRequest(input="x"), run)]

    events = _parse_sse("".join(asyncio.run(collect())))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    error = events[-1]
    assert (error["code"], error["message"], error["param"]) == ("500", "the engine failed", None)
    assert error["error"]["message"] == "the engine failed" and error["error"]["code"] == 500


# ---- stream parsing ------------------------------------------------------------------------------


def _parse_sse(text: str) -> list[dict]:
    """Each SSE event's data; every event is ``event: <type>`` then ``data: <json>`` of that type."""
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == kind[len("event: "):], block
        events.append(event)
    return events


def _streamed_items(events: list[dict]) -> list[dict]:
    """The output items the item events build, checking that each is opened, filled and closed
    in order: a message's one text part, a call's arguments, the deltas adding up to the done
    events' text and the done item."""
    items: list[dict] = []
    current = None
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert current is None and e["output_index"] == len(items), e
            current = copy.deepcopy(e["item"])
            assert current["status"] == "in_progress", e
            assert current.get("content", []) == [] and current.get("arguments", "") == "", e
            items.append(current)
            continue
        assert current is not None and e["output_index"] == len(items) - 1, e
        if kind != "response.output_item.done":
            assert e["item_id"] == current["id"], e
        if kind == "response.content_part.added":
            assert current["type"] == "message" and current["content"] == [] and e["content_index"] == 0
            assert e["part"] == {"type": "output_text", "text": "", "annotations": []}, e
            current["content"].append(copy.deepcopy(e["part"]))
        elif kind == "response.output_text.delta":
            assert e["content_index"] == 0 and e["delta"], e
            current["content"][0]["text"] += e["delta"]
        elif kind == "response.output_text.done":
            assert e["text"] == current["content"][0]["text"], e
        elif kind == "response.content_part.done":
            assert e["part"] == current["content"][0], e
        elif kind == "response.function_call_arguments.delta":
            assert current["type"] == "function_call" and e["delta"], e
            current["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == current["arguments"] and e["name"] == current["name"], e
        elif kind == "response.output_item.done":
            assert e["item"]["status"] in ("completed", "incomplete"), e
            current["status"] = e["item"]["status"]
            assert e["item"] == current, (e, current)
            current = None
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert current is None, "an item was left open"
    return items


def _check_stream(events: list[dict]) -> dict:
    """A whole stream well-formed -> its final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    for e in events[:2]:
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == [], e
        assert e["response"]["usage"] is None
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete"), final
    response = final["response"]
    assert final["type"] == f"response.{response['status']}"
    assert response["id"] == events[0]["response"]["id"]
    assert _streamed_items(events[2:-1]) == response["output"]
    return response


def _normalized(body: dict) -> dict:
    """A response without what differs between two runs of one request: ids, the time, the
    prefix-cache hits and the speculation counters."""
    body = copy.deepcopy(body)
    for key in ("id", "created_at", "metrics"):
        body.pop(key, None)
    body["usage"]["input_tokens_details"].pop("cached_tokens")
    body["output"] = _strip_ids(body["output"])
    return body


# ---- one live server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import dflash_fixtures as df

    return df.make_served_pair(tmp_path_factory.mktemp("responses"), K + 1, distill_steps=200)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses_template") / "template.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def http(pair, template):
    import dflash_fixtures as df

    target, draft = pair
    with df.tiny_http_server(target, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "160",
                             "--draft", str(draft), "--num-speculative-tokens", str(K),
                             "--chat-template", str(template), "--served-model-name", NAME,
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as client:
        yield client


@pytest.fixture(scope="module")
def offline(pair, template):
    """The target alone (no drafter), offline, with the server's chat template: a function of
    (messages, max_tokens, SamplingParams fields, LLM.chat arguments) -> the greedy chat's
    token ids, the reference outputs."""
    llm = LLM(str(pair[0]), block_size=8, max_model_len=MAX_MODEL_LEN)

    def target_only(messages: list[dict], max_tokens: int, params: dict | None = None, **kw) -> list[int]:
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, **(params or {}))
        return llm.chat(messages, sampling, chat_template=str(template), **kw)[0].token_ids

    return target_only


def _respond(http: httpx.Client, body: dict) -> dict:
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http: httpx.Client, body: dict) -> list[dict]:
    r = http.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    return _parse_sse(r.text)


def _chat(http: httpx.Client, body: dict) -> dict:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _text(response: dict) -> str:
    """The text of a response's message items (the SDK's ``output_text``)."""
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


CONVERSATIONS = [
    ("Write a function.", [{"role": "user", "content": "Write a function."}]),
    ([{"role": "user", "content": [{"type": "input_text", "text": "import os"},
                                   {"type": "input_text", "text": "def main():"}]}],
     [{"role": "user", "content": [{"type": "text", "text": "import os"},
                                   {"type": "text", "text": "def main():"}]}]),
    ([{"type": "message", "role": "user", "content": "hi"},
      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
      {"type": "message", "role": "user", "content": "the quick brown fox"}],
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
      {"role": "user", "content": "the quick brown fox"}]),
]


def test_greedy_output_equals_chat_and_target_only(http, offline):
    """Each input: the response's text and token count are the chat completion's for the same
    messages, whose tokens are the target-only chat's; the response object has OpenAI's shape."""
    for given, messages in CONVERSATIONS:
        out = _respond(http, {"model": NAME, "input": given, "max_output_tokens": 24, "temperature": 0,
                              "metadata": {"run": "a"}, "user": "u1"})
        chat = _chat(http, {"messages": messages, "max_completion_tokens": 24, "temperature": 0,
                            "return_token_ids": True})
        choice = chat["choices"][0]
        assert choice["token_ids"] == offline(messages, 24)
        assert _text(out) == choice["message"]["content"]
        assert out["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] == len(choice["token_ids"])
        assert out["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        assert out["status"] == ("incomplete" if choice["finish_reason"] == "length" else "completed")
        assert re.fullmatch("resp_[0-9a-f]{32}", out["id"]) and out["object"] == "response"
        assert out["model"] == NAME and out["error"] is None and "output_text" not in out
        item, = out["output"]
        assert re.fullmatch("msg_[0-9a-f]{32}", item["id"]) and item["role"] == "assistant"
        assert item["type"] == "message" and item["content"][0]["annotations"] == []
        assert item["status"] == out["status"]
        usage = out["usage"]
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
        assert usage["input_tokens_details"]["cached_tokens"] >= 0
        echoed = {k: out[k] for k in ("instructions", "max_output_tokens", "temperature", "top_p", "tools",
                                      "tool_choice", "parallel_tool_calls", "text", "metadata", "user",
                                      "previous_response_id")}
        assert echoed == {"instructions": None, "max_output_tokens": 24, "temperature": 0.0, "top_p": 1.0,
                          "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
                          "text": {"format": {"type": "text"}}, "metadata": {"run": "a"}, "user": "u1",
                          "previous_response_id": None}
        assert out["metrics"]["speculative_decoding"]["num_spec_steps"] > 0


def test_instructions_are_a_system_message_first(http, offline):
    base = {"input": "Write a function.", "max_output_tokens": 16, "temperature": 0}
    plain = _respond(http, base)
    out = _respond(http, {**base, "instructions": "You write Python."})
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Write a function."}]
    chat = _chat(http, {"messages": messages, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
    assert _text(out) == chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["token_ids"] == offline(messages, 16)
    assert out["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] > plain["usage"]["input_tokens"]
    assert out["instructions"] == "You write Python."
    # a developer message is the same system message
    dev = _respond(http, {**base, "input": [{"role": "developer", "content": "You write Python."},
                                            {"role": "user", "content": "Write a function."}]})
    assert _normalized(dev) | {"instructions": "You write Python."} == _normalized(out)


def test_a_stream_is_well_formed_and_ends_in_the_response(http):
    for body in ({"input": "the quick brown fox", "max_output_tokens": 30, "temperature": 0},
                 {"input": "def f(x):", "max_output_tokens": 30, "temperature": 0, "instructions": "Code."}):
        whole = _respond(http, body)
        events = _stream(http, body)
        final = _check_stream(events)
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert len(deltas) > 1 and "".join(deltas) == _text(whole) == _text(final)
        assert _normalized(final) == _normalized(whole)
        assert events[0]["response"]["created_at"] == final["created_at"]


def test_max_output_tokens_makes_the_response_incomplete(http):
    body = {"input": "the quick brown fox", "max_output_tokens": 5, "temperature": 0, "ignore_eos": True}
    out = _respond(http, body)
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["usage"]["output_tokens"] == 5 and out["output"][0]["status"] == "incomplete"
    events = _stream(http, body)
    assert events[-1]["type"] == "response.incomplete"
    assert _normalized(_check_stream(events)) == _normalized(out)
    # a complete output (the JSON closes and the model stops) is "completed", no details
    done = _respond(http, {**body, "max_output_tokens": 100, "ignore_eos": False,
                           "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}})
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["output"][0]["status"] == "completed"


def test_text_format_constrains_the_output_like_response_format(http, offline):
    messages = [{"role": "user", "content": "Describe a widget as JSON."}]
    fmt = {"type": "json_schema", "name": "widget", "schema": SCHEMA, "strict": True}
    body = {"input": messages, "max_output_tokens": 100, "temperature": 0, "text": {"format": fmt}}
    out = _respond(http, body)
    value = json.loads(_text(out))
    assert set(value) == set(SCHEMA["required"]) and value["color"] in ("red", "blue"), value
    assert value["size"] in (1, 2, 3) and isinstance(value["name"], str) and len(value["name"]) <= 8
    assert out["text"] == {"format": fmt} and out["status"] == "completed"
    chat = _chat(http, {"messages": messages, "max_tokens": 100, "temperature": 0, "return_token_ids": True,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "widget", "schema": SCHEMA}}})
    assert _text(out) == chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["token_ids"] == offline(messages, 100,
                                                           params={"structured_outputs": {"json": SCHEMA}})
    assert _normalized(_check_stream(_stream(http, body))) == _normalized(out)
    anything = _respond(http, {**body, "text": {"format": {"type": "json_object"}}})
    assert isinstance(json.loads(_text(anything)), dict)
    assert _text(_respond(http, {**body, "text": {"format": {"type": "text"}}})) == _text(
        _respond(http, {**body, "text": None}))


def _check_weather(arguments: dict) -> None:
    assert set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Rome"), arguments
    assert arguments["days"] in (1, 2, 3), arguments


def _check_time(arguments: dict) -> None:
    assert set(arguments) == {"zone"} and isinstance(arguments["zone"], str) and len(arguments["zone"]) <= 6


CHECKS = {"get_weather": _check_weather, "get_time": _check_time}


def _calls(response: dict) -> list[dict]:
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    for call in calls:
        assert re.fullmatch("fc_[0-9a-f]{32}", call["id"]) and re.fullmatch("call_[0-9a-f]{32}", call["call_id"])
        assert call["status"] == "completed", call
        CHECKS[call["name"]](json.loads(call["arguments"]))
    return calls


def test_a_named_function_gives_its_call(http):
    body = {"input": "What is the weather?", "tools": TOOLS, "tool_choice": NAMED, "max_output_tokens": 100,
            "temperature": 0}
    out = _respond(http, body)
    call, = _calls(out)
    assert out["output"] == [call] and call["name"] == "get_weather"
    assert out["tools"] == TOOLS and out["tool_choice"] == NAMED
    chat = _chat(http, {"messages": [{"role": "user", "content": "What is the weather?"}], "tools": CHAT_TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                        "max_tokens": 100, "temperature": 0})
    assert call["arguments"] == chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    events = _stream(http, body)
    assert _normalized(_check_stream(events)) == _normalized(out)
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # the arguments arrive as they are generated
    sampled = _respond(http, {**body, "temperature": 1.0, "seed": 3})
    assert [c["name"] for c in _calls(sampled)] == ["get_weather"]


def test_required_gives_calls_of_the_tools(http):
    body = {"input": "What is the weather?", "tools": TOOLS, "tool_choice": "required",
            "max_output_tokens": 200, "temperature": 0}
    out = _respond(http, body)
    calls = _calls(out)
    assert calls and out["output"] == calls and out["status"] == "completed"
    assert _normalized(_check_stream(_stream(http, body))) == _normalized(out)
    for seed in range(3):
        one = _respond(http, {**body, "parallel_tool_calls": False, "temperature": 1.0, "seed": seed})
        assert len(_calls(one)) == 1 and one["parallel_tool_calls"] is False


def test_a_function_call_and_its_output_render_like_chat(http, offline):
    body = {"input": HISTORY_ITEMS, "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 12,
            "temperature": 0}
    out = _respond(http, body)
    chat = _chat(http, {"messages": HISTORY, "tools": CHAT_TOOLS, "tool_choice": "none", "max_tokens": 12,
                        "temperature": 0, "return_token_ids": True})
    ids = http.post("/tokenize", json={"messages": HISTORY, "tools": CHAT_TOOLS}).json()["tokens"]
    prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '"arguments": {"city": "Paris", "days": 1}' in prompt and "<tool_response call_1>sunny" in prompt
    assert out["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] == len(ids)
    assert _text(out) == chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["token_ids"] == offline(HISTORY, 12, tools=CHAT_TOOLS)
    # the next turn's call, from the same history
    named = _respond(http, {**body, "tool_choice": NAMED, "max_output_tokens": 100})
    assert [c["name"] for c in _calls(named)] == ["get_weather"]


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the earlier turns in input"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "leave reasoning out"),
    ({"include": ["message.output_text.logprobs"]}, "include", "leave include out"),
    ({"background": True}, "background", "leave background out"),
    ({"truncation": "auto"}, "truncation", '"disabled"'),
    ({"top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
    ({"max_tool_calls": 2}, "max_tool_calls", "leave max_tool_calls out"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt templates"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "chat completions' shape"),
    ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]}, "tools", "must be a JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "built-in"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "foo"}}],
      "tool_choice": {"type": "function", "name": "f"}}, "tools", "tools[0].parameters: Unsupported type"),
    ({"tools": TOOLS, "tool_choice": NAMED, "text": {"format": {"type": "json_object"}}}, "text.format",
     "leave text.format out"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "text, json_object, json_schema"),
    ({"text": {"format": {"type": "json_schema", "name": "w"}}}, "text.format", "needs its schema"),
    ({"text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "foo"}}}}, "text.format",
     "text.format.schema: Unsupported type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "leave it out"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input_image' is not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning' are not supported"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input",
     "not valid JSON"),
    ({"input": []}, "input", "input is empty"),
    ({"input": "word " * 400}, "input", "maximum context length"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"max_output_tokens": 10_000}, "max_output_tokens", "reduce the length of the prompt or max_output_tokens"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"top_k": "many"}, "top_k", "integer"),
    ({"metadata": {"a": 1}}, "metadata.a", "string"),
    ({"max_tokens": 5}, "max_tokens", "send max_output_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format", "send text.format"),
    ({"guided_regex": "a+"}, "guided_regex", "/v1/chat/completions"),
    ({"n": 2}, "n", "one output"),
    ({"logprobs": True}, "logprobs", "no logprobs"),
]


@pytest.mark.parametrize("extra, param, needle", BAD, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD)])
def test_unsupported_and_bad_fields_are_a_400_naming_them(http, extra, param, needle):
    body = {"input": "hi", "max_output_tokens": 8} | extra
    for stream in (False, True):  # checked before a stream starts
        r = http.post("/v1/responses", json={**body, "stream": stream})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and needle in error["message"], error
    ok = _respond(http, {"input": "hi", "max_output_tokens": 4, "temperature": 0})
    assert ok["status"] in ("completed", "incomplete") and ok["output"][0]["type"] == "message"


def test_fields_that_are_off_and_unknown_fields_are_taken(http):
    base = {"input": "hi", "max_output_tokens": 6, "temperature": 0}
    plain = _respond(http, base)
    off = _respond(http, {**base, "store": True, "reasoning": {"effort": None}, "include": [],
                          "background": False, "truncation": "disabled", "top_logprobs": 0, "n": 1,
                          "service_tier": "auto", "prompt_cache_key": "k", "some_future_field": {"x": 1}})
    assert _normalized(off) == _normalized(plain)
    r = http.post("/v1/responses", json={**base, "model": "missing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_the_openai_sdk_parses_responses_and_streams(http):
    client = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    kw = {"model": NAME, "input": "the quick brown fox", "max_output_tokens": 20, "temperature": 0,
          "instructions": "Be brief."}
    raw = _respond(http, kw)
    assert raw["status"] == "completed"  # the SDK's stream helper wants response.completed
    response = client.responses.create(**kw)
    assert response.output_text == _text(raw) and response.status == raw["status"]
    assert response.usage.output_tokens == raw["usage"]["output_tokens"]
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert response.id.startswith("resp_") and response.output[0].content[0].type == "output_text"
    deltas, kinds, final = [], [], None
    for event in client.responses.create(**kw, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        final = event.response if event.type in ("response.completed", "response.incomplete") else final
    assert "".join(deltas) == final.output_text == response.output_text
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    # the SDK's stream helper rebuilds the response from the events (and checks their order)
    with client.responses.stream(**kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        rebuilt = stream.get_final_response()
    assert text == rebuilt.output_text == response.output_text
    tools = client.responses.create(model=NAME, input="What is the weather?", tools=TOOLS, tool_choice=NAMED,
                                    max_output_tokens=100, temperature=0)
    call, = tools.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    _check_weather(json.loads(call.arguments))
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=NAME, input="hi", reasoning={"effort": "high"})
    assert info.value.body["param"] == "reasoning"
    client.close()
