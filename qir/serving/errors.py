"""Refusals as the OpenAI API spells them: `{"error": {"message", "type", "param", "code"}}`,
and pydantic's validation errors as one such 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from qir.serving import schemas as s


class ApiError(Exception):
    """A refusal, as the OpenAI API spells them."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"
        self.body = s.ErrorResponse(
            error=s.ErrorBody(message=message, type=type, param=param, code=code)
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), self.status, headers=self.headers or None)

    async def send(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer with this error from ASGI code (middleware), outside FastAPI's handlers."""
        await self.response()(scope, receive, send)


B = TypeVar("B", bound=BaseModel)


def parse(schema: type[B], raw: bytes) -> B:
    """A request body as `schema`, or a 400 naming the first field that is wrong."""
    try:
        return schema.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def check_model(asked: str | None, served: str) -> None:
    """404 where a request names a model other than the one served."""
    if asked not in (None, served):
        raise ApiError(
            404,
            f"model: this server serves {served!r}, not {asked!r}",
            "model",
            "model_not_found",
        )


def too_long(context: int, at_least: int, field: str) -> ApiError:
    """A prompt refused before it was tokenized: more tokens than the context can be."""
    message = f"{field}: at least {at_least} tokens, more than the model's context of {context}"
    return ApiError(400, message, field, "context_length_exceeded")


def named(field: str, e: Exception) -> str:
    """`e`'s message, starting with the field it is about."""
    message = str(e)
    return message if message.startswith(f"{field}:") else f"{field}: {message}"


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


def validation_error(errors: Any) -> ApiError:
    """pydantic's errors (ValidationError.errors()) as one 400 naming the first one's field."""
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
