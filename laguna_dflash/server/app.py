"""The FastAPI application: routes, bearer-token auth, OpenAI-shaped errors, engine lifespan."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from .chat import create_chat_completion
from .completions import create_completion
from .errors import APIError
from .metrics import CONTENT_TYPE
from .responses import create_response
from .serving import Serving
from .tokenization import detokenize, tokenize

logger = logging.getLogger(__name__)

#: Routes that stay open with ``--api-key`` (probes and scrapers carry no token).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


class BearerAuthMiddleware:
    """Pure ASGI middleware: 401 unless ``Authorization: Bearer <key>`` (except ``OPEN_PATHS``)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                      "<key>' with the key the server was started with")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _HTTPMiddleware:
    """Pure ASGI middleware: :meth:`handle` sees the HTTP requests; anything else (lifespan)
    passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class InternalErrorMiddleware(_HTTPMiddleware):
    """An unhandled exception becomes an OpenAI-shaped 500 for that request alone. Unlike an
    ``exception_handler(Exception)`` (Starlette answers, then re-raises, and uvicorn drops the
    connection) the exception stops here, so the client's keep-alive connection stays usable.
    One raised after the response started can only be logged."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:  # uvicorn logs it and closes the connection
                raise
            logger.exception("unhandled error on %s", scope.get("path"))
            error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
            await error.response()(scope, receive, send)


class RequestIdHeaderMiddleware(_HTTPMiddleware):
    """``--enable-request-id-headers`` (vLLM's): every HTTP response carries an
    ``X-Request-Id`` header, the request's own or a fresh random one."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers") or ()).get(b"x-request-id")
        value = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(serving: Serving) -> FastAPI:
    """The app around one :class:`Serving`; the engine thread runs for the app's lifespan."""
    engine = serving.engine

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="laguna-dflash", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(InternalErrorMiddleware)
    if serving.config.api_key:  # a 401 needs nothing inside
        app.add_middleware(BearerAuthMiddleware, api_key=serving.config.api_key)
    if serving.config.enable_request_id_headers:  # outermost: a 401 carries the id too
        app.add_middleware(RequestIdHeaderMiddleware)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(serving, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(serving, request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(serving, request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        names = dict.fromkeys([serving.model_name, *serving.config.served_model_aliases])
        cards = [{"id": name, "object": "model", "created": serving.created,
                  "owned_by": "laguna-dflash", "root": serving.config.engine.model, "parent": None,
                  "max_model_len": serving.max_model_len} for name in names]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return await tokenize(serving, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return await detokenize(serving, request)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return APIError(503, "the engine loop is not running").response()
        snap = engine.snapshot
        return JSONResponse({"status": "ok", "num_requests_running": snap.num_running,
                             "num_requests_waiting": snap.num_waiting,
                             "kv_cache_free_blocks": snap.num_free_blocks,
                             "kv_cache_total_blocks": snap.num_blocks})

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(engine.snapshot), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/load")  # vLLM's: requests in flight
    async def load() -> JSONResponse:
        snap = engine.snapshot
        return JSONResponse({"server_load": snap.num_running + snap.num_waiting})

    @app.get("/get_model_info")  # SGLang's
    async def model_info() -> JSONResponse:
        return JSONResponse({"model_path": serving.config.engine.model,
                             "tokenizer_path": serving.config.tokenizer, "is_generation": True})

    @app.post("/reset_prefix_cache")  # vLLM's
    @app.post("/flush_cache")  # SGLang's: benchmarks call it between runs
    async def reset_prefix_cache() -> Response:
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        snap = engine.snapshot
        info = serving.config.describe()
        info.update(max_model_len=serving.max_model_len,
                    num_speculative_tokens=serving.num_speculative_tokens, version=__version__)
        spec = snap.spec
        accept_length = (1 + spec.num_accepted_tokens / spec.num_drafts
                         if spec is not None and spec.num_drafts else None)
        info["internal_states"] = [{"avg_spec_accept_length": accept_length,
                                    "num_running_reqs": snap.num_running,
                                    "num_queue_reqs": snap.num_waiting}]
        return JSONResponse(info)

    return app
