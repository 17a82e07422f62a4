"""The OpenAPI document's request bodies and responses. The routes read their bodies themselves
(so that errors name the field, and a body sent without a Content-Type is served), so FastAPI
does not see them: `body_of` declares a route's body, `refusals` its answers (the success body,
and the error object under each status the server refuses with), and `install` puts the body
schemas into the document's components."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel

from qir.serving import schemas as s

# The schemas to add to the document's components: (model, "validation" for a request body or
# "serialization" for what the server sends).
_SCHEMAS: dict[str, tuple[type[BaseModel], Literal["validation", "serialization"]]] = {}
_REF = "#/components/schemas/{model}"

# Every status a route may refuse with, and why.
ERRORS = {
    400: "A bad request: the field is named in `param`",
    401: "A missing or wrong API key (only where the server has one)",
    404: "Another model's name",
    413: "A body over the server's limit",
    429: "The queue is full: try again after Retry-After seconds",
    500: "An unexpected failure (the server's log has the details)",
    503: "The server is shutting down",
}


def body_of(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is one of `models`."""
    refs = []
    for model in models:
        _SCHEMAS[model.__name__] = (model, "validation")
        refs.append({"$ref": _REF.format(model=model.__name__)})
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def refusals(
    ok: type[BaseModel] | None = None,
    chunk: type[BaseModel] | None = None,
    errors: tuple[int, ...] = tuple(ERRORS),
) -> dict[int | str, dict[str, Any]]:
    """A route's `responses`: `ok` on 200 (as server-sent events of `chunk`s where it streams),
    the error object on each of `errors`."""
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": s.ErrorResponse, "description": ERRORS[code]} for code in errors
    }
    if ok is not None:
        out[200] = {"model": ok, "description": "The answer"}
        if chunk is not None:
            _SCHEMAS[chunk.__name__] = (chunk, "serialization")
            out[200]["description"] += (
                f"; with `stream`, server-sent events, each `data: ` a {chunk.__name__} "
                "then `data: [DONE]`"
            )
            out[200]["content"] = {"text/event-stream": {"schema": _event(chunk)}}
    return out


def install(app: FastAPI) -> None:
    """Make the app's document carry the schemas of the bodies and chunks its routes
    declared."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build()
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, (model, mode) in _SCHEMAS.items():
            schema = model.model_json_schema(ref_template=_REF, mode=mode)
            components.update(schema.pop("$defs", {}))
            components[name] = schema
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1: `schema` describes each event): a
    `chunk`, an error object, or the closing [DONE]."""
    payload = {
        "anyOf": [
            {"$ref": _REF.format(model=chunk.__name__)},
            {"$ref": _REF.format(model=s.ErrorResponse.__name__)},
        ]
    }
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }
