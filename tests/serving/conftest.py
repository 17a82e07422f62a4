"""A real `qir serve` app (uvicorn on a free loopback port, the host backend, a fixture with a
tokenizer and a chat template) shared by a test module, and the official OpenAI client."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from qir.dtypes import F32
from qir.models import Model
from qir.serving import Engine, Request, Stream
from tests.conftest import DATA, LAUNCH_HEAVY_OPT

FIXTURE = DATA / "mlx_affine4_g64_S"  # Metaspace BPE, [INST] chat template, greedy by default
# The served model computes in f32 (the checkpoint's own bf16 is `qir serve`'s default): these
# tests are about the server, and the host backend's f32 GEMVs are 6 times faster than its
# emulated bf16 pair arithmetic (schemathesis alone sends ~1700 requests). bf16 kernels have
# their own tests (tests/runtime, tests/models).
ACT = F32
NAME = FIXTURE.name
API_KEY = "sk-qir-test"
MAX_BODY = 16 << 10


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    engine: Engine
    streams: list[Stream] = field(default_factory=list)  # every Stream the engine handed out
    app: Any = None
    clients: dict[str, Any] = field(default_factory=dict)

    def client(self, api_key: str = API_KEY) -> object:
        """One client per key, kept: each new one builds an SSL context (~50 ms of CPU)."""
        from openai import OpenAI

        if api_key not in self.clients:
            url = f"{self.url}/v1"
            self.clients[api_key] = OpenAI(
                base_url=url, api_key=api_key, max_retries=0, timeout=120
            )
        return self.clients[api_key]

    def async_client(self) -> object:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def serve(
    max_queue: int = 64, max_seq: int | None = None, fixture: Path = FIXTURE, **options: Any
) -> Iterator[Served]:
    """The fixture (or a variant of it) served (options: create_app's)."""
    from qir.serving.http import background, create_app

    with pytest.MonkeyPatch.context() as mp:  # the backend reads it as the engine loads
        mp.setenv("QIR_HOST_OPT", LAUNCH_HEAVY_OPT)  # ~1700 requests' launches
        engine = Engine.load(fixture, backend="host", act=ACT, max_queue=max_queue, max_seq=max_seq)
    served = Served("", engine)
    submit = engine.submit

    def spy(request: Request) -> Stream:  # the streams, to see what the engine was told
        stream = submit(request)
        served.streams.append(stream)
        return stream

    engine.submit = spy  # type: ignore[method-assign]
    app = create_app(engine, **{"api_key": API_KEY, "max_body_bytes": MAX_BODY, **options})
    served.app = app
    with background(app) as url:
        served.url = url
        yield served


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    yield from serve()


@pytest.fixture(scope="module")
def reference() -> Model:
    """The same checkpoint and options, run alone: what `qir generate` prints."""
    return Model.load(FIXTURE, backend="host", act=ACT)
