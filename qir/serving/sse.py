"""A generation streamed as server-sent events: a `data: {chunk}` event per piece of text (a
choice's each, with its scores where asked), a choice's tool calls and finish chunk, the usage
chunk where the client asked for it, then `data: [DONE]`; a failed generation ends with an error
event. The streams are cancelled when the client goes away."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from qir.serving.disconnect import Gone, until_disconnect
from qir.serving.engine import Stream, merge
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
    streams: Sequence[Stream], build: Any, fmt: Format, include_usage: bool
) -> AsyncIterator[str]:
    """The events of one response's choices (several prompts' streams, n samples each),
    interleaved as their deltas come (`build`: qir.serving.completions' choice builder)."""
    for choice in build.choices:
        first = fmt.start(choice.index)
        if first is not None:
            yield _event(first, include_usage)
        if fmt.echo:
            yield _event(fmt.echoed(choice), include_usage)  # type: ignore[attr-defined]
    async for i, delta in merge(streams):
        if delta.finish_reason == "error":
            error = ApiError(500, f"generation failed: {delta.error}", type="server_error")
            yield _event(error.body.model_dump_json())
            break
        choice, piece = build.add(i, delta)
        if piece or delta.scores:
            yield _event(fmt.piece(choice, piece, delta.scores), include_usage)
        if delta.finish_reason is not None:
            if choice.calls:
                yield _event(fmt.calls(choice, choice.calls), include_usage)
            yield _event(fmt.end(choice), include_usage)
    if include_usage:
        yield _event(fmt.usage(build.usage()))
    yield _event("[DONE]")


class EventStream(StreamingResponse):
    """Server-sent events that cancel their Stream when the client goes away mid-stream."""

    def __init__(
        self, streams: Sequence[Stream], events: AsyncIterator[str], metrics: Metrics
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.streams = streams
        self.events = events
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(self.stream_response(send), receive)
        except Gone:
            LOG.info("client went away: request cancelled")
        finally:
            for stream in self.streams:
                if not stream.done:
                    stream.cancel()
                self.metrics.finished(stream)
            await self.events.aclose()  # type: ignore[attr-defined]
