"""One engine thread behind many asyncio connections.

:class:`LLMEngine` is not thread-safe, so a single dedicated thread owns it: it is the only caller
of ``add_request`` / ``step`` / ``abort``. HTTP handlers talk to it through two channels:

- commands in: a ``queue.SimpleQueue`` of ``add`` / ``abort`` / ``stop`` (thread-safe, FIFO, so an
  abort is always seen after the add it refers to);
- outputs out: one ``asyncio.Queue`` per request, fed with ``loop.call_soon_threadsafe`` (batched:
  one wake-up of the event loop per engine step, not one per request).

Loop: take commands (block while idle), run one ``engine.step()`` (continuous batching: requests
join and leave between steps), send every request its new tokens, publish an
:class:`EngineSnapshot` for /metrics and /health. An exception from a step fails only the
requests of that step (HTTP 500 for them) and the loop goes on; aborted, failed and finished
requests have their KV blocks freed by the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..engine.engine import LLMEngine, StepError
from ..engine.sequence import Sequence, Status
from .errors import APIError
from .metrics import EngineSnapshot, RequestPhases, ServerMetrics, SpecCounters
from .stats_log import StatsLogger

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0


@dataclass
class EngineOutput:
    """What one engine step produced for one request."""

    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    num_output_tokens: int
    spec: dict | None = None  # per-request spec counters so far (None without a drafter)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # with the request's first output, when it asked for them: per prompt position (None first)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # the last new token is the stop token it finished on (Sequence.is_stopped_on_token)
    ends_on_stop_token: bool = False


@dataclass(frozen=True)
class _Failure:
    status: int
    message: str


_ACCEPTED = object()


@dataclass
class _Request:
    """Server-side state of one request; fields are written by the engine thread only."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrival: float
    priority: int = 0
    seq: Sequence | None = None
    num_sent: int = 0
    # time.monotonic() at the start of the engine step that first computed any of its prompt,
    # at the step that gave its first output tokens, and at the latest step that gave any
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


class ClientDisconnected(Exception):
    """The HTTP client went away while its request was running."""


class RequestStream:
    """The handler's end of one request: await outputs, abort."""

    def __init__(self, engine: AsyncEngine, request: _Request) -> None:
        self._engine = engine
        self._request = request
        self.finished = False

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def _unwrap(self, item: object) -> object:
        if isinstance(item, _Failure):
            self.finished = True
            raise APIError(item.status, item.message)
        if isinstance(item, EngineOutput) and item.finished:
            self.finished = True
        return item

    async def accepted(self) -> None:
        """Wait until the engine thread has queued the request (or raise its 4xx/5xx)."""
        self._unwrap(await self._request.outputs.get())

    async def next(self, disconnected: asyncio.Future | None = None) -> EngineOutput:
        """The next output; raises :class:`ClientDisconnected` if ``disconnected`` resolves first."""
        if disconnected is None:
            return self._unwrap(await self._request.outputs.get())
        getter = asyncio.ensure_future(self._request.outputs.get())
        try:
            done, _ = await asyncio.wait({getter, disconnected},
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            getter.cancel()
            raise
        if getter in done:
            return self._unwrap(getter.result())
        getter.cancel()
        raise ClientDisconnected()

    def abort(self, reason: str = "abort") -> None:
        """Stop the request in the engine (no-op once finished); ``reason`` goes to the metrics."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id, reason)


class AsyncEngine:
    """Owns the engine thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics,
                 log_stats_interval_s: float = 10.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stats_logger = StatsLogger(metrics, log_stats_interval_s)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, _Request] = {}
        self._thread: threading.Thread | None = None
        max_model_len = getattr(engine, "max_model_len", None)
        if max_model_len:  # the per-request token histograms' buckets reach it
            metrics.set_max_model_len(max_model_len)
        self.snapshot = EngineSnapshot()
        self.fatal_error: BaseException | None = None
        self._publish_snapshot()

    # ---- handler side (event loop thread) ----------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="laguna-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    def submit(self, request_id: str, prompt_token_ids: list[int],
               params: SamplingParams, priority: int = 0) -> RequestStream:
        """Queue a request (call from the event loop); await ``accepted()`` on the result.
        ``priority``: vLLM's, for the priority scheduling policy (lower first)."""
        if not self.is_alive:
            raise APIError(503, "the engine is not running")
        req = _Request(request_id, list(prompt_token_ids), params, asyncio.get_running_loop(),
                       asyncio.Queue(), time.monotonic(), priority=priority)
        self._commands.put(("add", req))
        return RequestStream(self, req)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Thread-safe: abort a request by id (its blocks are freed by the engine thread)."""
        self._commands.put(("abort", request_id, reason))

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (on the engine thread, between steps; running
        requests keep their blocks); returns once done."""
        if not self.is_alive:
            raise APIError(503, "the engine is not running")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("reset_prefix_cache", loop, done))
        await done

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("engine loop started")
        try:
            if self.engine.device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(self.engine.device)
            with torch.inference_mode():  # thread-local, so entered here
                self.engine.lead()  # tensor parallelism: the other ranks replay this thread's calls
                self._loop()
        except BaseException as e:
            self.fatal_error = e  # /health answers 503 from now on
            logger.exception("engine loop died")
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: not ours to swallow
                raise
        finally:
            self._fail_all(503, "the server is shutting down")
            try:
                self.engine.stop_followers()
            except Exception:
                logger.exception("could not stop the follower ranks")
            self._publish_snapshot()
            logger.info("engine loop stopped")

    def _loop(self) -> None:
        while True:
            idle = not self.engine.has_unfinished
            if not self._handle_commands(block=idle):
                return
            try:
                if self.engine.has_unfinished:
                    self._step()
            except Exception:  # a bug outside engine.step: fail what is running, go on
                logger.exception("engine loop error; failing all running requests")
                self._fail_all(500, "internal server error in the engine loop")
            self._publish_snapshot()
            self.stats_logger.maybe_log(self.snapshot)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False on ``stop``."""
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(cmd[1])
            elif cmd[0] == "abort":
                self._abort(cmd[1], cmd[2])
            elif cmd[0] == "reset_prefix_cache":
                self.engine.reset_prefix_cache()
                cmd[1].call_soon_threadsafe(_resolve, cmd[2])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, req: _Request) -> None:
        try:
            req.seq = self.engine.add_request(req.prompt_token_ids, req.params, priority=req.priority)
        except ValueError as e:
            self._deliver([(req, _Failure(400, str(e)))])
            return
        except Exception as e:
            logger.exception("add_request failed for %s", req.request_id)
            self._deliver([(req, _Failure(500, f"could not queue the request: {e}"))])
            return
        self._active[req.request_id] = req
        self.metrics.add_prompt_tokens(len(req.prompt_token_ids))
        self._deliver([(req, _ACCEPTED)])

    def _abort(self, request_id: str, reason: str) -> None:
        req = self._active.pop(request_id, None)
        if req is None:
            return  # already finished (or failed)
        if not req.seq.is_finished:
            self.engine.abort(req.seq)
        self._finish(req, reason)

    def _finish(self, req: _Request, reason: str) -> None:
        if req.seq is None:
            self.metrics.observe_finished(reason, time.monotonic() - req.arrival, 0)
            return
        self.metrics.observe_finished(
            reason, time.monotonic() - req.arrival, req.seq.num_preemptions,
            phases=RequestPhases.from_times(req.arrival, req.scheduled_time,
                                            req.first_token_time, req.last_token_time),
            num_prompt_tokens=len(req.prompt_token_ids), num_generation_tokens=req.num_sent,
            max_tokens=req.params.max_tokens)

    @staticmethod
    def _note_scheduled(req: _Request, step_start: float) -> None:
        """After a step: a request first out of WAITING was admitted by that step's scheduler
        (only a step admits, and every request it admits is in its batch; a preempted request
        goes back to WAITING, but it was scheduled before). Host-side attributes only."""
        if req.scheduled_time is None and req.seq.status is not Status.WAITING:
            req.scheduled_time = step_start

    def _step(self) -> None:
        start = time.monotonic()
        try:
            self.engine.step()
        except Exception as e:
            self._fail_step(e, start)
        now = time.monotonic()
        spec_on = self.engine.proposer is not None
        out: list[tuple[_Request, object]] = []
        step_tokens = 0  # vLLM's iteration tokens: outputs, plus the prompts of first outputs
        for rid, req in list(self._active.items()):
            seq = req.seq
            if req.scheduled_time is None:
                self._note_scheduled(req, start)
            n = len(seq.output_token_ids)
            if n == req.num_sent and not seq.is_finished:
                continue
            new = seq.output_token_ids[req.num_sent : n]
            logprobs = seq.logprobs[req.num_sent : n] if seq.logprobs is not None else None
            prompt_logprobs = seq.prompt_logprobs if req.num_sent == 0 else None
            if new:
                first = req.last_token_time is None
                self.metrics.observe_tokens(len(new), now - req.arrival if first else None,
                                            None if first else now - req.last_token_time)
                if first:
                    req.first_token_time = now
                    step_tokens += len(req.prompt_token_ids)
                step_tokens += len(new)
                req.last_token_time = now
            req.num_sent = n
            spec = None
            if spec_on:
                spec = {"num_drafts": seq.num_drafts, "num_draft_tokens": seq.num_draft_tokens,
                        "num_accepted_tokens": seq.num_accepted_tokens,
                        "num_accepted_tokens_per_pos": list(seq.num_accepted_tokens_per_pos)}
            out.append((req, EngineOutput(list(new), logprobs, seq.is_finished, seq.finish_reason,
                                          n, spec, seq.num_cached_tokens, prompt_logprobs,
                                          seq.is_stopped_on_token)))
            if seq.is_finished:
                del self._active[rid]
                self._finish(req, seq.finish_reason or "stop")
        if step_tokens:
            self.metrics.observe_iteration(step_tokens)
        self._deliver(out)

    def _fail_step(self, error: Exception, step_start: float) -> None:
        """``engine.step`` raised: fail the requests of that step, keep everyone else.

        A :class:`StepError` names the step's requests; any other error (raised before a batch
        was formed, e.g. no room for the head of the queue) fails the head of the queue.
        """
        logger.exception("engine step failed")
        sched = self.engine.scheduler
        if isinstance(error, StepError):
            suspects = error.sequences
        else:
            suspects = list(sched.waiting)[:1] or list(sched.running)
        failed = {id(s) for s in suspects}
        message = f"internal error while generating: {type(error).__name__}: {error}"
        out: list[tuple[_Request, object]] = []
        for rid, req in list(self._active.items()):
            if id(req.seq) in failed:
                self._note_scheduled(req, step_start)  # a failed batch's requests were admitted
                del self._active[rid]
                out.append((req, _Failure(500, message)))
                self._finish(req, "error")
        for seq in suspects:
            try:
                self.engine.abort(seq)
            except Exception:
                logger.exception("could not abort request %s after a failed step", seq.request_id)
        self._deliver(out)

    def _fail_all(self, status: int, message: str) -> None:
        out: list[tuple[_Request, object]] = []
        for req in self._active.values():
            try:
                if req.seq is not None and not req.seq.is_finished:
                    self.engine.abort(req.seq)
            except Exception:
                logger.exception("could not abort %s", req.request_id)
            out.append((req, _Failure(status, message)))
            self._finish(req, "error")
        self._active.clear()
        self._deliver(out)

    def _publish_snapshot(self) -> None:
        e = self.engine
        stats = e.spec_stats
        spec = None
        if stats is not None:
            spec = SpecCounters(e.num_speculative_tokens, stats.num_drafts, stats.num_draft_tokens,
                                stats.num_accepted_tokens, tuple(stats.num_accepted_tokens_per_pos))
        self.snapshot = EngineSnapshot(
            # a request between chunks of its prefill is running too (vLLM counts it so)
            num_running=len(e.scheduler.running) + len(e.scheduler.prefilling),
            num_waiting=len(e.scheduler.waiting),
            num_free_blocks=e.allocator.num_free_blocks, num_blocks=e.allocator.num_blocks,
            num_steps=e.timings.num_steps, spec=spec,
            num_prefix_queries=e.scheduler.num_prefix_queries,
            num_prefix_hits=e.scheduler.num_prefix_hits)

    @staticmethod
    def _deliver(items: list[tuple[_Request, object]]) -> None:
        """Hand outputs to their event loops: one thread-safe call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for req, item in items:
            by_loop[req.loop].append((req.outputs, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass


def _resolve(done: asyncio.Future) -> None:
    """On the event loop: a command the engine thread finished."""
    if not done.done():  # its awaiting handler may have been cancelled
        done.set_result(None)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
