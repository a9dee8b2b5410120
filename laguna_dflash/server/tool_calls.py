"""OpenAI tool calling on ``/v1/chat/completions``, as vLLM serves it.

A request's ``tools`` and ``tool_choice`` resolve to a :class:`ToolPlan` (:func:`plan_tools`):

- ``"none"`` (or no tools): the tools reach the chat template, the reply is plain text;
- a named tool, ``{"type": "function", "function": {"name": NAME}}``: the output is constrained
  to the tool's ``parameters`` JSON schema (any JSON object where it has none) and returned as
  one tool call whose ``arguments`` are the generated text;
- ``"required"``: the output is constrained to a JSON array (at least one item; at most one with
  ``parallel_tool_calls: false``) of ``{"name": <a tool's name>, "parameters": <its schema>}``,
  each item one tool call;
- ``"auto"`` (the default when tools are sent): only on a server started with
  ``--enable-auto-tool-choice --tool-call-parser hermes``; the model writes what it likes, and
  Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the
  text become tool calls (:class:`HermesToolParser`).

:class:`ToolStreamer` turns one choice's streamed text into chat deltas; :func:`final_message`
makes the non-streamed message. Tool call ids are vLLM's: ``chatcmpl-tool-<32 hex>``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from ..structured_outputs import StructuredOutputsParams
from .errors import bad_request
from .protocol import ChatCompletionRequest

#: ``--tool-call-parser`` names this server has
TOOL_CALL_PARSERS = ("hermes",)
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_NAMED_USAGE = 'send {"type": "function", "function": {"name": "my_function"}}'
_TOOL_USAGE = 'each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}'


def check_tool_call_parser(enable_auto_tool_choice: bool, parser: str | None) -> None:
    """The start-up check of vLLM's flags: a ValueError for an unknown ``--tool-call-parser``
    or ``--enable-auto-tool-choice`` without one."""
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {parser!r} is not supported; this server has "
                         f"{', '.join(TOOL_CALL_PARSERS)} (the Hermes / Qwen <tool_call> format)")
    if enable_auto_tool_choice and parser is None:
        raise ValueError("--enable-auto-tool-choice needs a parser: add --tool-call-parser hermes")


def tool_call_id() -> str:
    """A new tool call id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One ``message.tool_calls`` entry (a new id)."""
    return {"id": tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


# ---- the request: tools and tool_choice -> a plan ----------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: ``mode`` is ``none``, ``named``, ``required`` or
    ``auto``; ``name`` the named tool; ``constraint`` the output constraint (named, required);
    ``max_calls`` 1 with ``parallel_tool_calls: false``, else None (no limit); ``path`` where
    the constraint's schema is in the request (for errors naming ``tools``)."""

    mode: Literal["none", "named", "required", "auto"] = "none"
    name: str | None = None
    constraint: StructuredOutputsParams | None = None
    max_calls: int | None = None
    path: str | None = None


def plan_tools(req: ChatCompletionRequest, auto_enabled: bool) -> ToolPlan:
    """The request's :class:`ToolPlan`; 400 naming ``tools`` or ``tool_choice`` for a malformed
    tool, an unknown or malformed ``tool_choice``, a named tool not in ``tools``, or ``auto``
    on a server without ``--enable-auto-tool-choice`` (``auto_enabled``)."""
    tools = check_tools(req.tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    limit = 1 if req.parallel_tool_calls is False else None
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan()  # "auto" with nothing to call: a plain reply
    if choice == "auto":
        _check_auto(auto_enabled, "tool_choice" if req.tool_choice is not None else "tools")
        return ToolPlan("auto", max_calls=limit)
    if tools is None:
        raise bad_request(f"tool_choice {choice!r:.80} needs tools: send the functions in tools, "
                          'or leave tool_choice out (or "none")', "tool_choice")
    if choice == "required":
        if not tools:  # OpenAI's and vLLM's: nothing to require
            return ToolPlan()
        return ToolPlan("required", constraint=StructuredOutputsParams(json=required_schema(tools, limit)),
                        path="tools[].function.parameters")
    name = _named_choice(choice)
    for i, (tool_name, parameters) in enumerate(tools):
        if tool_name == name:
            return ToolPlan("named", name, _parameters_constraint(parameters),
                            path=f"tools[{i}].function.parameters")
    raise bad_request(f"tool_choice names the function {name!r:.80}, which is not in tools "
                      f"({', '.join(n for n, _ in tools) or 'none sent'}); name one of them",
                      "tool_choice")


def _check_auto(auto_enabled: bool, param: str) -> None:
    if not auto_enabled:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          "--tool-call-parser to be set: start the server with "
                          '--enable-auto-tool-choice --tool-call-parser hermes, or send tool_choice '
                          '"none", "required" or a named function', param)


def _named_choice(choice: Any) -> str:
    """The function name of a named ``tool_choice``; 400 for anything else."""
    if not isinstance(choice, dict):
        raise bad_request(f'tool_choice must be "none", "auto", "required" or a named function '
                          f"({_NAMED_USAGE}), got {choice!r:.80}", "tool_choice")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise bad_request(f"tool_choice names no function: {_NAMED_USAGE}, got {choice!r:.80}",
                          "tool_choice")
    return name


def check_tools(tools: list[Any] | None) -> list[tuple[str, dict | None]] | None:
    """``tools`` as ``(name, parameters)`` pairs (None when not sent); 400 naming ``tools`` for
    an entry that is not ``{"type": "function", "function": {"name": str, "parameters":
    object}}``."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] is not a function tool: {_TOOL_USAGE}", "tools")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name is missing or not a non-empty string: "
                              f"{_TOOL_USAGE}", "tools")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object), "
                              f"got {parameters!r:.80}", "tools")
        out.append((name, parameters))
    return out


def _parameters_constraint(parameters: dict | None) -> StructuredOutputsParams:
    """A named tool's constraint: its schema, or any JSON object where it has none."""
    if not parameters:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=parameters)


def required_schema(tools: list[tuple[str, dict | None]], max_items: int | None = None) -> dict:
    """vLLM's schema of ``tool_choice: "required"``: an array of at least one (at most
    ``max_items``) ``{"name", "parameters"}`` objects, any of the tools; a tool without
    parameters takes ``{}``. The tools' ``$defs`` are gathered at the top (400 for two tools
    defining one name differently)."""
    defs: dict[str, Any] = {}
    items = []
    for name, parameters in tools:
        parameters = dict(parameters or {"type": "object", "properties": {}})
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise bad_request(f"tools define $defs.{key} differently; give each definition "
                                  "its own name", "tools")
        items.append({"properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": items}}
    if max_items is not None:
        schema["maxItems"] = max_items
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str) -> list[tuple[str, str]] | None:
    """The ``(name, arguments JSON)`` calls of a ``"required"`` output, or None for text that
    is not the array (an output cut short by ``max_tokens``)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return None
    return [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in items]


# ---- the hermes parser -------------------------------------------------------------------------


def parse_block(body: str) -> tuple[str, str] | None:
    """A ``<tool_call>`` block's ``(name, arguments JSON)``: its body must be a JSON object with
    a non-empty string ``name`` and an object ``arguments`` (missing: ``{}``); None otherwise."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def partial_prefix(text: str, marker: str = TOOL_CALL_START) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with (not all of it):
    the characters that may be the start of a marker still arriving."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser:
    """Hermes / Qwen tool calls in text that arrives in pieces: :meth:`feed` returns the content
    that may be sent now and the calls completed now.

    Text before the first ``<tool_call>`` is content, sent as it comes but for a tail that may
    be the start of the marker. A block closed by ``</tool_call>`` (or left open at the end) is
    a call if its body parses (:func:`parse_block`), else it stays in the content as written.
    Text after the first block is held until the next block or the end, and is content unless
    it is only whitespace."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_block = False
        self._seen_block = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[tuple[str, str]]]:
        """``text`` taken in (``final``: the output ended) -> (content, calls) to send."""
        self._buffer += text
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        while self._step(content, calls):
            pass
        if final:
            self._flush(content, calls)
        elif not self._seen_block:
            keep = len(self._buffer) - partial_prefix(self._buffer)
            content.append(self._buffer[:keep])
            self._buffer = self._buffer[keep:]
        return "".join(content), calls

    def _step(self, content: list[str], calls: list[tuple[str, str]]) -> bool:
        """Take one marker out of the buffer; False when none is complete."""
        marker = TOOL_CALL_END if self._in_block else TOOL_CALL_START
        at = self._buffer.find(marker)
        if at < 0:
            return False
        before, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
        if self._in_block:
            self._close(before, content, calls, TOOL_CALL_END)
        else:
            self._text(before, content)
            self._in_block = self._seen_block = True
        return True

    def _close(self, body: str, content: list[str], calls: list[tuple[str, str]], end: str) -> None:
        call = parse_block(body)
        if call is None:
            content.append(TOOL_CALL_START + body + end)
        else:
            calls.append(call)
        self._in_block = False

    def _text(self, text: str, content: list[str]) -> None:
        if not self._seen_block or text.strip():
            content.append(text)

    def _flush(self, content: list[str], calls: list[tuple[str, str]]) -> None:
        rest, self._buffer = self._buffer, ""
        if self._in_block:
            self._close(rest, content, calls, "")
        else:
            self._text(rest, content)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole output -> (content, calls). Without calls the content is the text as written
    (vLLM's); with calls it is what is left outside them (:class:`HermesToolParser`),
    stripped, None when empty."""
    content, calls = HermesToolParser().feed(text, final=True)
    if not calls:
        return text, []
    return content.strip() or None, calls


# ---- responses ---------------------------------------------------------------------------------


def final_message(plan: ToolPlan, text: str, finish: str | None) -> tuple[dict, str | None]:
    """The non-streamed assistant message of ``text`` and its finish_reason (``finish``: the
    engine's), as vLLM: a named tool's call with ``content: ""`` and the engine's reason;
    ``required``'s calls with ``content: ""`` and ``tool_calls`` where the output stopped
    (not cut short); ``auto``'s parsed calls and ``tool_calls`` when there is one."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.mode == "named":
        message.update(content="", tool_calls=[tool_call(plan.name or "", text)])
    elif plan.mode == "required":
        calls = parse_required(text)
        if calls is not None:
            message.update(content="", tool_calls=[tool_call(n, a) for n, a in calls])
            finish = "tool_calls" if finish == "stop" else finish
    elif plan.mode == "auto":
        content, calls = parse_hermes(text)
        calls = calls[:plan.max_calls]
        if calls:
            message.update(content=content, tool_calls=[tool_call(n, a) for n, a in calls])
            finish = "tool_calls"
    return message, finish


class ToolStreamer:
    """One choice's streamed deltas under a :class:`ToolPlan`.

    - none: the text as ``content`` as it comes;
    - named: :meth:`header` (the call's id, type, name and ``arguments: ""``) first, then each
      piece of text as ``arguments``;
    - required: nothing until the output ends, then every call in one delta (the text, when
      it is not the array);
    - auto: :class:`HermesToolParser`: content as it comes up to a ``<tool_call>``, then each
      complete block as one delta holding the call's full arguments.

    :meth:`finish_reason` is :func:`final_message`'s."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._held: list[str] = []  # required: the whole output
        self._parser = HermesToolParser() if plan.mode == "auto" else None
        self._num_calls = 0

    def header(self) -> dict | None:
        """A named tool's first delta (None for the other modes)."""
        if self.plan.mode != "named":
            return None
        call = tool_call(self.plan.name or "", "")
        return {"tool_calls": [{"index": 0, **call}]}

    def feed(self, text: str, final: bool) -> dict:
        """The delta of new ``text`` (``final``: the output ended); ``{}`` for nothing to send."""
        mode = self.plan.mode
        if mode == "named":
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if mode == "required":
            return self._required(text, final)
        if self._parser is not None:
            return self._auto(*self._parser.feed(text, final))
        return {"content": text} if text else {}

    def _required(self, text: str, final: bool) -> dict:
        self._held.append(text)
        if not final:
            return {}
        whole = "".join(self._held)
        calls = parse_required(whole)
        if calls is None:
            return {"content": whole} if whole else {}
        return self._calls_delta({}, calls)

    def _auto(self, content: str, calls: list[tuple[str, str]]) -> dict:
        delta: dict[str, Any] = {"content": content} if content else {}
        if self.plan.max_calls is not None:
            calls = calls[:max(0, self.plan.max_calls - self._num_calls)]
        return self._calls_delta(delta, calls) if calls else delta

    def _calls_delta(self, delta: dict, calls: list[tuple[str, str]]) -> dict:
        start, self._num_calls = self._num_calls, self._num_calls + len(calls)
        delta["tool_calls"] = [{"index": start + i, **tool_call(n, a)} for i, (n, a) in enumerate(calls)]
        return delta

    def finish_reason(self, finish: str | None) -> str | None:
        """The chunk's finish_reason, given the engine's ``finish`` (None: not finished)."""
        if finish is None or not self._num_calls:
            return finish
        if self.plan.mode == "required":
            return "tool_calls" if finish == "stop" else finish
        return "tool_calls" if self.plan.mode == "auto" else finish
