"""Running the app: uvicorn on a socket bound before the model loads, until Ctrl-C or SIGTERM
(`serve`), or on a thread for tests and benchmarks (`background`).

Connections are closed when idle (no request for `Timeouts.idle` seconds, a fresh connection
included) or half-sent (a request's head not complete `Timeouts.header` seconds after the
connection opened or the previous response ended); the body's own deadline is the middleware's.

The first Ctrl-C or SIGTERM drains: the app answers 503 to new requests (its `drain`) while
those queued and running finish, for at most `Timeouts.drain` seconds (then they end with an
error), and the server stops. A second signal stops at once, exit status 128 + the signal."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from qir.errors import UsageError
from qir.serving.timeouts import Timeouts


def _protocol(timeouts: Timeouts) -> type[H11Protocol]:
    class Protocol(H11Protocol):
        """uvicorn's HTTP/1.1, closing idle connections from the start (uvicorn only does after
        a response) and those whose request head does not come whole in time."""

        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            self._await_head()

        def _await_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeouts.header, self._no_head)

        def _no_head(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
                self._head_timer.cancel()  # the head came
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return Protocol


class _Server(uvicorn.Server):
    """uvicorn's server, draining on the first signal (see the module docstring) and quiet
    about the signal that stopped it (uvicorn raises it again after its graceful shutdown,
    which would end `qir serve` with a signal's exit status after a clean drain), telling
    `on_ready` the address it listens on (a port of 0 picks a free one)."""

    def __init__(self, app: FastAPI, log_level: str, on_ready: Any = None) -> None:
        self.timeouts: Timeouts = getattr(app.state, "timeouts", Timeouts())
        config = uvicorn.Config(
            app,
            log_level=log_level,
            http=_protocol(self.timeouts),
            timeout_keep_alive=self.timeouts.idle,  # type: ignore[arg-type]
        )
        super().__init__(config)
        self.on_ready = on_ready
        self.drain: Callable[[float], Awaitable[None]] | None = getattr(app.state, "drain", None)
        self.kill: Callable[[], None] | None = getattr(app.state, "kill", None)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._stopping:
            print(
                f"qir serve: stopped at once ({signal.Signals(sig).name} while draining)",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            if self.kill is not None:
                self.kill()
            os._exit(128 + sig)
        self._stopping = True
        if self.drain is None or self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self.drain is not None
        task = asyncio.ensure_future(self.drain(self.timeouts.drain))
        task.add_done_callback(lambda _: setattr(self, "should_exit", True))

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.on_ready(url(host, port))


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), or a UsageError saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP said outright: asyncio sets TCP_NODELAY only on connections whose socket says
    # so (proto 0 does not), and without it a response written in two parts (headers, body)
    # waits for the client's delayed ACK: 40 ms on a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(app: FastAPI, sock: socket.socket, on_ready: Any = None, log_level: str = "info") -> None:
    """Serve on `sock` until Ctrl-C or SIGTERM, then drain (see the module docstring)."""
    _Server(app, log_level, on_ready).run(sockets=[sock])


@contextmanager
def background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The app served on a thread (tests, benchmarks): its base URL while the block runs."""
    sock = listen(host, port)
    ready: list[str] = []
    server = _Server(app, "warning", ready.append)
    thread = threading.Thread(target=server.run, args=([sock],), name="qir-http", daemon=True)
    thread.start()
    while not ready:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    try:
        yield ready[0]
    finally:
        server.should_exit = True
        thread.join()
