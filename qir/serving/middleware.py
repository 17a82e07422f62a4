"""The guard in front of every route: 503 while the server drains (but /metrics, to watch the
drain), the API key (on /v1 only: /health stays open to probes), and the body: 413 past the
size limit before anything is parsed, 408 where it does not come whole within the body
timeout. The body is read whole here and replayed to the route."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qir.serving.errors import ApiError

# Routes that answer while the server drains.
WHILE_DRAINING = ("/metrics",)


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body: int,
        body_timeout: float,
        draining: Callable[[], bool],
    ) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining() and scope["path"] not in WHILE_DRAINING:
            closing = {"Connection": "close"}
            error = ApiError(
                503, "the server is shutting down", None, "shutting_down", "server_error", closing
            )
            await error.send(scope, receive, send)
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
                await ApiError(401, message, code="invalid_api_key").send(scope, receive, send)
                return
        too_large = ApiError(
            413, f"request body over {self.max_body} bytes", code="request_too_large"
        )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await too_large.send(scope, receive, send)
            return
        body, more = [], True
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        try:
            while more:
                got = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                if got["type"] != "http.request":
                    return  # the client left before its body came
                body.append(got.get("body", b""))
                size += len(body[-1])
                more = got.get("more_body", False)
                if size > self.max_body:
                    await too_large.send(scope, receive, send)
                    return
        except TimeoutError:
            message = f"the request body did not come whole within {self.body_timeout:g} s"
            slow = ApiError(408, message, None, "request_timeout", headers={"Connection": "close"})
            await slow.send(scope, receive, send)
            return
        whole: list[Message] = [
            {"type": "http.request", "body": b"".join(body), "more_body": False}
        ]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)
