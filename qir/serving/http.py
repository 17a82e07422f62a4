"""The OpenAI-compatible HTTP server in front of an Engine: an ASGI app (FastAPI on Starlette,
run by uvicorn) with /v1/chat/completions, /v1/completions (both streamed over server-sent
events or not), /v1/models, and vLLM's /tokenize, /detokenize, /version, /metrics and /health.
This module assembles it; its parts:

    completions   the two generation endpoints (a body in, the engine's deltas out)
    responses     OpenAI's response bodies and stream chunks
    sse           a generation as server-sent events
    disconnect    a client that goes away
    tokenizing    tokenizer and chat template in a worker process, prompts capped first
    tokens        /tokenize, /detokenize
    info          /health, /version, /v1/models, /metrics
    metrics       Prometheus metrics under vLLM's names
    openapi       request bodies and refusals in the OpenAPI document
    middleware    the API key, the body limit and draining, in front of every route
    errors        refusals as OpenAI error objects
    server        uvicorn: serve on a socket, or on a thread (tests, benchmarks)

Every refusal is an OpenAI-style error object, `{"error": {"message", "type", "param",
"code"}}`, never a traceback: 400 for a bad request (the field named in `param`: a pydantic
validation error, a prompt past the context, a value qir does not do), 401 for a missing or
wrong API key (on /v1 only: /health stays open to probes), 404 for another model's name, 413
for a body over the limit, 429 when the engine's queue is full (with Retry-After), 503 while
shutting down, 500 with a short message for anything unexpected (its traceback goes to the
server's log).

A client that goes away (an http.disconnect, or a send that fails) cancels its Stream, streamed
or not, so the engine stops working on it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from qir.serving import completions, info, openapi, tokens
from qir.serving.context import Context
from qir.serving.engine import Engine
from qir.serving.errors import ApiError
from qir.serving.metrics import Metrics
from qir.serving.middleware import Guard
from qir.serving.server import background, listen, serve, url
from qir.serving.timeouts import Timeouts
from qir.serving.tokenizing import TextWorker, longest_piece

__all__ = ["DEFAULT_MAX_BODY", "Timeouts", "background", "create_app", "listen", "serve", "url"]

LOG = logging.getLogger("qir.serving")

# Request bodies past this many bytes are refused (413) before they are parsed.
DEFAULT_MAX_BODY = 4 << 20


def create_app(
    engine: Engine,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    timeouts: Timeouts | None = None,
) -> FastAPI:
    """The server's ASGI app. It starts the engine when it starts and drains it when it
    stops (the requests that run finish, new ones are refused); qir.serving.server runs it
    with `timeouts`."""
    name = served_model_name or engine.name
    text = TextWorker(engine.model.checkpoint.path, engine.max_seq, longest_piece(engine.tokenizer))
    ctx = Context(engine, name, text, Metrics(engine, name))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        text.start()
        engine.start()
        try:
            yield
            ctx.draining = True
            await engine.shutdown(drain=True)
        finally:
            text.close()

    app = FastAPI(
        title="qir", version=info.qir_version(), lifespan=lifespan, docs_url=None, redoc_url=None
    )
    timeouts = timeouts or Timeouts()
    app.state.context = ctx
    app.state.timeouts = timeouts
    app.state.drain = lambda seconds: _drain(ctx, seconds)
    app.state.kill = text.kill
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body=max_body_bytes,
        body_timeout=timeouts.body,
        draining=lambda: ctx.draining,
    )

    @app.exception_handler(ApiError)
    async def _refused(request: HttpRequest, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http(request: HttpRequest, e: HTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail), headers=e.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: HttpRequest, e: Exception) -> JSONResponse:
        # Starlette raises `e` again once this is sent: uvicorn logs its traceback.
        message = f"internal error ({type(e).__name__}); the server's log has the details"
        return ApiError(500, message, type="server_error").response()

    for part in (info, tokens, completions):
        app.include_router(part.router(ctx))
    openapi.install(app)
    return app


async def _drain(ctx: Context, seconds: float) -> None:
    """Refuse new requests (503) and wait for the engine to finish those it has, for at most
    `seconds`; then end what still runs with an error."""
    ctx.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while ctx.engine.busy and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if ctx.engine.busy:
        LOG.warning("drain: requests still running after %g s: ended", seconds)
        ctx.engine.abort(f"the server shut down (requests still running after {seconds:g} s)")
        while ctx.engine.busy:
            await asyncio.sleep(0.01)
