"""The routes about the server rather than generation: /health (open to probes), /version,
/v1/models, /v1/models/{id} and /metrics (Prometheus' text format)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import generate_latest

from qir.serving import schemas as s
from qir.serving.context import Context
from qir.serving.errors import ApiError
from qir.serving.metrics import CONTENT_TYPE
from qir.serving.openapi import refusals


def qir_version() -> str:
    try:
        return version("qir")
    except PackageNotFoundError:  # a source tree that was not installed
        return "unknown"


def router(ctx: Context) -> APIRouter:
    api = APIRouter()

    def card() -> s.ModelCard:
        return s.ModelCard(id=ctx.name, created=ctx.created, max_model_len=ctx.engine.max_seq)

    @api.get("/health", responses=refusals(errors=(503,)))
    async def health() -> dict[str, str]:
        if ctx.draining:
            raise ApiError(
                503, "the server is shutting down", None, "shutting_down", "server_error"
            )
        return {"status": "ok", "model": ctx.name}

    @api.get("/version")
    async def get_version() -> s.Version:
        return s.Version(version=qir_version())

    @api.get("/v1/models", responses=refusals(errors=(401,)))
    async def models() -> s.ModelList:
        return s.ModelList(data=[card()])

    @api.get("/v1/models/{model_id:path}", responses=refusals(errors=(401, 404)))
    async def model(model_id: str) -> s.ModelCard:
        if model_id != ctx.name:
            raise ApiError(
                404,
                f"model: this server serves {ctx.name!r}, not {model_id!r}",
                "model",
                "model_not_found",
            )
        return card()

    @api.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE)

    return api
