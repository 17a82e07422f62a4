"""/v1/chat/completions and /v1/completions: a body in, a Request to the engine, its deltas out
as one response or as server-sent events (qir.serving.sse)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from qir.errors import UsageError
from qir.serving import schemas as s
from qir.serving.context import Context
from qir.serving.disconnect import Gone, until_disconnect
from qir.serving.engine import Delta, Engine, EngineClosed, QueueFull, Request, Stream
from qir.serving.errors import ApiError, check_model, named, parse, too_long
from qir.serving.openapi import body_of, refusals
from qir.serving.responses import Chat, Format, Text
from qir.serving.sse import EventStream, events
from qir.serving.tokenizing import PromptTooLong

# Seconds a client refused for a full queue is told to wait before it tries again.
RETRY_AFTER = 1


def router(ctx: Context) -> APIRouter:
    """The two endpoints of the context's engine."""
    api = APIRouter()
    engine, name = ctx.engine, ctx.name

    # The bodies are parsed here, not by FastAPI, so that a client that leaves out
    # `Content-Type: application/json` (curl -d) is served, and errors name the field.
    @api.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=body_of(s.ChatCompletionRequest),
        responses=refusals(s.ChatCompletion, s.ChatCompletionChunk),
    )
    async def chat(request: HttpRequest) -> Response:
        body = parse(s.ChatCompletionRequest, await request.body())
        _check_common(body, name)
        try:
            prompt = await ctx.text.chat(body.template_messages())
        except UsageError as e:
            raise ApiError(400, named("messages", e), "messages") from None
        except PromptTooLong as e:
            raise too_long(engine.max_seq, e.at_least, "messages") from None
        return await _generate(ctx, request, body, prompt, "messages", Chat(name))

    @api.post(
        "/v1/completions",
        response_model=None,
        openapi_extra=body_of(s.CompletionRequest),
        responses=refusals(s.Completion, s.Completion),
    )
    async def completions(request: HttpRequest) -> Response:
        body = parse(s.CompletionRequest, await request.body())
        _check_common(body, name)
        text = body.one_prompt()
        if text is None:
            raise ApiError(
                400, f"prompt: one prompt per request (got {len(body.prompt)})", "prompt"
            )
        try:
            prompt = await ctx.text.encode(text) if isinstance(text, str) else tuple(text)
        except PromptTooLong as e:
            raise too_long(engine.max_seq, e.at_least, "prompt") from None
        return await _generate(ctx, request, body, prompt, "prompt", Text(name))

    return api


def _check_common(body: s.GenerationRequest, name: str) -> None:
    refused = body.refused()
    if refused is not None:
        raise ApiError(400, refused[1], refused[0], "unsupported_parameter")
    check_model(body.model, name)


def _prompt_error(engine: Engine, e: UsageError, n: int, field: str) -> ApiError:
    if n > engine.max_seq:
        message = f"{field}: {n} tokens, more than the model's context of {engine.max_seq}"
        return ApiError(400, message, field, "context_length_exceeded")
    return ApiError(400, named(field, e), field)


def _sampling(engine: Engine, body: s.GenerationRequest) -> Any:
    try:
        return engine.sampling(**body.sampling_options())
    except UsageError as e:
        field = str(e).split(" ", 1)[0]
        raise ApiError(
            400, str(e), field if field in s.GenerationRequest.model_fields else None
        ) from None


async def _generate(
    ctx: Context,
    request: HttpRequest,
    body: s.GenerationRequest,
    prompt: tuple[int, ...],
    prompt_field: str,
    fmt: Format,
) -> Response:
    engine = ctx.engine
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
        raise ApiError(400, named(limit_field, e), limit_field, "context_length_exceeded") from None
    except QueueFull as e:
        raise ApiError(
            429,
            f"the server is busy: {e}",
            None,
            "rate_limit_exceeded",
            "requests",
            headers={"Retry-After": str(RETRY_AFTER)},
        ) from None
    except EngineClosed as e:
        raise ApiError(503, str(e), None, "shutting_down", "server_error") from None
    if body.stream:
        return EventStream(
            stream, events(stream, fmt, len(prompt), body.include_usage), ctx.metrics
        )
    try:
        text, n, finish, error = await until_disconnect(_collect(stream), request.receive)
    except Gone:
        return Response(status_code=499)  # no one reads it
    finally:
        if not stream.done:
            stream.cancel()
        ctx.metrics.finished(stream)
    if finish == "error" and ctx.draining:
        raise ApiError(503, f"generation ended: {error}", None, "shutting_down", "server_error")
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
