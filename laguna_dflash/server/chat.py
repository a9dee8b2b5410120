"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, then generate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..chat_template import ChatTemplateError, render_messages
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, ChatMessage
from .sampling import (
    build_sampling_params,
    num_choices,
    num_prompt_logprobs,
    reject_unsupported,
    resolve_max_tokens,
    stop_strings,
)
from .serving import SSE_DONE, Delta, Job, Serving, base_request_id, sse, usage
from .structured import requested_constraint
from .tool_calls import ToolPlan, ToolStreamer, final_message, plan_tools


def render_chat(serving: Serving, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                chat_template_kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None,
                tools: list[dict[str, Any]] | None = None, messages_param: str = "messages") -> str:
    """The prompt text a chat template makes of ``messages`` (chat_template.render_messages):
    the request's ``chat_template`` (only with ``--trust-request-chat-template``), else
    ``--chat-template``'s, else the tokenizer's; ``chat_template_kwargs`` go to the template
    after (and over) the flags, as in vLLM. ``tools`` reach the template as vLLM passes them
    (with ``tool_choice: "none"`` too: the model sees the tools and is not asked to call one).
    What cannot be rendered is a 400 naming the field (``messages_param`` for the messages:
    ``input`` on /v1/responses)."""
    tok = serving.require_tokenizer("chat")
    kwargs = dict(chat_template_kwargs or {})
    in_kwargs = kwargs.pop("chat_template", None)
    param = "chat_template" if chat_template is not None else "chat_template_kwargs.chat_template"
    chat_template = chat_template if chat_template is not None else in_kwargs
    if chat_template is not None and not serving.config.trust_request_chat_template:
        raise bad_request(f"{param}: this server does not take chat templates from requests; "
                          "leave it out, or start the server with --trust-request-chat-template",
                          param)
    try:
        return render_messages(tok, [m.model_dump(exclude_none=True) for m in messages],
                               chat_template=chat_template or serving.config.chat_template,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=kwargs)
    except ChatTemplateError as e:
        if e.field == "chat_template":  # none at all
            raise bad_request(f"{e}; use /v1/completions, or start the server with "
                              "--chat-template FILE") from e
        raise bad_request(str(e), messages_param if e.field == "messages" else e.field) from e


def _logprobs(serving: Serving, tokens: list[int], logprobs: list[dict[int, float]],
              n: int, as_ids: bool = False) -> list[dict]:
    """Chat ``logprobs.content`` entries: the chosen token and the ``n`` most likely ones;
    ``as_ids``: tokens as ``token_id:<id>`` (``return_tokens_as_token_ids``)."""

    def entry(token: int, value: float) -> dict:
        s = serving.token_str(token, as_ids)
        return {"token": s, "logprob": value, "bytes": list(s.encode("utf-8"))}

    out = []
    for t, lp in zip(tokens, logprobs):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:n]
        out.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in top]})
    return out


def _num_logprobs(req: ChatCompletionRequest, max_logprobs: int) -> int | None:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= max_logprobs:
        raise bad_request(f"top_logprobs must be in [0, {max_logprobs}] (the server's "
                          f"--max-logprobs), got {req.top_logprobs}", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def _events(serving: Serving, jobs: list[Job], req: ChatCompletionRequest,
                  n_logprobs: int | None, plan: ToolPlan) -> AsyncIterator[str]:
    """The assistant role for every choice (and a named tool's call), then one SSE chunk per
    delta of any choice, its text made a delta by the choice's :class:`ToolStreamer`."""
    opts = req.stream_options
    base = {"id": jobs[0].request_id, "object": "chat.completion.chunk",
            "created": jobs[0].created, "model": serving.model_name}

    def chunk(index: int, delta: dict, logprobs: list | None = None, finish: str | None = None,
              stop_reason: str | int | None = None, token_ids: list[int] | None = None,
              top: dict | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta,
                                  "logprobs": None if logprobs is None else {"content": logprobs},
                                  "finish_reason": finish, "stop_reason": stop_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {**base, **(top or {}), "choices": [choice]}
        if opts is not None and opts.continuous_usage_stats:
            body["usage"] = usage(jobs)
        return sse(body)

    try:
        for i in range(len(jobs)):
            # vLLM's place for the prompt's ids: the first chunk's, beside its choices
            top = {"prompt_token_ids": jobs[0].prompt_token_ids} if req.return_token_ids and i == 0 else {}
            yield chunk(i, {"role": "assistant", "content": ""}, top=top)
        streamers = [ToolStreamer(plan) for _ in jobs]
        for i, streamer in enumerate(streamers):
            header = streamer.header()
            if header is not None:
                yield chunk(i, header)
        async for i, d in serving.merged(jobs):
            wants_tokens = n_logprobs is not None or req.return_token_ids
            delta = streamers[i].feed(d.text, d.finish_reason is not None)
            if not (delta or d.finish_reason or (d.token_ids and wants_tokens)):
                continue
            lps = None
            if n_logprobs is not None and d.logprobs is not None:
                lps = _logprobs(serving, d.token_ids, d.logprobs, n_logprobs,
                                req.return_tokens_as_token_ids)
            yield chunk(i, delta, lps, streamers[i].finish_reason(d.finish_reason),
                        d.stop_reason, d.token_ids if req.return_token_ids else None)
        if opts is not None and opts.include_usage:
            yield sse(serving.usage_chunk(jobs, base))
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE


def _response(serving: Serving, jobs: list[Job], req: ChatCompletionRequest,
              deltas_by_job: list[list[Delta]], n_logprobs: int | None,
              n_prompt: int | None = None, plan: ToolPlan | None = None) -> dict:
    """The non-streamed body; ``n_prompt``: the checked ``prompt_logprobs`` count (None: off);
    ``plan``: the request's tools (tool_calls.final_message makes each message)."""
    choices = []
    for i, (job, deltas) in enumerate(zip(jobs, deltas_by_job)):
        tokens = [t for d in deltas for t in d.token_ids]
        last = deltas[-1]
        message, finish = final_message(plan or ToolPlan(), "".join(d.text for d in deltas),
                                        last.finish_reason)
        choice: dict[str, Any] = {
            "index": i, "message": message, "logprobs": None, "finish_reason": finish,
            "stop_reason": last.stop_reason}
        if n_logprobs is not None:
            lps = [lp for d in deltas for lp in (d.logprobs or [])]
            choice["logprobs"] = {"content": _logprobs(serving, tokens, lps, n_logprobs,
                                                       req.return_tokens_as_token_ids)}
        if req.return_token_ids:
            choice["token_ids"] = tokens
            choice["prompt_token_ids"] = job.prompt_token_ids
        choices.append(choice)
    body = serving.response_body(jobs, "chat.completion", choices)
    if req.return_token_ids:  # vLLM's place for chat: the response's, as every choice shares it
        body["prompt_token_ids"] = jobs[0].prompt_token_ids
    if n_prompt is not None:  # the response's too (vLLM's)
        body["prompt_logprobs"] = serving.prompt_logprobs_body(
            jobs[0].prompt_token_ids, deltas_by_job[0][0].prompt_logprobs or [], n_prompt,
            req.return_tokens_as_token_ids)
    return body


@dataclass(frozen=True)
class ChatFieldNames:
    """The request fields a chat request's errors name: chat's own, or those of a route whose
    requests are rendered as chats (/v1/responses: ``input``, ``max_output_tokens``,
    ``text.format``, ``tools[i].parameters``)."""

    messages: str = "messages"
    #: None: chat's, ``max_completion_tokens`` when sent, else ``max_tokens``
    max_tokens: str | None = None
    response_format: str = "response_format"
    #: where ``response_format``'s JSON schema is (None: chat's place)
    response_format_schema: str | None = None
    #: a tool's schema within ``tools[i]``
    tool_parameters: str = "function.parameters"


@dataclass
class ChatRun:
    """A started chat request: its jobs (one per choice), tool plan and checked logprob counts."""

    jobs: list[Job]
    plan: ToolPlan
    n_logprobs: int | None
    n_prompt: int | None


async def start_chat(serving: Serving, request: Request, req: ChatCompletionRequest,
                     prefix: str = "chatcmpl", names: ChatFieldNames = ChatFieldNames(),
                     separator: str = "-") -> ChatRun:
    """Check ``req``, render its messages through the chat template, build the sampling params
    (with the tool choice's or the request's output constraint) and start its choices; 400s
    name the fields as ``names`` says. The response id is ``<prefix><separator><id>``
    (:meth:`Serving.start`)."""
    serving.check_model(req.model)
    reject_unsupported(req)
    plan = plan_tools(req, serving.config.enable_auto_tool_choice)
    if plan.path is not None:
        plan = replace(plan, path=plan.path.replace("function.parameters", names.tool_parameters))
    n_logprobs = _num_logprobs(req, serving.max_logprobs)
    n_prompt = num_prompt_logprobs(req, serving.max_logprobs, serving.vocab_size)
    text = render_chat(serving, req.messages, req.add_generation_prompt,
                       req.continue_final_message, req.chat_template_kwargs, req.chat_template,
                       req.tools, names.messages)
    ids = serving.check_prompt(serving.encode(text, req.add_special_tokens, names.messages),
                              names.messages, req.truncate_prompt_tokens)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(ids), serving.max_model_len, None,
                                    names.max_tokens or param,
                                    cap=serving.config.generation_defaults.get("max_tokens"))
    params = build_sampling_params(req, max_tokens, n_logprobs, serving.config.generation_defaults,
                                   "top_logprobs", serving.max_logprobs)
    if n_prompt is not None:
        params = replace(params, prompt_logprobs=n_prompt)
    params = replace(params, **await _constraint(serving, req, plan, names))
    jobs = await serving.start(prefix, ids, params, num_choices(req), stop_strings(req),
                               req.skip_special_tokens, req.include_stop_str_in_output,
                               base_request_id(request, req.request_id), req.priority, separator)
    return ChatRun(jobs, plan, n_logprobs, n_prompt)


async def create_chat_completion(serving: Serving, request: Request) -> Response:
    req = await serving.parse(request, ChatCompletionRequest)
    run = await start_chat(serving, request, req)
    if req.stream:
        return serving.sse_response(_events(serving, run.jobs, req, run.n_logprobs, run.plan),
                                    run.jobs)
    deltas = await serving.collect(run.jobs, request)
    return JSONResponse(_response(serving, run.jobs, req, deltas, run.n_logprobs, run.n_prompt,
                                  run.plan))


async def _constraint(serving: Serving, req: ChatCompletionRequest, plan: ToolPlan,
                      names: ChatFieldNames) -> dict[str, Any]:
    """The output constraint as SamplingParams fields: a named or required tool choice's, else
    the request's own (structured outputs); 400 naming the other field for both at once."""
    found = requested_constraint(req)
    if found is not None and found[1] == "response_format":  # in the route's terms
        found = (found[0], names.response_format)
    if plan.constraint is None:
        if found is None:
            return {}
        path = names.response_format_schema if found[1] == names.response_format else None
        return await serving.compile_constraint(found[0], found[1], path)
    if found is not None:
        raise bad_request(f"tool_choice {plan.name or plan.mode!r} constrains the output to the "
                          f"tool call, and {found[1]} constrains it too; send one of them "
                          f"(leave {found[1]} out)", found[1])
    return await serving.compile_constraint(plan.constraint, "tools", plan.path)
