"""``POST /v1/completions``: request -> job -> JSON response or SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.sampler import Logprob
from .errors import APIError, bad_request
from .protocol import CompletionRequest
from .sampling import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    build_sampling_params,
    num_choices,
    num_prompt_logprobs,
    reject_unsupported,
    resolve_max_tokens,
    stop_strings,
)
from .serving import SSE_DONE, Delta, Job, Serving, base_request_id, sse, top_entries, usage

#: The most prompts one completions request may hold.
MAX_PROMPTS = 256


def _prompts(serving: Serving, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
    """The request's prompts as (token ids, the text sent or None), each checked
    (``Serving.check_prompt``, which applies ``truncate_prompt_tokens``; a cut prompt's text is
    None: its echo decodes the ids kept): a string, token ids, or a list of strings or of id
    lists (a batch, as vLLM accepts; an error names the entry, ``prompt.1``)."""
    p = req.prompt

    def checked(ids: list[int], text: str | None, param: str) -> tuple[list[int], str | None]:
        kept = serving.check_prompt(ids, param, req.truncate_prompt_tokens)
        return kept, text if len(kept) == len(ids) else None

    if isinstance(p, str):
        return [checked(serving.encode(p, req.add_special_tokens), p, "prompt")]
    if not p:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(p[0], int):
        return [checked(list(p), None, "prompt")]
    if len(p) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt")
    prompts = []
    for i, x in enumerate(p):
        ids = serving.encode(x, req.add_special_tokens, f"prompt.{i}") if isinstance(x, str) else list(x)
        prompts.append(checked(ids, x if isinstance(x, str) else None, f"prompt.{i}"))
    return prompts


@dataclass(frozen=True)
class Echo:
    """The prompt a completions choice starts with (``echo``): its text, token ids and, when the
    request asked for logprobs, its prompt logprobs (``None`` at position 0)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None


def _echo(serving: Serving, req: CompletionRequest, ids: list[int], text: str | None) -> Echo | None:
    """A prompt's :class:`Echo` without its logprobs (they come with the first output), or None
    without ``echo``: the prompt text as sent, or its token ids decoded."""
    if not req.echo:
        return None
    if text is None:
        text = (serving.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
                if serving.tokenizer is not None else "")
    return Echo(text, ids, None)


def _with_logprobs(echo: Echo | None, req: CompletionRequest,
                   entries: list[dict[int, Logprob] | None] | None) -> Echo | None:
    """``echo`` with its prompt's logprobs (the ``logprobs`` most likely at each position), or
    None without an echo."""
    if echo is None:
        return None
    if entries is not None and req.logprobs is not None:
        entries = top_entries(entries, echo.token_ids, req.logprobs)
    return replace(echo, logprobs=entries)


def _logprobs(serving: Serving, tokens: list[int], logprobs: list[dict[int, float] | None],
              offset: int, as_ids: bool = False) -> tuple[dict, int]:
    """The completions ``logprobs`` object for ``tokens``; ``offset`` is the text offset so far.
    A ``None`` entry (an echoed prompt's first token) has no logprobs. ``as_ids``: tokens as
    ``token_id:<id>`` (``return_tokens_as_token_ids``)."""
    strs = [serving.token_str(t, as_ids) for t in tokens]
    offsets = []
    for s in strs:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": strs,
        "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(tokens, logprobs)],
        "top_logprobs": [None if lp is None else {serving.token_str(k, as_ids): v for k, v in lp.items()}
                         for lp in logprobs],
        "text_offset": offsets,
    }, offset


def _choice(serving: Serving, req: CompletionRequest, index: int, text: str, tokens: list[int],
            logprobs: list[dict[int, float]] | None, offset: int, finish: str | None,
            stop_reason: str | int | None, echo: Echo | None = None) -> tuple[dict, int]:
    """One choice (or one streamed chunk of it); ``echo``: the prompt put before it."""
    choice = {"index": index, "text": text if echo is None else echo.text + text, "logprobs": None,
              "finish_reason": finish, "stop_reason": stop_reason}
    if req.logprobs is not None and logprobs is not None:
        as_ids = req.return_tokens_as_token_ids
        if echo is not None and echo.logprobs is not None:
            head, offset = _logprobs(serving, echo.token_ids, echo.logprobs, offset, as_ids)
            body, offset = _logprobs(serving, tokens, logprobs, offset, as_ids)
            choice["logprobs"] = {key: head[key] + body[key] for key in head}
        else:
            choice["logprobs"], offset = _logprobs(serving, tokens, logprobs, offset, as_ids)
    if req.return_token_ids:
        choice["token_ids"] = tokens
    return choice, offset


def _shown(job: Job, d: Delta) -> Delta:
    """``d`` as the client sees it: no generated output for an ``echo`` with ``max_tokens: 0``
    (the engine generated one token anyway)."""
    if not job.hides_output:
        return d
    return replace(d, text="", token_ids=[], logprobs=[] if d.logprobs is not None else None,
                   finish_reason="length" if d.finish_reason else None, stop_reason=None)


async def _events(serving: Serving, jobs: list[Job], req: CompletionRequest,
                  echoes: list[Echo | None]) -> AsyncIterator[str]:
    """One SSE chunk per delta of any choice (``choices[0].index`` says which); with ``echo``
    each choice's first chunk starts with its prompt (``echoes``: one per job)."""
    opts = req.stream_options
    base = {"id": jobs[0].request_id, "object": "text_completion", "created": jobs[0].created,
            "model": serving.model_name}
    offsets, first = [0] * len(jobs), [True] * len(jobs)
    try:
        async for i, d in serving.merged(jobs):
            d = _shown(jobs[i], d)
            wants_tokens = req.logprobs is not None or req.return_token_ids
            echo = _with_logprobs(echoes[i], req, d.prompt_logprobs) if first[i] else None
            if not (d.text or d.finish_reason or (d.token_ids and wants_tokens) or echo):
                continue
            choice, offsets[i] = _choice(serving, req, i, d.text, d.token_ids, d.logprobs,
                                         offsets[i], d.finish_reason, d.stop_reason, echo)
            if req.return_token_ids and first[i]:
                choice["prompt_token_ids"] = jobs[i].prompt_token_ids
            first[i] = False
            chunk = {**base, "choices": [choice]}
            if opts is not None and opts.continuous_usage_stats:
                chunk["usage"] = usage(jobs)
            yield sse(chunk)
        if opts is not None and opts.include_usage:
            yield sse(serving.usage_chunk(jobs, base))
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE


def _response(serving: Serving, jobs: list[Job], req: CompletionRequest,
              deltas_by_job: list[list[Delta]], echoes: list[Echo | None],
              n_prompt: int | None = None) -> dict:
    """The non-streamed body; ``n_prompt``: the checked ``prompt_logprobs`` count (None: off)."""
    choices = []
    for i, (job, deltas) in enumerate(zip(jobs, deltas_by_job)):
        echo = _with_logprobs(echoes[i], req, deltas[0].prompt_logprobs)
        deltas = [_shown(job, d) for d in deltas]
        tokens = [t for d in deltas for t in d.token_ids]
        logprobs = None
        if req.logprobs is not None:
            logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
        last = deltas[-1]
        choice, _ = _choice(serving, req, i, "".join(d.text for d in deltas), tokens, logprobs,
                            0, last.finish_reason, last.stop_reason, echo)
        if req.return_token_ids:
            choice["prompt_token_ids"] = job.prompt_token_ids
        if n_prompt is not None:
            choice["prompt_logprobs"] = serving.prompt_logprobs_body(
                job.prompt_token_ids, deltas[0].prompt_logprobs or [], n_prompt,
                req.return_tokens_as_token_ids)
        choices.append(choice)
    return serving.response_body(jobs, "text_completion", choices)


async def create_completion(serving: Serving, request: Request) -> Response:
    req = await serving.parse(request, CompletionRequest)
    serving.check_model(req.model)
    reject_unsupported(req)
    prompts = _prompts(serving, req)
    n_prompt = num_prompt_logprobs(req, serving.max_logprobs, serving.vocab_size)
    stop = stop_strings(req)
    constraint = await serving.structured_constraint(req)  # compiled once for every prompt
    jobs: list[Job] = []
    echoes: list[Echo | None] = []
    try:
        for k, (ids, text) in enumerate(prompts):  # choices k * n .. k * n + n - 1 (vLLM's order)
            max_tokens = resolve_max_tokens(req.max_tokens, len(ids), serving.max_model_len,
                                            DEFAULT_COMPLETION_MAX_TOKENS, allow_zero=bool(req.echo),
                                            cap=serving.config.generation_defaults.get("max_tokens"))
            # echo with max_tokens 0: the prompt only (the engine generates one token, not sent)
            params = build_sampling_params(req, max(max_tokens, 1), req.logprobs,
                                           serving.config.generation_defaults,
                                           max_logprobs=serving.max_logprobs)
            params = replace(params, **constraint)
            # the prompt's logprobs for an echo with logprobs and for prompt_logprobs: the
            # engine computes the larger count, each field shows its own (serving.top_entries)
            counts = [c for c in (req.logprobs if req.echo else None, n_prompt) if c is not None]
            if counts:
                params = replace(params, prompt_logprobs=max(counts))
            started = await serving.start("cmpl", ids, params, num_choices(req), stop,
                                          req.skip_special_tokens, req.include_stop_str_in_output,
                                          base_request_id(request, req.request_id), req.priority)
            for job in started:
                job.hides_output, job.prompt_index = max_tokens == 0, k
            jobs += started
            echoes += [_echo(serving, req, ids, text)] * len(started)
    except BaseException:
        for job in jobs:  # the prompts already started: their choices are not answered
            job.stream.abort()
        raise
    if req.stream:
        return serving.sse_response(_events(serving, jobs, req, echoes), jobs)
    return JSONResponse(_response(serving, jobs, req, await serving.collect(jobs, request), echoes,
                                  n_prompt))
