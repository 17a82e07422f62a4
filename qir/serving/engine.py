"""The serving engine: requests (prompt ids, a sampling, limits) in, deltas (new text and ids,
then a finish reason and the usage) out, for many clients at once.

The engine owns the model and a worker thread that runs its steps; the HTTP layer (or any
asyncio code) submits a Request and reads a Stream of Deltas, and cancels it when the client
goes away. What runs the steps is the scheduler (qir.serving.scheduler); this module is the
boundary the server is written against:

    engine = Engine.load("path/to/checkpoint", backend="host")
    engine.start()
    stream = engine.submit(Request(prompt=engine.tokenizer.encode("Hi"), max_tokens=16,
                                   sampling=Sampling(temperature=0.8, seed=1)))
    async for delta in stream: ...        # Delta(text, token_ids, finish_reason, usage)
    await engine.shutdown()               # drain: finish what runs, refuse new requests

Errors a client caused (a prompt past the context, ids outside the vocabulary, bad sampling
values) are UsageErrors raised by `submit`; a full queue is QueueFull; both before anything runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qir.errors import QirError, UsageError
from qir.models import Model
from qir.sampling import Sampling

# Requests waiting to run, beyond which `submit` refuses (the server's 429).
DEFAULT_MAX_QUEUE = 256


class QueueFull(QirError):
    """Too many requests are waiting: try again later."""


class EngineClosed(QirError):
    """The engine is shutting down or stopped: no new requests."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # token ids, special tokens included
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # strings that end the text (not part of it)
    ignore_eos: bool = False


@dataclass(frozen=True)
class Delta:
    """What a request gained since its last delta. finish_reason: None while it runs, then
    "stop" (an eos id or a stop string), "length" (max_tokens or the context) or "error"."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class Stream:
    """A request's deltas as they come (async iteration); `cancel()` stops it and frees what it
    holds (a disconnected client)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self._loop = loop
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done = False

    def push(self, delta: Delta) -> None:
        """From the engine's thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)

    def cancel(self) -> None:
        self.cancelled.set()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while not self.done:
            delta = await self._queue.get()
            self.done = delta.finish_reason is not None
            yield delta


class Engine:
    def __init__(self, model: Model, max_queue: int = DEFAULT_MAX_QUEUE, name: str | None = None):
        self.model = model
        self.name = name or model.checkpoint.path.name
        self.max_queue = max_queue
        self._waiting: list[Stream] = []
        self._lock = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.kv_cache_gb: float | None = None

    @classmethod
    def load(
        cls,
        path: str | Path,
        max_queue: int = DEFAULT_MAX_QUEUE,
        kv_cache_gb: float | None = None,
        **options: Any,
    ) -> Engine:
        engine = cls(Model.load(path, **options), max_queue)
        # The KV cache's memory budget (`qir serve --kv-cache-gb`), which the paged engine sizes
        # its page pool from; one sequence at a time, it is only recorded.
        engine.kv_cache_gb = kv_cache_gb
        return engine

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def max_seq(self) -> int:
        return self.model.max_seq

    def prompt_ids(self, text: str) -> tuple[int, ...]:
        """A completion prompt's ids (the tokenizer's special tokens as it adds them)."""
        return tuple(self.model.encode(text))

    def chat_ids(self, messages: Any) -> tuple[int, ...]:
        """A chat's prompt ids: the messages through the checkpoint's chat template, with the
        assistant's turn opened."""
        text = self.model.chat_prompt(messages)
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def sampling(self, **options: Any) -> Sampling:
        """A request's Sampling: the given do_sample/temperature/top_k/top_p/min_p/seed (None:
        the checkpoint's generation_config.json, as transformers takes it)."""
        return self.model.sampling(**options)

    def describe(self) -> list[str]:
        """Lines the server prints when it starts: the model, its context, what fits."""
        return [f"model {self.name}: context {self.max_seq} tokens, one sequence at a time"]

    def check(self, request: Request) -> None:
        """UsageError naming what a request cannot have (the server's 400)."""
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int):
            raise UsageError(f"max_tokens must be an int, got {request.max_tokens!r}")
        if request.max_tokens < 1:
            raise UsageError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if not request.prompt:
            raise UsageError("prompt: no tokens")
        # The last id is never fed back: it takes no row.
        self.model.tokens(list(request.prompt), request.max_tokens - 1)

    def submit(self, request: Request) -> Stream:
        """Queue `request`; its Stream yields its deltas. Call from the event loop's thread."""
        self.check(request)
        stream = Stream(request, asyncio.get_running_loop())
        with self._lock:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting; try again later")
            self._waiting.append(stream)
            self._lock.notify()
        return stream

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="qir-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; finish those queued and running (drain) or cancel them."""
        with self._lock:
            self._closing = True
            if not drain:
                for s in self._waiting:
                    s.cancel()
            self._lock.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def _next(self) -> Stream | None:
        with self._lock:
            while not self._waiting and not self._closing:
                self._lock.wait()
            return self._waiting.pop(0) if self._waiting else None

    def _work(self) -> None:
        while (stream := self._next()) is not None:
            if stream.cancelled.is_set():
                continue
            try:
                for delta in self._run(stream):
                    stream.push(delta)
            except Exception as e:  # a bug must not take the server down: the client hears it
                stream.push(Delta("", (), "error", error=f"{type(e).__name__}: {e}"))

    def _run(self, stream: Stream) -> Iterator[Delta]:
        from qir.text import TextStream

        r = stream.request
        text = TextStream(self.tokenizer, r.stop)
        steps = self.model.steps(list(r.prompt), r.max_tokens, r.sampling, ignore_eos=r.ignore_eos)
        n = 0
        try:
            for token, _, finish in steps:
                n += 1
                piece = text.add(token)
                if text.stopped:
                    finish = "stop"
                elif finish:
                    piece += text.finish()
                    finish = "stop" if finish == "eos" else "length"
                if stream.cancelled.is_set():
                    return
                yield Delta(piece, (token,), finish or None, len(r.prompt), n)
                if finish:
                    return
        finally:
            steps.close()
