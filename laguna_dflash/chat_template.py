"""Chat messages to a prompt through a tokenizer's chat template: the one renderer behind
``LLM.chat`` and the server's ``/v1/chat/completions`` and ``/tokenize`` (server/chat.py), which
add only their own checks and error types around it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RESERVED_TEMPLATE_KWARGS", "ChatTemplateError", "message_dict", "read_chat_template",
           "render_messages", "tool_calls_for_template"]

#: ``apply_chat_template`` arguments the renderer owns: not settable by ``chat_template_kwargs``.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "return_dict",
                                      "return_tensors", "return_assistant_tokens_mask"})


class ChatTemplateError(ValueError):
    """A chat that cannot be rendered; ``field`` names the input at fault (``messages``,
    ``chat_template_kwargs`` or ``chat_template``), for callers that report it (the server's 400s)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def read_chat_template(value: str | None, name: str = "--chat-template") -> str | None:
    """A chat template given by a user (``name`` is the flag or argument, for the error): a
    file's text, or the value itself when it is a Jinja template (holds ``{{`` or ``{%``), as
    vLLM takes both; a clear error for a path that does not exist."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a template file's path or the template text (a str), "
                         f"got {type(value).__name__}")
    try:  # a long inline template is no path: the OS refuses the name (ENAMETOOLONG)
        is_file = Path(value).expanduser().is_file()
    except (OSError, ValueError):
        is_file = False
    if is_file:
        return Path(value).expanduser().read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{name} {value!r}: no such file, and not a Jinja template either "
                     "(pass a template file, or the template text itself)")


def message_dict(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as templates expect it: a ``content`` list of OpenAI text parts is joined
    with newlines, a missing or None ``content`` is ``""``, an assistant's ``tool_calls`` carry
    their ``arguments`` as dicts (:func:`tool_calls_for_template`); anything else is a
    ``ValueError`` (non-text parts: no image or audio input here)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f'a chat message is a dict with a "role" (str) and a "content", '
                                f"got {message!r:.80}", "messages")
    data = dict(message)
    content = data.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"content part type {kind!r} is not supported: only text "
                                        'content parts are; send {"type": "text", "text": "..."} '
                                        "parts or a string", "messages")
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    elif content is None:
        data["content"] = ""
    elif not isinstance(content, str):
        raise ChatTemplateError(f"a chat message's content must be a string or a list of text "
                                f"parts, got {type(content).__name__}", "messages")
    if data["role"] == "assistant" and isinstance(data.get("tool_calls"), list):
        data["tool_calls"] = tool_calls_for_template(data["tool_calls"])
    return data


def tool_calls_for_template(calls: list[Any]) -> list[Any]:
    """An assistant message's OpenAI ``tool_calls`` with each ``function.arguments`` JSON string
    parsed into a dict (an empty or missing one is ``{}``), as vLLM hands them to chat templates
    (which write ``arguments`` as an object); a :class:`ChatTemplateError` for arguments that are
    not JSON. Entries of another shape are left to the template."""
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and not isinstance(function.get("arguments"), dict):
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError as e:
                    raise ChatTemplateError(f"a tool call's function.arguments is not valid JSON "
                                            f"({e}): send the arguments as a JSON object's text, "
                                            f"got {arguments!r:.80}", "messages") from None
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


def render_messages(tokenizer, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text ``tokenizer``'s chat template (or ``chat_template``, the template text)
    makes of ``messages`` (:func:`message_dict` each), as vLLM renders it:
    ``add_generation_prompt`` unless ``continue_final_message`` (the last message is then left
    open for the reply to continue), ``tools`` passed to the template, and
    ``chat_template_kwargs`` over all of these (its own ``tools`` win). A
    :class:`ChatTemplateError` when ``chat_template_kwargs`` sets a
    :data:`RESERVED_TEMPLATE_KWARGS` key, no template exists, or the template fails on these
    messages."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}: the "
                                "renderer sets them itself", "chat_template_kwargs")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model's tokenizer has no chat template", "chat_template")
    kwargs = {"add_generation_prompt": add_generation_prompt and not continue_final_message,
              "continue_final_message": continue_final_message, **kwargs}
    if chat_template:
        kwargs["chat_template"] = chat_template
    if tools:
        kwargs.setdefault("tools", tools)
    dicts = [message_dict(m) for m in messages]
    try:
        return tokenizer.apply_chat_template(dicts, tokenize=False, **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
        raise ChatTemplateError(f"the chat template failed on these messages: {e}", "messages") from e
