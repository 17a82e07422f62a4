"""The OpenAI-compatible HTTP server in front of an Engine: an ASGI app (FastAPI on Starlette,
run by uvicorn) with /v1/chat/completions, /v1/completions (both streamed over server-sent
events or not), /v1/models and /health.

Every refusal is an OpenAI-style error object, `{"error": {"message", "type", "param",
"code"}}`, never a traceback: 400 for a bad request (the field named in `param`: a pydantic
validation error, a prompt past the context, a value qir does not do), 401 for a missing or
wrong API key (on /v1 only: /health stays open to probes), 404 for another model's name, 413
for a body over the limit, 429 when the engine's queue is full, 503 while shutting down, 500
with a short message for anything unexpected (its traceback goes to the server's log).

A client that goes away (an http.disconnect, or a send that fails) cancels its Stream, streamed
or not, so the engine stops working on it."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qir.errors import UsageError
from qir.serving import schemas as s
from qir.serving.engine import Delta, Engine, EngineClosed, QueueFull, Request, Stream

LOG = logging.getLogger("qir.serving")
# Request bodies past this many bytes are refused (413) before they are parsed.
DEFAULT_MAX_BODY = 4 << 20
T = TypeVar("T")


class ApiError(Exception):
    """A refusal, as the OpenAI API spells them."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = s.ErrorResponse(
            error=s.ErrorBody(message=message, type=type, param=param, code=code)
        )

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body.model_dump(), self.status, headers=headers)


def create_app(
    engine: Engine,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
) -> FastAPI:
    """The server's ASGI app. It starts the engine when it starts and drains it when it
    stops (the requests that run finish, new ones are refused)."""
    name = served_model_name or engine.name
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(drain=True)

    app = FastAPI(title="qir", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(_Guard, api_key=api_key, max_body=max_body_bytes)

    @app.exception_handler(ApiError)
    async def _refused(request: HttpRequest, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http(request: HttpRequest, e: HTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail), code=None).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: HttpRequest, e: Exception) -> JSONResponse:
        # Starlette raises `e` again once this is sent: uvicorn logs its traceback.
        message = f"internal error ({type(e).__name__}); the server's log has the details"
        return ApiError(500, message, type="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "model": name}

    @app.get("/v1/models")
    async def models() -> s.ModelList:
        return s.ModelList(
            data=[s.ModelCard(id=name, created=created, max_model_len=engine.max_seq)]
        )

    # The bodies are parsed here, not by FastAPI, so that a client that leaves out
    # `Content-Type: application/json` (curl -d) is served, and errors name the field.
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: HttpRequest) -> Response:
        body = _parse(s.ChatCompletionRequest, await request.body())
        _check_common(body, name)
        try:
            prompt = engine.chat_ids(body.template_messages())
        except UsageError as e:
            raise ApiError(400, _named("messages", e), "messages") from None
        return await _generate(engine, request, body, prompt, "messages", _Chat(name))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: HttpRequest) -> Response:
        body = _parse(s.CompletionRequest, await request.body())
        _check_common(body, name)
        text = body.one_prompt()
        if text is None:
            raise ApiError(
                400, f"prompt: one prompt per request (got {len(body.prompt)})", "prompt"
            )
        try:
            prompt = engine.prompt_ids(text) if isinstance(text, str) else tuple(text)
        except UsageError as e:
            n = len(engine.tokenizer.encode(text)) if isinstance(text, str) else len(text)
            raise _prompt_error(engine, e, n, "prompt") from None
        return await _generate(engine, request, body, prompt, "prompt", _Text(name))

    return app


B = TypeVar("B", bound=s.GenerationRequest)


def _parse(schema: type[B], raw: bytes) -> B:
    try:
        return schema.model_validate_json(raw)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


def _check_common(body: s.GenerationRequest, name: str) -> None:
    refused = body.refused()
    if refused is not None:
        raise ApiError(400, refused[1], refused[0], "unsupported_parameter")
    if body.model not in (None, name):
        raise ApiError(
            404,
            f"model: this server serves {name!r}, not {body.model!r}",
            "model",
            "model_not_found",
        )


def _named(field: str, e: Exception) -> str:
    message = str(e)
    return message if message.startswith(f"{field}:") else f"{field}: {message}"


def _prompt_error(engine: Engine, e: UsageError, n: int, field: str) -> ApiError:
    if n > engine.max_seq:
        message = f"{field}: {n} tokens, more than the model's context of {engine.max_seq}"
        return ApiError(400, message, field, "context_length_exceeded")
    return ApiError(400, _named(field, e), field)


def _sampling(engine: Engine, body: s.GenerationRequest) -> Any:
    try:
        return engine.sampling(**body.sampling_options())
    except UsageError as e:
        field = str(e).split(" ", 1)[0]
        raise ApiError(
            400, str(e), field if field in s.GenerationRequest.model_fields else None
        ) from None


async def _generate(
    engine: Engine,
    request: HttpRequest,
    body: s.GenerationRequest,
    prompt: tuple[int, ...],
    prompt_field: str,
    fmt: _Format,
) -> Response:
    sampling = _sampling(engine, body)
    try:  # the prompt alone first, so that a refusal names the right field
        engine.check(Request(prompt, 1, sampling))
    except UsageError as e:
        raise _prompt_error(engine, e, len(prompt), prompt_field) from None
    limit, limit_field = body.token_limit()
    max_tokens = limit if limit is not None else max(1, engine.max_seq - len(prompt))
    try:
        stream = engine.submit(
            Request(prompt, max_tokens, sampling, body.stop_strings, body.ignore_eos)
        )
    except UsageError as e:
        raise ApiError(
            400, _named(limit_field, e), limit_field, "context_length_exceeded"
        ) from None
    except QueueFull as e:
        raise ApiError(
            429, f"the server is busy: {e}", None, "rate_limit_exceeded", "requests"
        ) from None
    except EngineClosed as e:
        raise ApiError(503, str(e), None, "shutting_down", "server_error") from None
    if body.stream:
        events = _events(stream, fmt, len(prompt), body.include_usage)
        return _EventStream(stream, events)
    try:
        text, n, finish, error = await _until_disconnect(_collect(stream), request.receive)
    except _Gone:
        return Response(status_code=499)  # no one reads it
    finally:
        if not stream.done:
            stream.cancel()
    if finish == "error":
        raise ApiError(500, f"generation failed: {error}", type="server_error")
    usage = s.Usage(prompt_tokens=len(prompt), completion_tokens=n, total_tokens=len(prompt) + n)
    return JSONResponse(fmt.whole(text, finish or "stop", usage).model_dump(mode="json"))


async def _collect(stream: Stream) -> tuple[str, int, str | None, str | None]:
    parts, n = [], 0
    last: Delta | None = None
    async for last in stream:
        parts.append(last.text)
        n += len(last.token_ids)
    finish = last.finish_reason if last is not None else None
    return "".join(parts), n, finish, last.error if last is not None else None


# Response bodies and stream chunks of the two endpoints.


class _Format:
    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    prefix = ""

    def start(self) -> Any | None:
        return None

    def piece(self, text: str) -> Any:
        raise NotImplementedError

    def end(self, finish: str) -> Any:
        raise NotImplementedError

    def usage(self, usage: s.Usage) -> Any:
        raise NotImplementedError

    def whole(self, text: str, finish: str, usage: s.Usage) -> Any:
        raise NotImplementedError


class _Chat(_Format):
    prefix = "chatcmpl"

    def _chunk(self, delta: s.ChatDelta, finish: str | None = None) -> s.ChatCompletionChunk:
        choice = s.ChatChunkChoice(delta=delta, finish_reason=finish)
        return s.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def start(self) -> s.ChatCompletionChunk:
        return self._chunk(s.ChatDelta(role="assistant", content=""))

    def piece(self, text: str) -> s.ChatCompletionChunk:
        return self._chunk(s.ChatDelta(content=text))

    def end(self, finish: str) -> s.ChatCompletionChunk:
        return self._chunk(s.ChatDelta(), finish)

    def usage(self, usage: s.Usage) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, text: str, finish: str, usage: s.Usage) -> s.ChatCompletion:
        choice = s.ChatChoice(message=s.ChatMessage(content=text), finish_reason=finish)
        return s.ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        )


class _Text(_Format):
    prefix = "cmpl"

    def _chunk(self, text: str, finish: str | None = None) -> s.Completion:
        choice = s.CompletionChoice(text=text, finish_reason=finish)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def piece(self, text: str) -> s.Completion:
        return self._chunk(text)

    def end(self, finish: str) -> s.Completion:
        return self._chunk("", finish)

    def usage(self, usage: s.Usage) -> s.Completion:
        return s.Completion(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, text: str, finish: str, usage: s.Usage) -> s.Completion:
        return s.Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[s.CompletionChoice(text=text, finish_reason=finish)],
            usage=usage,
        )


def _event(data: Any, include_usage: bool = True) -> str:
    if isinstance(data, str):
        return f"data: {data}\n\n"
    # Chunks carry "usage": null only where the client asked for usage (as OpenAI's do).
    payload = data.model_dump_json(exclude=None if include_usage else {"usage"})
    return f"data: {payload}\n\n"


async def _events(
    stream: Stream, fmt: _Format, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    first = fmt.start()
    if first is not None:
        yield _event(first, include_usage)
    n = 0
    async for delta in stream:
        n += len(delta.token_ids)
        if delta.finish_reason == "error":
            error = ApiError(500, f"generation failed: {delta.error}", type="server_error")
            yield _event(error.body.model_dump_json())
            break
        if delta.text:
            yield _event(fmt.piece(delta.text), include_usage)
        if delta.finish_reason is not None:
            yield _event(fmt.end(delta.finish_reason), include_usage)
            if include_usage:
                total = prompt_tokens + n
                usage = s.Usage(
                    prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=total
                )
                yield _event(fmt.usage(usage))
    yield _event("[DONE]")


class _Gone(Exception):
    """The client disconnected."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result, unless the client disconnects first (_Gone; `work` is cancelled). A
    send to a closed connection (OSError) counts as a disconnect too."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this request's own task is cancelled
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise _Gone
    try:
        return task.result()
    except OSError:
        raise _Gone from None


class _EventStream(StreamingResponse):
    """Server-sent events that cancel their Stream when the client goes away mid-stream."""

    def __init__(self, stream: Stream, events: AsyncIterator[str]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.stream = stream
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _until_disconnect(self.stream_response(send), receive)
        except _Gone:
            LOG.info("client went away: request cancelled")
        finally:
            if not self.stream.done:
                self.stream.cancel()
            await self.events.aclose()  # type: ignore[attr-defined]


# The guard in front of every route: the API key, the body size.


class _Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                message = (
                    "incorrect API key"
                    if given
                    else "an API key is required: Authorization: Bearer KEY"
                )
                await _send(ApiError(401, message, code="invalid_api_key"), scope, receive, send)
                return
        too_large = ApiError(
            413, f"request body over {self.max_body} bytes", code="request_too_large"
        )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _send(too_large, scope, receive, send)
            return
        body, more = [], True
        size = 0
        while more:
            got = await receive()
            if got["type"] != "http.request":
                return  # the client left before its body came
            body.append(got.get("body", b""))
            size += len(body[-1])
            more = got.get("more_body", False)
            if size > self.max_body:
                await _send(too_large, scope, receive, send)
                return
        whole: list[Message] = [
            {"type": "http.request", "body": b"".join(body), "more_body": False}
        ]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


async def _send(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    await error.response()(scope, receive, send)


# Pydantic's validation errors as one 400 naming the field.

# Parts of an error's location that name a union member or a validator, not a field.
_TAG = re.compile(r"^([A-Z]\w*|str|int|float|bool|.*[\[\](),-].*)$")


def _param(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif _TAG.match(str(part)):
            break
        else:
            parts.append(str(part))
    return ".".join(parts) or None


def _validation_error(errors: Any) -> ApiError:
    errors = list(errors)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({first.get('msg')})")
    param = _param(tuple(first.get("loc", ())))
    if param is None:
        return ApiError(400, f"the body: {first.get('msg')}; expected a JSON object")
    value = first.get("input")
    shown = json.dumps(value)[:80] if value is not None and first.get("type") != "missing" else ""
    return ApiError(
        400, f"{param}: {first.get('msg')}" + (f" (got {shown})" if shown else ""), param
    )


# Running the app.


class _Server(uvicorn.Server):
    """uvicorn's server, quiet about the signal that stopped it (uvicorn raises it again after
    its graceful shutdown, which would end `qir serve` with a signal's exit status after a clean
    drain), and telling `on_ready` the address it listens on (a port of 0 picks a free one)."""

    on_ready: Any = None

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_ready(url(host, port))


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), or a UsageError saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(app: FastAPI, sock: socket.socket, on_ready: Any = None, log_level: str = "info") -> None:
    """Serve on `sock` until Ctrl-C or SIGTERM, then drain: stop accepting, let running
    requests finish, stop the engine (a second Ctrl-C stops at once)."""
    server = _Server(uvicorn.Config(app, log_level=log_level))
    server.on_ready = on_ready
    server.run(sockets=[sock])


@contextmanager
def background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The app served on a thread (tests, benchmarks): its base URL while the block runs."""
    sock = listen(host, port)
    server = _Server(uvicorn.Config(app, log_level="warning"))
    ready: list[str] = []
    server.on_ready = ready.append
    thread = threading.Thread(target=server.run, args=([sock],), name="qir-http", daemon=True)
    thread.start()
    while not ready:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    try:
        yield ready[0]
    finally:
        server.should_exit = True
        thread.join()
