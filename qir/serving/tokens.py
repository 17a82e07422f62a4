"""/tokenize and /detokenize, as vLLM serves them: a prompt (or chat messages, through the chat
template) to its ids and their count, and ids back to text; in the tokenizing worker, with the
same cap as a completion's prompt."""

from __future__ import annotations

import pydantic_core
from fastapi import APIRouter
from fastapi import Request as HttpRequest

from qir.errors import UsageError
from qir.serving import schemas as s
from qir.serving.context import Context
from qir.serving.errors import ApiError, check_model, named, parse, too_long
from qir.serving.openapi import body_of, refusals
from qir.serving.tokenizing import PromptTooLong

# Neither route queues work for the engine: no 429.
_ERRORS = (400, 401, 404, 413, 500, 503)


def router(ctx: Context) -> APIRouter:
    api = APIRouter()

    @api.post(
        "/tokenize",
        response_model=None,
        openapi_extra=body_of(s.TokenizeCompletionRequest, s.TokenizeChatRequest),
        responses=refusals(s.TokenizeResponse, errors=_ERRORS),
    )
    async def tokenize(request: HttpRequest) -> s.TokenizeResponse:
        raw = await request.body()
        body: s.TokenizeCompletionRequest | s.TokenizeChatRequest
        field = "messages" if _has(raw, "messages") else "prompt"
        if field == "messages":
            body = parse(s.TokenizeChatRequest, raw)
        else:
            body = parse(s.TokenizeCompletionRequest, raw)
        check_model(body.model, ctx.name)
        try:
            if isinstance(body, s.TokenizeChatRequest):
                ids = await ctx.text.chat(body.template_messages(), body.add_generation_prompt)
            else:
                ids = await ctx.text.encode(body.prompt, body.add_special_tokens)
        except UsageError as e:
            raise ApiError(400, named(field, e), field) from None
        except PromptTooLong as e:
            raise too_long(ctx.engine.max_seq, e.at_least, field) from None
        return s.TokenizeResponse(
            count=len(ids), max_model_len=ctx.engine.max_seq, tokens=list(ids)
        )

    @api.post(
        "/detokenize",
        response_model=None,
        openapi_extra=body_of(s.DetokenizeRequest),
        responses=refusals(s.DetokenizeResponse, errors=_ERRORS),
    )
    async def detokenize(request: HttpRequest) -> s.DetokenizeResponse:
        body = parse(s.DetokenizeRequest, await request.body())
        check_model(body.model, ctx.name)
        vocab = ctx.engine.model.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            message = (
                f"tokens.[{bad}]: {body.tokens[bad]} is outside the vocabulary (0..{vocab - 1})"
            )
            raise ApiError(400, message, f"tokens.[{bad}]")
        return s.DetokenizeResponse(prompt=await ctx.text.decode(body.tokens))

    return api


def _has(raw: bytes, key: str) -> bool:
    """Whether `raw` is a JSON object with `key` (anything else: parsed as the other kind)."""
    try:
        value = pydantic_core.from_json(raw)
    except ValueError:
        return False
    return isinstance(value, dict) and key in value
