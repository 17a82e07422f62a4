"""Noticing that a client went away: an http.disconnect on the request's receive channel, or a
send to a closed connection, while its answer is being worked on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class Gone(Exception):
    """The client disconnected."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result, unless the client disconnects first (Gone; `work` is cancelled). A
    send to a closed connection (OSError) counts as a disconnect too."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this request's own task is cancelled
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise Gone
    try:
        return task.result()
    except OSError:
        raise Gone from None
