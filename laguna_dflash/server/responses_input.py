"""A ``/v1/responses`` request as the chat request it renders as (server/chat.py runs it).

``instructions`` become a system message first; ``input`` (a string: one user message, or a
list of items) becomes chat messages: message items (``developer`` is ``system``, text content
parts as chat text parts), ``function_call`` items an assistant message's ``tool_calls`` (calls
in a row, or right after the assistant's text, share one message), ``function_call_output``
items ``role: "tool"`` messages. Function tools and ``tool_choice`` take chat's shape,
``text.format`` becomes ``response_format``, ``max_output_tokens`` ``max_completion_tokens``;
vLLM's sampling extras (:data:`VLLM_EXTRAS`) pass through. What would change the output and is
not implemented is a 400 naming the field and saying what to send instead.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .chat import ChatFieldNames
from .errors import bad_request, from_validation_error
from .protocol import ChatCompletionRequest, ResponsesRequest

#: the Responses fields chat's errors are reported under (chat.start_chat)
RESPONSES_FIELDS = ChatFieldNames(messages="input", max_tokens="max_output_tokens",
                                  response_format="text.format",
                                  response_format_schema="text.format.schema",
                                  tool_parameters="parameters")

#: vLLM's extra sampling fields, taken as on chat completions
VLLM_EXTRAS = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
               "logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens",
               "include_stop_str_in_output", "cache_salt", "request_id", "priority",
               "truncate_prompt_tokens", "chat_template", "chat_template_kwargs")

_NOT_STORED = ("this server stores no responses or conversations; send the earlier turns in "
               "input (a response's output items are input items as they are)")
#: Responses fields that change the output and are not implemented -> how to do without
UNSUPPORTED = {
    "previous_response_id": _NOT_STORED,
    "conversation": _NOT_STORED,
    "reasoning": "this server has no reasoning effort or reasoning summaries; leave reasoning out",
    "include": "no extra output (logprobs, reasoning content, tool outputs) can be included; "
               "leave include out",
    "background": "background responses need a stored response to poll, and nothing is stored; "
                  "leave background out or false",
    "truncation": 'a prompt too long for the context is a 400, never cut; leave truncation out '
                  'or "disabled"',
    "top_logprobs": "/v1/responses returns no logprobs; leave top_logprobs out, or use "
                    "/v1/chat/completions with logprobs and top_logprobs",
    "max_tool_calls": "calls are not limited by count; leave max_tool_calls out (or send "
                      "parallel_tool_calls: false for one call)",
    "prompt": "stored prompt templates are not supported; send the text as instructions and input",
}
_OFF = {"truncation": "disabled", "top_logprobs": 0}
_USE_CHAT = "use /v1/chat/completions for it"
#: chat / completions fields that would change the output here -> what to send instead
OTHER_ROUTES = {
    "messages": "send the conversation as input",
    "max_tokens": "send max_output_tokens",
    "max_completion_tokens": "send max_output_tokens",
    "response_format": "send text.format",
    "guided_json": 'send text.format of type "json_schema"',
    "structured_outputs": f'send text.format of type "json_schema", or {_USE_CHAT}',
    "guided_regex": _USE_CHAT,
    "guided_choice": _USE_CHAT,
    "guided_grammar": _USE_CHAT,
    "n": "a response holds one output; send several requests, or use /v1/chat/completions with n",
    "logprobs": f"/v1/responses returns no logprobs; {_USE_CHAT}",
    "prompt_logprobs": f"/v1/responses returns no logprobs; {_USE_CHAT}",
    "use_beam_search": "beam search is not supported; leave use_beam_search out",
}
#: input message roles -> the chat role (OpenAI's developer messages are system messages)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_FUNCTION_TOOL = ('a function tool is {"type": "function", "name": ..., "description": ..., '
                  '"parameters": {...}}')
_NAMED_CHOICE = 'a named tool choice is {"type": "function", "name": "my_function"}'
TEXT_FORMATS = ("text", "json_object", "json_schema")


def _is_off(name: str, value: Any) -> bool:
    if value is None or value is False or value == [] or value == {}:
        return True
    if isinstance(value, dict):  # e.g. reasoning: {"effort": null}
        return all(v is None for v in value.values())
    return _OFF.get(name, None) == value or (name == "n" and value == 1)


def reject_unsupported(req: ResponsesRequest) -> None:
    """400 naming the field for a Responses field this server does not implement, or another
    route's field that would change the output, sent with a value that is not off."""
    for name, fix in UNSUPPORTED.items():
        if not _is_off(name, getattr(req, name)):
            raise bad_request(f"{name} is not supported on /v1/responses: {fix}", name)
    extras = req.model_extra or {}
    for name, fix in OTHER_ROUTES.items():
        if not _is_off(name, extras.get(name)):
            raise bad_request(f"{name} is not a /v1/responses field: {fix}", name)


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or its text parts as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of input_text parts, got "
                          f"{type(content).__name__}", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}] of type {kind!r:.40} is not supported: only "
                              'text parts are ({"type": "input_text", "text": "..."}); no image, '
                              "file or audio input here", "input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise bad_request(f"{where}.{key} must be a {'' if key == 'arguments' else 'non-empty '}"
                          f"string, got {value!r:.80}", "input")
    return value


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """One input item appended to ``messages`` as chat messages."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r:.40}",
                              "input")
        messages.append({"role": ROLES[role], "content": _content(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": _field(item, "call_id", where), "type": "function",
                "function": {"name": _field(item, "name", where),
                             "arguments": _field(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the same turn
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                         "content": _content(item.get("output"), f"{where}.output")})
    else:
        raise bad_request(f"{where}: input items of type {kind!r:.40} are not supported; send "
                          "messages, function_call and function_call_output items", "input")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    if not req.input:
        raise bad_request("input is empty; send a string or at least one input item", "input")
    for i, item in enumerate(req.input):
        _add_item(messages, item, f"input[{i}]")
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; 400 naming ``tools`` for built-in tools and malformed
    ones."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}] of type {kind!r:.40} is not supported: built-in tools "
                              f"(web search, file search, ...) are not; {_FUNCTION_TOOL}", "tools")
        name, parameters = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            shape = " (chat completions' shape)" if "function" in tool else ""
            raise bad_request(f"tools[{i}].name is missing or not a non-empty string{shape}: "
                              f"{_FUNCTION_TOOL}", "tools")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema (an object), got "
                              f"{parameters!r:.80}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in chat's shape; 400 for a value chat has no counterpart of."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    name = choice.get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise bad_request(f'tool_choice must be "none", "auto", "required" or a named function '
                          f"({_NAMED_CHOICE}; built-in and allowed_tools choices are not "
                          f"supported), got {choice!r:.80}", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text); 400 naming
    ``text.format`` (or ``text.verbosity``) for what is not supported."""
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request(f"text.verbosity {text['verbosity']!r:.40} is not supported (the output "
                          "is the model's); leave it out", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TEXT_FORMATS:
        raise bad_request(f"text.format.type must be one of {', '.join(TEXT_FORMATS)}, got "
                          f"{kind!r:.80}", "text.format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request('text.format of type json_schema needs its schema: {"type": '
                          '"json_schema", "name": ..., "schema": {...}}', "text.format")
    return {"type": "json_schema", "json_schema": {
        "name": fmt.get("name"), "schema": fmt["schema"], "strict": fmt.get("strict")}}


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``req`` renders as (after :func:`reject_unsupported`)."""
    reject_unsupported(req)
    extras = req.model_extra or {}
    fields: dict[str, Any] = {k: extras[k] for k in VLLM_EXTRAS if k in extras}
    fields.update(model=req.model, messages=input_messages(req),
                  max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
                  top_p=req.top_p, stream=req.stream, tools=chat_tools(req.tools),
                  tool_choice=chat_tool_choice(req.tool_choice),
                  parallel_tool_calls=req.parallel_tool_calls,
                  response_format=response_format(req.text), user=req.user)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # only the extras can be malformed here: chat's names are theirs
        raise from_validation_error(e) from e
