"""The routes about the server rather than generation: /health (open to probes) and
/v1/models."""

from __future__ import annotations

import time

from fastapi import APIRouter

from qir.serving import schemas as s
from qir.serving.engine import Engine


def router(engine: Engine, name: str) -> APIRouter:
    api = APIRouter()
    created = int(time.time())

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "model": name}

    @api.get("/v1/models")
    async def models() -> s.ModelList:
        return s.ModelList(
            data=[s.ModelCard(id=name, created=created, max_model_len=engine.max_seq)]
        )

    return api
