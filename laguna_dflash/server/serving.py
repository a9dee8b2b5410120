"""What completions and chat share: parsing, prompt checks, running a request, SSE framing.

A request becomes a :class:`Job`; :meth:`Serving.generate` turns the engine's token outputs into
:class:`Delta` s (text, tokens, logprobs, finish). Streaming sends one SSE event per delta;
non-streaming concatenates the same deltas, so both give the same text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..config import SamplingParams, tokenize_bad_words, truncated_prompt
from ..engine.sampler import Logprob
from ..structured_outputs import StructuredOutputCompiler, StructuredOutputsParams
from .args import ServerConfig
from .async_engine import AsyncEngine, ClientDisconnected, RequestStream
from .detokenizer import IncrementalDetokenizer, OutputText
from .errors import APIError, bad_request, from_validation_error
from .protocol import SamplingFields
from .structured import compile_error, requested_constraint

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


@dataclass
class Delta:
    """New output of one request: text that may be sent now and the tokens behind it."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # the first delta of a request that asked for prompt logprobs: per prompt position
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class Job:
    """One running request as the HTTP layer sees it."""

    request_id: str
    created: int
    prompt_token_ids: list[int]
    params: SamplingParams
    text: OutputText
    stream: RequestStream
    num_output_tokens: int = 0
    spec: dict | None = None
    num_cached_tokens: int = 0
    # completions ``echo`` with ``max_tokens: 0``: the engine generates one token, never sent
    hides_output: bool = False
    # which prompt of the request (a completions request may hold several, n choices each)
    prompt_index: int = 0


def usage(jobs: list[Job]) -> dict:
    """OpenAI usage of one response (its prompts' ``n`` choices, one job each): each prompt
    counted once, every choice's completion tokens; ``prompt_tokens_details.cached_tokens``:
    the prompt tokens the prefix cache held for each prompt's first choice (not computed), as
    OpenAI reports prompt caching."""
    firsts = {j.prompt_index: j for j in reversed(jobs)}.values()  # each prompt's first choice
    p = sum(len(j.prompt_token_ids) for j in firsts)
    c = sum(0 if j.hides_output else j.num_output_tokens for j in jobs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(j.num_cached_tokens for j in firsts)}}


def top_entries(entries: list[dict[int, Logprob] | None], tokens: list[int],
                n: int) -> list[dict[int, Logprob] | None]:
    """Each position's ``{token: Logprob}`` cut to its own token plus the ``n`` most likely
    (rank <= n): a request computes the most any of its fields asked for (completions' ``echo``
    with ``logprobs`` and ``prompt_logprobs`` share the prompt's)."""
    return [None if e is None else {t: v for t, v in e.items() if t == tok or v.rank <= n}
            for e, tok in zip(entries, tokens)]


def base_request_id(request: Request, body_id: str | None) -> str | None:
    """vLLM's: the client's id for a response, its ``X-Request-Id`` header, else the body's
    ``request_id``; None (a random id) when it sent neither or an empty one."""
    return request.headers.get("x-request-id") or body_id or None


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


#: Largest request body accepted (413 above it).
MAX_BODY_BYTES = 64 << 20


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Resolve when the client closes the connection (the body has been read already);
    ``receive``: the ASGI receive callable (``Request.receive``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that answers at once must not make this spin


class Serving:
    """Shared state of the OpenAI routes: the engine, the tokenizer, the model's limits."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.served_model_name
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.target.spec.vocab_size
        self.max_logprobs = engine.engine.max_logprobs  # --max-logprobs, resolved
        self.num_speculative_tokens = engine.engine.num_speculative_tokens
        self.created = int(time.time())
        self._grammar_compiler: StructuredOutputCompiler | None = None  # made on first use

    # ---- request parsing -----------------------------------------------------------------

    async def parse(self, request: Request, model: type[M]) -> M:
        """The JSON body validated into ``model`` (400 for malformed JSON or bad fields)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
        raw = await request.body()
        try:
            data = json.loads(raw)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and an integer literal
            # past Python's digit limit (4300), which json.loads raises as a plain ValueError
            raise bad_request(f"malformed JSON body: {e}") from e
        except RecursionError:  # the parser recurses once per nested array or object
            raise bad_request("the JSON body is nested too deeply to parse; no request field "
                              "nests more than a few levels") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise from_validation_error(e) from e

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.config.served_model_aliases:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, and the model has none; "
                              "send token ids to /v1/completions instead")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """``text`` tokenized; 400 naming ``param`` for text that is not Unicode (JSON can
        escape lone UTF-16 surrogates, which no tokenizer takes)."""
        tok = self.require_tokenizer("a text prompt")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(
                f"{param} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}), which is not "
                "Unicode text; send valid UTF-8 (a surrogate escape needs its pair, e.g. "
                "\\ud83d\\ude00)", param) from None
        return list(tok.encode(text, add_special_tokens=add_special_tokens))

    def bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as the token-id sequences the engine bans
        (:func:`~laguna_dflash.config.tokenize_bad_words`, as LLM.generate); 400 naming
        ``bad_words`` without a tokenizer, for text that is not Unicode, or for ids past the
        model's vocabulary."""
        if self.tokenizer is None:
            raise bad_request("bad_words need a tokenizer to find their tokens, and the model has "
                              "none; leave bad_words out", "bad_words")
        for word in words:
            try:
                word.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("bad_words holds a lone UTF-16 surrogate, which is not Unicode "
                                  "text; send valid UTF-8", "bad_words") from None
        try:
            ids = tokenize_bad_words(self.tokenizer, words)
        except ValueError as e:
            raise bad_request(str(e), "bad_words") from e
        bad = sorted({t for w in ids for t in w if t >= self.vocab_size})
        if bad:
            raise bad_request(f"bad_words tokenize to ids {bad[:5]} outside the model's vocabulary "
                              f"[0, {self.vocab_size})", "bad_words")
        return ids

    async def structured_constraint(self, req: SamplingFields) -> dict[str, Any]:
        """The request's output constraint (server/structured.py) as SamplingParams fields
        (:meth:`compile_constraint`); ``{}`` without one."""
        found = requested_constraint(req)
        if found is None:
            return {}
        return await self.compile_constraint(*found)

    async def compile_constraint(self, params: StructuredOutputsParams, param: str,
                                 path: str | None = None) -> dict[str, Any]:
        """``params`` as SamplingParams fields: ``structured_outputs`` and its
        ``structured_grammar``, compiled with the tokenizer off the event loop (a big JSON
        schema takes seconds). 400 naming ``param`` (``path``: where in it the schema is) for
        a constraint that does not compile, or a model without a tokenizer."""
        if (self.config.structured_outputs_defaults.get("disable_any_whitespace")
                and params.whitespace_pattern is None):  # --structured-outputs-config's default
            params = replace(params, disable_any_whitespace=True)
        if self.tokenizer is None:
            raise bad_request(f"{param} needs a tokenizer to compile the constraint over the "
                              f"model's tokens, and the model has none; leave {param} out", param)
        if self._grammar_compiler is None:
            self._grammar_compiler = StructuredOutputCompiler(self.tokenizer, self.vocab_size)
        try:
            grammar = await asyncio.to_thread(self._grammar_compiler.compile, params)
        except (ValueError, TypeError, ImportError) as e:
            raise compile_error(e, param, path) from e
        return {"structured_outputs": params, "structured_grammar": grammar}

    def check_prompt(self, ids: list[int], param: str, truncate_prompt_tokens: int | None = None) -> list[int]:
        """400 unless the prompt is non-empty, in the vocabulary and leaves room for output.
        ``truncate_prompt_tokens`` (vLLM's): only its last that many tokens are kept (-1:
        ``max_model_len`` of them), before the checks."""
        try:
            ids = truncated_prompt(ids, truncate_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise bad_request(str(e), "truncate_prompt_tokens") from None
        if not ids:
            raise bad_request("the prompt is empty; send at least one token", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {self.vocab_size})", param)
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(ids)} tokens, which leaves no room for the completion. "
                "Please shorten the prompt.", param)
        return ids

    def prompt_logprobs_body(self, tokens: list[int], entries: list[dict[int, Logprob] | None],
                             n: int, as_ids: bool = False) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt position None (the first: nothing scores it)
        or ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for its token and the ``n``
        most likely; ``-inf`` is sent as -9999.0, as vLLM does (JSON has no infinity)."""
        return [None if e is None else {
            str(t): {"logprob": max(float(v), -9999.0), "rank": v.rank,
                     "decoded_token": self.token_str(t, as_ids)} for t, v in e.items()}
            for e in top_entries(entries, tokens, n)]

    def token_str(self, token_id: int, as_id: bool = False) -> str:
        """A token's text in logprobs; ``as_id`` (vLLM's ``return_tokens_as_token_ids``), or a
        model without a tokenizer: ``token_id:<id>``."""
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- running -------------------------------------------------------------------------

    async def start(self, prefix: str, prompt_ids: list[int], params: SamplingParams, n: int,
                    stop: tuple[str, ...], skip_special_tokens: bool,
                    include_stop_str: bool, base_id: str | None = None, priority: int = 0,
                    separator: str = "-") -> list[Job]:
        """Submit the ``n`` choices of one response and wait until the engine accepted them
        (4xx/5xx otherwise; the accepted ones are then aborted). With a seed, choice ``i``
        samples with ``seed + i``.

        The response's id is ``<prefix>-<base_id>`` (:func:`base_request_id`: the client's
        ``X-Request-Id`` or ``request_id``), else ``<prefix>-<random hex>`` (``separator``
        instead of ``-``: ``resp_...`` on /v1/responses). Engine request ids
        are that id, ``<id>-1``, ... for the choices, with a random suffix after a client's
        id: two requests may send the same one, and the engine's ids must differ.
        ``priority`` (vLLM's request field) orders the choices under ``--scheduling-policy
        priority``; another value than 0 is a 400 without it."""
        if priority != 0 and self.config.engine.scheduling_policy != "priority":
            raise bad_request(f"priority={priority} needs priority scheduling, and this server "
                              "schedules first come, first served; leave priority out or 0, or "
                              "start the server with --scheduling-policy priority", "priority")
        for param, ids in (("logit_bias", params.logit_bias or {}),
                           ("stop_token_ids", params.stop_token_ids or ()),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise bad_request(f"{param} has token ids {bad[:5]} outside the vocabulary "
                                  f"[0, {self.vocab_size}); send ids of this model's tokenizer",
                                  param)
        if stop and self.tokenizer is None:  # stop strings are matched in the text (none here)
            raise bad_request("stop strings need a tokenizer, and the model has none; leave stop "
                              "out, or send the tokens to stop on as stop_token_ids", "stop")
        if params.bad_words:
            params = replace(params, bad_words_token_ids=self.bad_words_ids(params.bad_words))
        request_id = f"{prefix}{separator}{base_id or uuid.uuid4().hex}"
        if self.config.log_requests:
            logger.info("request %s: %d prompt tokens, n=%d, %s", request_id, len(prompt_ids), n, params)
        engine_id = request_id if base_id is None else f"{request_id}-{uuid.uuid4().hex[:12]}"
        jobs: list[Job] = []
        try:
            for i in range(n):
                detok = (IncrementalDetokenizer(self.tokenizer, skip_special_tokens)
                         if self.tokenizer is not None else None)
                p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
                rid = engine_id if i == 0 else f"{engine_id}-{i}"
                jobs.append(Job(request_id if i == 0 else f"{request_id}-{i}", int(time.time()),
                                prompt_ids, p,
                                OutputText(detok, stop, include_stop_str, params.min_tokens),
                                self.engine.submit(rid, prompt_ids, p, priority)))
                await jobs[-1].stream.accepted()
        except BaseException:
            for job in jobs:
                job.stream.abort()
            raise
        self.engine.metrics.observe_params_n(n)
        return jobs

    async def merged(self, jobs: list[Job]) -> AsyncIterator[tuple[int, Delta]]:
        """``(choice index, delta)`` of every job as they arrive; every job is aborted if this
        stops early (a client that went away, an error)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            try:
                async for d in self.generate(job):
                    await queue.put((i, d))
                await queue.put((i, None))
            except BaseException as e:  # handed to the consumer, which re-raises it
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            running = len(jobs)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def generate(self, job: Job,
                       disconnected: asyncio.Future | None = None) -> AsyncIterator[Delta]:
        """Deltas until the request finishes; the engine request is aborted if this stops early."""
        stream = job.stream
        stop_ids = set(job.params.stop_token_ids or ())
        try:
            while True:
                out = await stream.next(disconnected)
                finish: str | None = None
                stop_reason: str | int | None = None
                taken = job.text.add_tokens(out.new_token_ids, out.ends_on_stop_token)
                tokens = list(out.new_token_ids[:taken])
                logprobs = None if out.new_logprobs is None else list(out.new_logprobs[:taken])
                if job.text.stop_hit is not None:
                    finish, stop_reason = "stop", job.text.stop_hit
                job.num_output_tokens += len(tokens)
                job.spec = out.spec
                job.num_cached_tokens = out.num_cached_tokens
                if finish is not None:
                    stream.abort("stop")  # a stop string: free the engine request now
                elif out.finished:
                    job.text.finish()
                    finish = out.finish_reason
                    if job.text.stop_hit is not None:
                        finish, stop_reason = "stop", job.text.stop_hit
                    elif finish == "stop" and tokens and tokens[-1] in stop_ids:
                        stop_reason = tokens[-1]
                yield Delta(job.text.take(final=finish is not None), tokens, logprobs, finish,
                            stop_reason, out.prompt_logprobs)
                if finish is not None:
                    return
        finally:
            stream.abort()

    async def collect(self, jobs: list[Job], request: Request) -> list[list[Delta]]:
        """Run a non-streamed response's jobs to the end -> each job's deltas; abort them all if
        the client disconnects (one watcher for the connection)."""
        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))

        async def run(job: Job) -> list[Delta]:
            return [d async for d in self.generate(job, watcher)]

        tasks = [asyncio.ensure_future(run(job)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        except ClientDisconnected:
            logger.info("client disconnected; aborted %s", jobs[0].request_id)
            raise APIError(499, "client disconnected") from None
        finally:
            for task in tasks:  # after a failure the others stop (and abort) too
                task.cancel()
            watcher.cancel()

    def response_body(self, jobs: list[Job], obj: str, choices: list[dict]) -> dict:
        """The non-streamed response envelope shared by completions and chat."""
        body = {"id": jobs[0].request_id, "object": obj, "created": jobs[0].created,
                "model": self.model_name, "choices": choices, "usage": usage(jobs)}
        metrics = self.spec_metrics(jobs)
        if metrics is not None:
            body["metrics"] = metrics
        return body

    def usage_chunk(self, jobs: list[Job], base: dict) -> dict:
        """The final streamed chunk (``stream_options.include_usage``): usage and spec metrics."""
        final = {**base, "choices": [], "usage": usage(jobs)}
        metrics = self.spec_metrics(jobs)
        if metrics is not None:
            final["metrics"] = metrics
        return final

    def spec_metrics(self, jobs: list[Job]) -> dict | None:
        """Speculative decoding metrics of a response (vLLM's ``metrics.speculative_decoding``),
        its choices' counters summed."""
        specs = [j.spec for j in jobs if j.spec is not None]
        if not specs:
            return None
        s = {key: sum(spec[key] for spec in specs)
             for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        k, drafts = self.num_speculative_tokens, s["num_drafts"]
        per_pos = [sum(spec["num_accepted_tokens_per_pos"][i] for spec in specs
                       if i < len(spec["num_accepted_tokens_per_pos"])) for i in range(k)]
        # steps that accepted exactly a drafts: per_pos[a-1] - per_pos[a] (per_pos[-1] = drafts)
        bounds = [drafts, *per_pos, 0]
        histogram = [bounds[a] - bounds[a + 1] for a in range(k + 1)]
        accepted = s["num_accepted_tokens"]
        return {"speculative_decoding": {
            "num_spec_tokens": k,
            "num_spec_steps": drafts,
            "num_draft_tokens": s["num_draft_tokens"],
            "num_accepted_draft_tokens": accepted,
            "num_accepted_tokens_per_pos": list(per_pos),
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "draft_acceptance_rate": accepted / s["num_draft_tokens"] if s["num_draft_tokens"]
            else 0.0,
            "acceptance_histogram": histogram,
        }}

    @staticmethod
    def sse_response(events: AsyncIterator[str], jobs: list[Job]) -> StreamingResponse:
        """``events`` as server-sent events; ``jobs`` are aborted when the response ends in any
        way (a no-op for finished ones)."""
        return JobsStreamingResponse(events, jobs, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})


class JobsStreamingResponse(StreamingResponse):
    """A stream that aborts its jobs once sent, failed or cancelled: a client gone before the
    first chunk can fail the response before ``events`` ever starts, and a generator that never
    started runs no ``finally`` (its requests would run on to ``max_tokens``).

    A client that goes away is noticed while nothing is being sent too: Starlette watches for
    the disconnect only under ASGI spec versions before 2.4 (uvicorn 0.55 reports 2.3), and
    under 2.4 learns of it when a send fails, so there a request still waiting for a slot, or
    one whose text is all held back (a long stop string), would run on to ``max_tokens``."""

    def __init__(self, events: AsyncIterator[str], jobs: list[Job], **kw: Any) -> None:
        super().__init__(events, **kw)
        self.jobs = jobs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        response = asyncio.ensure_future(super().__call__(scope, receive, send))
        spec = tuple(int(v) for v in scope.get("asgi", {}).get("spec_version", "2.0").split("."))
        # below 2.4 Starlette watches for the disconnect itself: a second watcher is not needed
        watcher = (asyncio.ensure_future(_wait_disconnect(receive)) if spec >= (2, 4)
                   else asyncio.get_running_loop().create_future())
        try:
            await asyncio.wait({response, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if response.done():
                await response  # its result, or its error
            else:  # the client went away first: stop the stream
                logger.info("client disconnected; aborted %s", self.jobs[0].request_id)
                response.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await response
        finally:
            watcher.cancel()
            response.cancel()  # a no-op unless this call itself was cancelled
            for job in self.jobs:
                job.stream.abort()
