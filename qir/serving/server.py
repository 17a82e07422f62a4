"""Running the app: uvicorn on a socket bound before the model loads, until Ctrl-C or SIGTERM
(`serve`), or on a thread for tests and benchmarks (`background`)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from qir.errors import UsageError


class _Server(uvicorn.Server):
    """uvicorn's server, quiet about the signal that stopped it (uvicorn raises it again after
    its graceful shutdown, which would end `qir serve` with a signal's exit status after a clean
    drain), and telling `on_ready` the address it listens on (a port of 0 picks a free one)."""

    on_ready: Any = None

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

    async def startup(self, sockets: Any = None) -> None:
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
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(app: FastAPI, sock: socket.socket, on_ready: Any = None, log_level: str = "info") -> None:
    """Serve on `sock` until Ctrl-C or SIGTERM, then drain: stop accepting, let running
    requests finish, stop the engine (a second Ctrl-C stops at once)."""
    server = _Server(uvicorn.Config(app, log_level=log_level))
    server.on_ready = on_ready
    server.run(sockets=[sock])


@contextmanager
def background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The app served on a thread (tests, benchmarks): its base URL while the block runs."""
    sock = listen(host, port)
    server = _Server(uvicorn.Config(app, log_level="warning"))
    ready: list[str] = []
    server.on_ready = ready.append
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
