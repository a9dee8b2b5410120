"""Build the server from a :class:`ServerConfig` and run it (foreground or in a thread)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from ..engine.engine import LLMEngine
from ..llm import load_tokenizer
from .app import build_app
from .args import ServerConfig
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .serving import Serving

logger = logging.getLogger(__name__)


def build_serving(config: ServerConfig, engine: LLMEngine | None = None,
                  tokenizer: Any = None) -> Serving:
    """Load the engine and tokenizer (unless given) and wire them to a :class:`Serving`."""
    if engine is None:
        engine = LLMEngine(config.engine)
    if tokenizer is None and config.tokenizer:
        tokenizer = load_tokenizer(config.tokenizer)
    if tokenizer is None:
        logger.warning("no tokenizer in %s: only token-id prompts on /v1/completions will work",
                       config.tokenizer)
    metrics = ServerMetrics(config.served_model_name)
    return Serving(AsyncEngine(engine, metrics, config.log_stats_interval_s), tokenizer, config)


def freeze_startup_heap() -> int:
    """``gc.collect(); gc.freeze()``: every object alive once the server is built (modules, the
    models' Python objects, captured graphs, the tokenizer) moves to the collector's permanent
    generation, which no collection scans again (vLLM 0.34's engine core and API server call
    their ``freeze_gc_heap`` at start-up too).
    Without it, each full collection a long-running server triggers walks that whole heap while a
    step waits: ~150 ms for a 40-layer engine's ~305k start-up objects on a 2-core CPU VM, against
    ~0 ms once frozen (``benchmarks/host_timeline.py --gc-freeze``, docs/PERFORMANCE.md,
    sixty-seventh pass). Frozen objects are never collected: only a process that exists to serve
    calls this. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    logger.info("froze the start-up heap for the garbage collector (%d objects)", count)
    return count


def serve(config: ServerConfig, watch_interval_s: float = 0.5) -> int:
    """Run the server in the foreground until interrupted (exit code 0), or until the engine
    loop dies (exit code 1): a server that can only answer 503 shuts down, so that a supervisor
    restarts it instead of probing a zombie (vLLM's API server does the same).

    With tensor parallelism every rank runs this: rank 0 serves, the others follow its engine
    (:meth:`LLMEngine.follow`) until it stops. Every rank freezes its start-up heap
    (:func:`freeze_startup_heap`) before the first request."""
    engine = LLMEngine(config.engine)
    if not engine.tp.is_driver:
        freeze_startup_heap()
        engine.follow()
        return 0
    serving = build_serving(config, engine)
    freeze_startup_heap()
    server = uvicorn.Server(uvicorn.Config(build_app(serving), host=config.host, port=config.port,
                                           log_level=config.uvicorn_log_level,
                                           timeout_graceful_shutdown=5))
    engine = serving.engine
    stopped = threading.Event()

    def watch() -> None:
        while not stopped.wait(watch_interval_s):
            if engine.fatal_error is not None:
                logger.error("the engine loop died (%s: %s); shutting the server down",
                             type(engine.fatal_error).__name__, engine.fatal_error)
                server.should_exit = True
                return

    threading.Thread(target=watch, name="engine-watchdog", daemon=True).start()
    logger.info("serving %s on http://%s:%d", config.served_model_name, config.host, config.port)
    try:
        server.run()
    finally:
        stopped.set()
    return 1 if engine.fatal_error is not None else 0


class ServerThread:
    """A live server in a background thread (tests, notebooks); ``port=0`` picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=5))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
