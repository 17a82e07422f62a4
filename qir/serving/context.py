"""What the routes of one app share: the engine, the name it is served under, the tokenizing
worker, the metrics, and whether the server is draining."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from qir.serving.engine import Engine
from qir.serving.metrics import Metrics
from qir.serving.tokenizing import TextWorker


@dataclass
class Context:
    engine: Engine
    name: str
    text: TextWorker
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set when shutdown starts: new requests get 503
