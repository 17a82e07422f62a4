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
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qir.dtypes import DType
from qir.errors import QirError, UsageError
from qir.logits import MAX_BIAS
from qir.models import Model
from qir.models.blocks import PAGE_SIZE, check_max_seq
from qir.models.checkpoint import Checkpoint
from qir.models.loader import load
from qir.ops import MAX_TOP_LOGPROBS
from qir.sampling import Sampling, fresh_seed
from qir.serving.lockstep import Leader, follow
from qir.serving.pages import PagePool
from qir.serving.rules import Rules, SeqRules
from qir.serving.scheduler import Scheduler, Seq, TokenScore

LOG = logging.getLogger("qir.serving")

# vLLM's sampling defaults (its servers' _DEFAULT_SAMPLING_PARAMS), under generation_config.json.
VLLM_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# Requests waiting to run, beyond which `submit` refuses (the server's 429).
DEFAULT_MAX_QUEUE = 256
# Sequences decoded in one batch, and prompt tokens per prefill chunk.
DEFAULT_MAX_BATCH = 16
DEFAULT_CHUNK = 256
# The KV cache's share of a GPU's free memory after the weights, and the host's default size.
GPU_KV_FRACTION = 0.85
DEFAULT_HOST_KV_GB = 2.0


class QueueFull(QirError):
    """Too many requests are waiting: try again later."""


class EngineClosed(QirError):
    """The engine is shutting down or stopped: no new requests."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # token ids, special tokens included
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # strings that end the text (not part of it, unless keep_stop)
    ignore_eos: bool = False
    rules: Rules = field(default_factory=Rules)  # restrictions and penalties (qir.serving.rules)
    stop_token_ids: frozenset[int] = frozenset()  # ids that end it as an eos does
    keep_stop: bool = False  # the stop string that ended the text stays in it
    logprobs: int | None = None  # each generated id's score with this many top ids
    prompt_logprobs: int | None = None  # each prompt id's (after the first)
    n: int = 1  # samples of the prompt, each a choice (index 0..n-1)
    grammar: Any = None  # a qir.serving.grammar.Grammar the output must follow
    cache_salt: str | None = None  # prefix-cache pages are shared only under the same salt
    keep_tokens: frozenset[int] = frozenset()  # special ids whose text stays in the text


@dataclass(frozen=True)
class Delta:
    """What a choice of a request gained since its last delta. finish_reason: None while it
    runs, then "stop" (an eos id, a stop id or string), "length" (max_tokens or the context) or
    "error". scores: each id's (where logprobs were asked); prompt_scores: on a choice's first
    delta where prompt_logprobs were (None for the first id)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    index: int = 0
    scores: tuple[TokenScore, ...] = ()
    prompt_scores: tuple[TokenScore | None, ...] | None = None
    # the sum of the choice's ids' logprobs, on its last delta where it was scored
    cumulative_logprob: float | None = None


class Stream:
    """A request's deltas as they come (async iteration; one request's n choices interleaved,
    each delta naming its choice); `cancel()` stops it and frees what it holds (a disconnected
    client)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self._loop = loop
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done = False
        self.finish_reason: str | None = None  # the last delta's, once it came
        self.arrived = time.monotonic()
        self.token_times: list[float] = []  # when each delta with ids was pushed (metrics)
        self._open = request.n  # choices not finished yet

    def push(self, delta: Delta) -> None:
        """From the engine's thread."""
        if delta.token_ids:
            self.token_times.append(time.monotonic())
        self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)

    def cancel(self) -> None:
        self.cancelled.set()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while not self.done:
            delta = await self._queue.get()
            if delta.finish_reason is not None:
                self._open = 0 if delta.finish_reason == "error" else self._open - 1
            self.done = self._open == 0
            self.finish_reason = delta.finish_reason
            yield delta


async def merge(streams: Sequence[Stream]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of several streams as they come, each with its stream's index."""
    queue: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        open_ = len(streams)
        while open_:
            i, delta = await queue.get()
            if delta is None:
                open_ -= 1
                continue
            yield i, delta
    finally:
        for t in tasks:
            t.cancel()


class Engine:
    """Requests in, deltas out, for many clients at once: a worker thread runs the scheduler's
    steps (qir.serving.scheduler: continuous batching over a paged KV cache)."""

    def __init__(
        self,
        model: Model,
        max_queue: int = DEFAULT_MAX_QUEUE,
        name: str | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        chunk: int = DEFAULT_CHUNK,
        prefix_caching: bool = True,
        tool_parser: str | None = None,
    ) -> None:
        self.model = model
        self.name = name or model.checkpoint.path.name
        self.max_queue = max_queue
        self.scheduler = Scheduler(model, max_batch, chunk, prefix_caching)
        self._incoming: list[Seq] = []
        self._grammars: Any = None
        self._tool_parser: str | None = tool_parser
        self._lock = threading.Condition()
        self._closing = False
        self._abort: str | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def load(
        cls,
        path: str | Path,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch: int = DEFAULT_MAX_BATCH,
        chunk: int = DEFAULT_CHUNK,
        kv_cache_gb: float | None = None,
        prefix_caching: bool = True,
        name: str | None = None,
        **options: Any,
    ) -> Engine:
        """The checkpoint at `path` with a KV cache of `kv_cache_gb` GiB (default: what the
        device has free after the weights, most of it, on a GPU; enough for max_batch
        sequences at full context, at most DEFAULT_HOST_KV_GB, on the host); options as
        Model's (backend, act, max_seq, passes, weight_quantization)."""
        model = _model(path, kv_cache_gb, max_batch, options)
        if model.comm is not None and model.comm.size > 1:
            model.compiled = Leader(model.compiled, model.comm)  # type: ignore[assignment]
        return cls(model, max_queue, name, max_batch, chunk, prefix_caching)

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def max_seq(self) -> int:
        return self.model.max_seq

    @property
    def running(self) -> int:
        """Requests being prefilled or decoded."""
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        """Requests queued, not yet running."""
        return len(self._incoming) + len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """The share of KV-cache pages in use, 0..1."""
        pool = self.scheduler.pool
        return 1 - pool.free / pool.pages

    def prompt_ids(self, text: str) -> tuple[int, ...]:
        """A completion prompt's ids (the tokenizer's special tokens as it adds them)."""
        return tuple(self.model.encode(text))

    def chat_ids(self, messages: Any) -> tuple[int, ...]:
        """A chat's prompt ids: the messages through the checkpoint's chat template, with the
        assistant's turn opened."""
        text = self.model.chat_prompt(messages)
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def sampling(self, **options: Any) -> Sampling:
        """A request's Sampling, as vLLM's server makes it: the given temperature, top_k, top_p,
        min_p and seed; for one left out (None), the checkpoint's generation_config.json where
        it sets that field, else vLLM's default (temperature 1, top_p 1, top_k off, min_p 0).
        do_sample is not read (vLLM does not: a checkpoint without a temperature samples at
        1); temperature 0 is greedy."""
        values = self.model.generation_config.values
        picked = {
            key: options.get(key) if options.get(key) is not None else values.get(key)
            for key in VLLM_DEFAULTS
        }
        return Sampling(
            temperature=float(_or(picked["temperature"], VLLM_DEFAULTS["temperature"])),
            top_k=max(int(_or(picked["top_k"], VLLM_DEFAULTS["top_k"])), 0),
            top_p=float(_or(picked["top_p"], VLLM_DEFAULTS["top_p"])),
            min_p=float(_or(picked["min_p"], VLLM_DEFAULTS["min_p"])),
            seed=options.get("seed"),
        )

    def default_penalties(self) -> dict[str, float]:
        """repetition_penalty left out: generation_config.json's, else 1 (vLLM's)."""
        value = self.model.generation_config.values.get("repetition_penalty")
        return {"repetition_penalty": float(value) if value is not None else 1.0}

    @property
    def grammars(self) -> Any:
        """The engine's grammar compiler (qir.serving.grammar), made when first asked."""
        if self._grammars is None:
            from qir.serving.grammar import Grammars

            self._grammars = Grammars(
                self.tokenizer, self.model.vocab_size, self.model.generation_config.eos_ids
            )
        return self._grammars

    @property
    def tool_parser(self) -> str:
        """The tool-call parser of the checkpoint's family (qir.serving.tools), by its chat
        template; "hermes" where the template shows none."""
        if self._tool_parser is None:
            from qir.serving.tools import detect
            from qir.text import ChatTemplate

            try:
                source = ChatTemplate.load(self.tokenizer).source
            except UsageError:
                source = None
            self._tool_parser = detect(source) or "hermes"
        return self._tool_parser

    def describe(self) -> list[str]:
        """Lines the server prints when it starts: the model, its context, what fits."""
        block, pages = self.model.block, self.scheduler.pool.pages
        per_page = page_bytes(self.model.checkpoint, self.model.act)
        full = pages // block.table_pages
        return [
            f"model {self.name}: context {self.max_seq} tokens, batches of up to "
            f"{self.scheduler.max_batch} sequences, prompts in chunks of {self.scheduler.chunk}",
            f"KV cache: {pages} pages of {PAGE_SIZE} tokens ({pages * per_page / 2**30:.2f} GiB), "
            f"{full} sequence(s) at full context",
        ]

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
        vocab = self.model.vocab_size
        for name, k in (
            ("logprobs", request.logprobs),
            ("prompt_logprobs", request.prompt_logprobs),
        ):
            if k is not None and not 0 <= k <= min(MAX_TOP_LOGPROBS, vocab):
                raise UsageError(f"{name} must be in 0..{min(MAX_TOP_LOGPROBS, vocab)}, got {k}")
        r = request.rules
        ids = {
            "logit_bias": r.logit_bias.keys(),
            "allowed_token_ids": r.allowed_token_ids or (),
            "stop_token_ids": request.stop_token_ids,
        }
        for name, given in ids.items():
            bad = [t for t in given if not 0 <= t < vocab]
            if bad:
                raise UsageError(
                    f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
                )
        if len(r.logit_bias) > MAX_BIAS:
            raise UsageError(f"logit_bias: {len(r.logit_bias)} tokens, at most {MAX_BIAS}")
        if r.allowed_token_ids is not None and not r.allowed_token_ids:
            raise UsageError("allowed_token_ids: empty (no token could be drawn)")
        if request.n < 1:
            raise UsageError(f"n must be at least 1, got {request.n}")

    def submit(self, request: Request) -> Stream:
        """Queue `request`; its Stream yields its deltas. Call from the event loop's thread."""
        self.check(request)
        stream = Stream(request, asyncio.get_running_loop())
        seed = request.sampling.seed
        seqs: list[Seq] = []
        for i in range(request.n):
            # vLLM's seeds of a request's samples: the request's plus the sample's index
            child = seed + i if seed is not None else fresh_seed()
            seqs.append(self._seq(request, stream, i, child, seqs[0] if seqs else None))
        with self._lock:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            if len(self._incoming) + len(self.scheduler.waiting) >= self.max_queue:
                raise QueueFull(
                    f"{len(self._incoming) + len(self.scheduler.waiting)} requests are waiting; "
                    "try again later"
                )
            self._incoming += seqs
            self._lock.notify()
        return stream

    def _seq(
        self, request: Request, stream: Stream, index: int, seed: int, first: Seq | None
    ) -> Seq:
        from qir.text import TextStream

        text = TextStream(
            self.tokenizer, request.stop, keep_stop=request.keep_stop, keep=request.keep_tokens
        )
        n_prompt = len(request.prompt)
        counters = self.scheduler.counters
        scored = request.logprobs is not None
        total = [0.0]  # the sum of the scored ids' logprobs

        def on_token(seq: Seq, token: int, score: TokenScore | None, last: bool) -> None:
            counters.generation_tokens += 1
            if seq.generated == 1 and index == 0:
                counters.prompt_tokens += n_prompt
            piece = text.add(token)
            finish = None
            if text.stopped:
                seq.done, finish = True, "stop"
            elif last:
                piece += text.finish()
                finish = "stop" if token in seq.eos else "length"
            if score is not None:
                total[0] += score.logprob
            prompt_scores = (
                tuple(seq.prompt_scores) if seq.generated == 1 and seq.prompt_scores else None
            )
            stream.push(
                Delta(
                    piece,
                    (token,),
                    finish,
                    n_prompt,
                    seq.generated,
                    index=index,
                    scores=(score,) if score is not None else (),
                    prompt_scores=prompt_scores,
                    cumulative_logprob=total[0] if finish is not None and scored else None,
                )
            )

        eos = frozenset() if request.ignore_eos else frozenset(self.model.generation_config.eos_ids)
        eos |= request.stop_token_ids
        grammar = request.grammar.matcher() if request.grammar is not None else None
        held_back = eos | request.stop_token_ids
        rules = SeqRules(request.rules, request.prompt, self.model.vocab_size, held_back, grammar)
        return Seq(
            list(request.prompt),
            request.max_tokens,
            request.sampling,
            seed,
            eos,
            on_token,
            stream.cancelled.is_set,
            tag=stream,
            rules=rules if rules.active else None,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            after=first,
            salt=request.cache_salt.encode() if request.cache_salt else b"",
        )

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="qir-engine", daemon=True)
            self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self._incoming) or not self.scheduler.idle

    def abort(self, message: str) -> None:
        """End every queued and running request now, with an error delta saying `message`."""
        with self._lock:
            self._abort = message
            self._lock.notify()

    async def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; finish those queued and running (drain) or cancel them."""
        with self._lock:
            self._closing = True
            if not drain:
                for seq in [*self._incoming, *self.scheduler.waiting, *self.scheduler.running]:
                    seq.tag.cancel()
            self._lock.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if isinstance(self.model.compiled, Leader):
            self.model.compiled.stop()

    def _work(self) -> None:
        sched = self.scheduler
        while True:
            with self._lock:
                while (
                    not self._incoming and sched.idle and not self._closing and self._abort is None
                ):
                    self._lock.wait()
                for seq in self._incoming:
                    sched.add(seq)
                self._incoming.clear()
                if sched.idle and self._closing:
                    return
                aborted, self._abort = self._abort, None
            if aborted is not None:
                self._end_all(aborted)
                continue
            try:
                sched.step()
            except Exception as e:  # a bug must not take the server down: the clients hear it,
                # and the operator's log gets the traceback (a client's message has none)
                n = len(sched.waiting) + len(sched.running)
                LOG.exception("engine step failed; ending its %d request(s)", n)
                self._end_all(f"{type(e).__name__}: {e}")

    def _end_all(self, message: str) -> None:
        """End every request with an error (from the engine's thread)."""
        sched = self.scheduler
        for seq in [*sched.waiting, *sched.running]:
            seq.tag.push(Delta("", (), "error", error=message))
            seq.done = True
        sched.waiting.clear()
        sched.running.clear()
        sched.pool = PagePool(sched.pool.pages)


def _or(value: Any, default: float) -> Any:
    return default if value is None else value


def _model(
    path: str | Path, kv_cache_gb: float | None, max_batch: int, options: dict[str, Any]
) -> Model:
    """The engine's model; with options["comm"] (tensor parallel), rank 0's KV pool on every
    rank."""
    ck = load(path)
    max_seq = check_max_seq(ck, options.pop("max_seq", None))
    pages = kv_pages(
        ck, options.get("act"), max_seq, kv_cache_gb, max_batch, options.get("backend", "reference")
    )
    comm = options.get("comm")
    if comm is not None and comm.size > 1:
        pages = comm.bcast(pages)  # free device memory may differ between ranks
    return Model(ck, max_seq=max_seq, kv_pages=pages, **options)


def follow_engine(
    path: str | Path,
    kv_cache_gb: float | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    **options: Any,
) -> int:
    """A tensor-parallel rank other than 0 of `qir serve`: its part of the model (options as
    Engine.load's, with comm), repeating rank 0's steps (qir.serving.lockstep) until it stops."""
    model = _model(path, kv_cache_gb, max_batch, options)
    return follow(model.compiled, model.comm)


def page_bytes(ck: Checkpoint, act: DType) -> int:
    """Bytes one page of every layer's K and V caches takes."""
    return ck.num_layers * 2 * PAGE_SIZE * ck.num_kv_heads * ck.head_dim * act.itemsize


def kv_pages(
    ck: Checkpoint,
    act: DType | None,
    max_seq: int,
    kv_cache_gb: float | None,
    max_batch: int,
    backend: str,
) -> int:
    """Pages of the KV-cache pool: `kv_cache_gb` GiB of them, else the default of Engine.load;
    at least one sequence's worth (a UsageError when the budget holds less)."""
    per_page = page_bytes(ck, act or ck.act_dtype)
    table = -(-max_seq // PAGE_SIZE)
    if kv_cache_gb is not None:
        if (
            isinstance(kv_cache_gb, bool)
            or not isinstance(kv_cache_gb, int | float)
            or not kv_cache_gb > 0
        ):
            raise UsageError(f"--kv-cache-gb must be a positive number, got {kv_cache_gb!r}")
        pages = int(kv_cache_gb * 2**30 // per_page)
    elif backend == "cuda":
        import cupy

        free, _ = cupy.cuda.runtime.memGetInfo()
        # The weights are not on the device yet: their checkpoint bytes stand for them.
        weights = sum(
            int(np.prod(ck.store.shape(t))) * ck.store.dtype(t).itemsize for t in ck.store
        )
        pages = int((free - weights) * GPU_KV_FRACTION // per_page)
    else:
        pages = min(max_batch * table, int(DEFAULT_HOST_KV_GB * 2**30 // per_page))
    if pages < table:
        raise UsageError(
            f"the KV cache holds {pages} pages of {PAGE_SIZE} tokens ({pages * per_page / 2**30:.3f} "
            f"GiB), less than one sequence of --max-seq {max_seq} ({table} pages): give more "
            "--kv-cache-gb or a smaller --max-seq"
        )
    return pages
