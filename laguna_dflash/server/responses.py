"""``POST /v1/responses``: OpenAI's Responses API, as vLLM serves it, on the chat path.

The request renders as a chat request (server/responses_input.py) and runs as one
(chat.start_chat: template, sampling fields, structured outputs, tool choice). Its output text
goes through the chat route's :class:`~.tool_calls.ToolStreamer` into output items
(:class:`OutputItems`): ``message`` items holding one ``output_text`` part, and ``function_call``
items. Streamed, every change is an SSE event (``event: <type>`` then ``data: <json>``, each with
a ``sequence_number``), ending in ``response.completed`` (or ``response.incomplete``: the output
hit ``max_output_tokens``) carrying the whole response; not streamed, the same items make the
response, so both give the same output. Nothing is stored (no ``previous_response_id``).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .chat import ChatRun, start_chat
from .errors import APIError
from .protocol import ResponsesRequest
from .responses_input import RESPONSES_FIELDS, chat_request
from .serving import Job, Serving, usage
from .tool_calls import ToolPlan, ToolStreamer


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


class OutputItems:
    """A response's output items built from its text as it arrives, and the stream events of
    each change (:meth:`start`, :meth:`feed`, :meth:`finish` return them; a non-streamed
    response drops them). Content opens a ``message`` item; each tool call a ``function_call``
    item; opening one closes the item before it."""

    def __init__(self, plan: ToolPlan) -> None:
        self.items: list[dict[str, Any]] = []
        self._streamer = ToolStreamer(plan)
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the streamer's call index -> its item

    def start(self) -> list[dict[str, Any]]:
        """The events before any text: a named tool choice's call item."""
        header = self._streamer.header()
        return self._delta(header) if header else []

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The events of new ``text`` (``final``: the output ended). Under ``auto`` the text is
        fed in pieces that end at a ``>`` (where a ``</tool_call>`` can end): a piece then
        completes at most one call, at its end, so text and calls keep their order in the
        items however the text arrives."""
        pieces = re.split(r"(?<=>)", text) if self._streamer.plan.mode == "auto" else [text]
        events = []
        for i, piece in enumerate(pieces):
            events += self._delta(self._streamer.feed(piece, final and i == len(pieces) - 1))
        return events

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        """Close the last item: ``incomplete`` when the output was cut at ``max_output_tokens``
        (``finish_reason`` "length"); an output with no item gets an empty message."""
        events = [] if self.items else self._text("")
        return events + self._close("incomplete" if finish_reason == "length" else "completed")

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.items.append(item)
        self._open = item
        return [*events, _event("response.output_item.added", output_index=len(self.items) - 1,
                                item=copy.deepcopy(item))]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        item = self._open
        if item is None or item["type"] != "message":
            item = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            events += self._add(item)
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append(self._part_event("response.content_part.added", item))
        if text:
            item["content"][0]["text"] += text
            events.append(self._text_event("response.output_text.delta", item, delta=text))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call.get("function") or {}
        events = []
        item = self._calls.get(call["index"])
        if item is None:
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": _new_id("call"), "name": function.get("name") or "", "arguments": ""}
            self._calls[call["index"]] = item
            events += self._add(item)
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(_event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, delta=function["arguments"]))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.items) - 1
        if item["type"] == "message":
            events = [self._text_event("response.output_text.done", item,
                                       text=item["content"][0]["text"]),
                      self._part_event("response.content_part.done", item)]
        else:
            events = [_event("response.function_call_arguments.done", item_id=item["id"],
                             output_index=index, name=item["name"], arguments=item["arguments"])]
        return [*events, _event("response.output_item.done", output_index=index,
                                item=copy.deepcopy(item))]

    def _part_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        return _event(kind, item_id=item["id"], output_index=len(self.items) - 1,
                      content_index=0, part=copy.deepcopy(item["content"][0]))

    def _text_event(self, kind: str, item: dict[str, Any], **fields: Any) -> dict[str, Any]:
        return _event(kind, item_id=item["id"], output_index=len(self.items) - 1,
                      content_index=0, **fields, logprobs=[])


def _usage(jobs: list[Job]) -> dict[str, Any]:
    u = usage(jobs)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _body(serving: Serving, req: ResponsesRequest, run: ChatRun, status: str,
          items: OutputItems | None = None) -> dict[str, Any]:
    """The response object; ``status`` ``in_progress`` (no output, no usage yet), ``completed``
    or ``incomplete`` (cut at ``max_output_tokens``). The request's fields are echoed, the
    sampling ones as used (with the model's generation defaults)."""
    job = run.jobs[0]
    text = dict(req.text or {})
    text["format"] = text.get("format") or {"type": "text"}
    body: dict[str, Any] = {
        "id": job.request_id, "object": "response", "created_at": job.created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "model": serving.model_name,
        "output": items.items if items is not None else [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "store": False, "temperature": job.params.temperature,
        "text": text, "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "top_p": job.params.top_p, "truncation": "disabled",
        "usage": _usage(run.jobs) if items is not None else None, "user": req.user,
    }
    metrics = serving.spec_metrics(run.jobs) if items is not None else None
    if metrics is not None:
        body["metrics"] = metrics
    return body


def _sse(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


async def _events(serving: Serving, req: ResponsesRequest, run: ChatRun) -> AsyncIterator[str]:
    """The stream: ``response.created`` and ``response.in_progress``, each item's events, then
    ``response.completed`` / ``response.incomplete``. An error on the way is one ``error``
    event (OpenAI's fields, and chat's ``error`` object: the SDK raises it), ending the stream."""
    numbers = itertools.count()

    def numbered(event: dict[str, Any]) -> str:
        return _sse({**event, "sequence_number": next(numbers)})

    shell = _body(serving, req, run, "in_progress")
    yield numbered(_event("response.created", response=shell))
    yield numbered(_event("response.in_progress", response=shell))
    items = OutputItems(run.plan)
    finish = None
    try:
        for event in items.start():
            yield numbered(event)
        async for _, d in serving.merged(run.jobs):
            finish = d.finish_reason or finish
            for event in items.feed(d.text, d.finish_reason is not None):
                yield numbered(event)
        for event in items.finish(finish):
            yield numbered(event)
    except APIError as e:
        error = e.body()["error"]
        yield numbered(_event("error", code=str(e.status), message=e.message, param=e.param,
                              error=error))
        return
    status = "incomplete" if finish == "length" else "completed"
    yield numbered(_event(f"response.{status}", response=_body(serving, req, run, status, items)))


async def create_response(serving: Serving, request: Request) -> Response:
    """``POST /v1/responses``: a JSON response object, or its SSE events with ``stream``."""
    req = await serving.parse(request, ResponsesRequest)
    serving.check_model(req.model)
    run = await start_chat(serving, request, chat_request(req), "resp", RESPONSES_FIELDS, "_")
    if req.stream:
        return serving.sse_response(_events(serving, req, run), run.jobs)
    deltas = (await serving.collect(run.jobs, request))[0]
    items = OutputItems(run.plan)
    finish = deltas[-1].finish_reason
    items.start()
    items.feed("".join(d.text for d in deltas), True)
    items.finish(finish)
    status = "incomplete" if finish == "length" else "completed"
    return JSONResponse(_body(serving, req, run, status, items))
