"""How long the server waits on a client, and on itself when it stops (qir.serving.server and
the middleware apply them; `qir serve`'s --*-timeout options set them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    """Seconds."""

    idle: float = 5.0  # a connection without a request in flight (uvicorn's keep-alive)
    header: float = 10.0  # a request's head, from the connection or the previous response
    body: float = 30.0  # a request's body, from its head
    drain: float = 30.0  # what runs at the first signal finishes within
