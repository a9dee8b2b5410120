"""Build the server from a :class:`ServerConfig` and run it (foreground or in a thread)."""

from __future__ import annotations

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


def serve(config: ServerConfig) -> int:
    """Run the server in the foreground until interrupted."""
    app = build_app(build_serving(config))
    logger.info("serving %s on http://%s:%d", config.served_model_name, config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                timeout_graceful_shutdown=5)
    return 0


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
