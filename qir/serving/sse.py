"""A generation streamed as server-sent events: a `data: {chunk}` event per piece of text, the
finish chunk, the usage chunk where the client asked for it, then `data: [DONE]`; a failed
generation ends with an error event. The stream is cancelled when the client goes away."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from qir.serving import schemas as s
from qir.serving.disconnect import Gone, until_disconnect
from qir.serving.engine import Stream
from qir.serving.errors import ApiError
from qir.serving.metrics import Metrics
from qir.serving.responses import Format

LOG = logging.getLogger("qir.serving")


def _event(data: Any, include_usage: bool = True) -> str:
    if isinstance(data, str):
        return f"data: {data}\n\n"
    # Chunks carry "usage": null only where the client asked for usage (as OpenAI's do).
    payload = data.model_dump_json(exclude=None if include_usage else {"usage"})
    return f"data: {payload}\n\n"


async def events(
    stream: Stream, fmt: Format, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    first = fmt.start()
    if first is not None:
        yield _event(first, include_usage)
    n = 0
    async for delta in stream:
        n += len(delta.token_ids)
        if delta.finish_reason == "error":
            error = ApiError(500, f"generation failed: {delta.error}", type="server_error")
            yield _event(error.body.model_dump_json())
            break
        if delta.text:
            yield _event(fmt.piece(delta.text), include_usage)
        if delta.finish_reason is not None:
            yield _event(fmt.end(delta.finish_reason), include_usage)
            if include_usage:
                total = prompt_tokens + n
                usage = s.Usage(
                    prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=total
                )
                yield _event(fmt.usage(usage))
    yield _event("[DONE]")


class EventStream(StreamingResponse):
    """Server-sent events that cancel their Stream when the client goes away mid-stream."""

    def __init__(self, stream: Stream, events: AsyncIterator[str], metrics: Metrics) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.stream = stream
        self.events = events
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(self.stream_response(send), receive)
        except Gone:
            LOG.info("client went away: request cancelled")
        finally:
            if not self.stream.done:
                self.stream.cancel()
            self.metrics.finished(self.stream)
            await self.events.aclose()  # type: ignore[attr-defined]
