"""Continuous batching over a paged KV cache: the engine's steps.

Sequences share one pool of KV-cache pages (the model block's paged caches, qir.models.blocks);
a sequence holds the pages its positions need, in a block table the kernels read. Each
iteration (`Scheduler.step`):

1. drops cancelled sequences and frees their pages;
2. admits waiting sequences while their prompt's pages are free and the batch has room;
3. runs one chunk of at most `chunk` prompt tokens of the oldest sequence still in its prompt
   (rows of one sequence: the tiled attention), drawing its first id when the prompt is done;
4. runs one decode step for every sequence past its prompt, all in one batch (rows of many
   sequences: the split attention), replaying the capture of the smallest batch size that
   holds them, the rest padding rows at position -1 (which write and read nothing).

So a long prompt delays the running sequences by one chunk per step, not by its whole length.
A decoding sequence that needs a page when none is free preempts the sequence admitted last:
its pages are freed and it waits at the front of the queue to be recomputed (its prompt plus
what it generated), continuing where it stopped. Every row's result depends on that row alone
(each kernel computes a row from its own inputs, the draw from the row's seed and position), so
a sequence gets the same ids whatever else runs beside it, at the same batch bucket.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qir.models import Model
from qir.models.blocks import PAGE_SIZE
from qir.sampling import Sampling, seed_row
from qir.serving.counters import Counters

# Batch sizes a decode step is captured for (up to the engine's max_batch).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class PagePool:
    """The free pages of the KV cache."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self._free = list(range(pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return taken

    def give(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class Seq:
    """A sequence the scheduler runs: its ids (prompt, then what it generated), how many of
    them have K/V rows in its pages, and what to do with each new id."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    eos: frozenset[int]
    on_token: Callable[[Seq, int, bool], None]  # (seq, id, last): called as each id is drawn
    cancelled: Callable[[], bool] = lambda: False
    prompt_len: int = 0
    computed: int = 0  # ids whose K/V rows are written (positions 0..computed-1)
    pages: list[int] = field(default_factory=list)
    generated: int = 0
    done: bool = False
    tag: Any = None  # the caller's handle (the engine's Stream)

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.ids)

    @property
    def prefilling(self) -> bool:
        """Still feeding ids it did not draw (its prompt, or all it had when preempted)."""
        return self.computed < len(self.ids) - (1 if self.generated else 0)


class Scheduler:
    def __init__(
        self,
        model: Model,
        max_batch: int = 16,
        chunk: int = 256,
    ) -> None:
        self.model = model
        self.pool = PagePool(model.block.kv_pages)
        self.table_pages = model.block.table_pages
        self.max_batch = max_batch
        # A sliding layer's ring takes at most the block's prefill_chunk rows a run.
        self.chunk = min(chunk, model.block.prefill_chunk or chunk)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in order of admission
        self._captures: dict[int, Any] = {}
        self.steps = 0
        self.preempted = 0
        self.counters = Counters()

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> None:
        """One iteration (see the module docstring)."""
        self._drop_cancelled()
        self._admit()
        pre = next((s for s in self.running if s.prefilling), None)
        if pre is not None:
            self._prefill(pre)
        decoding = [s for s in self.running if not s.prefilling and not s.done]
        if decoding:
            self._decode(decoding)
        self._retire()
        self.steps += 1

    def _drop_cancelled(self) -> None:
        for s in [s for s in self.waiting if s.cancelled()]:
            self.waiting.remove(s)
        for s in self.running:
            if s.cancelled():
                s.done = True
        self._retire()

    def _retire(self) -> None:
        for s in [s for s in self.running if s.done]:
            self.running.remove(s)
            self.pool.give(s.pages)
            s.pages = []

    def _pages_for(self, seq: Seq, positions: int) -> bool:
        """Give `seq` the pages its first `positions` positions need (at most a sequence's
        room); False if the pool has too few."""
        # (a ring of pages where every layer slides: its table's, however long the sequence)
        positions = min(positions, self.model.max_seq, self.table_pages * PAGE_SIZE)
        need = -(-positions // PAGE_SIZE) - len(seq.pages)
        if need <= 0:
            return True
        got = self.pool.take(need)
        if got is None:
            return False
        seq.pages += got
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            # Its ids' pages now, and one more position for the first id it draws.
            if not self._pages_for(seq, len(seq.ids) + 1):
                break
            self.running.append(self.waiting.popleft())

    def _table(self, seq: Seq) -> np.ndarray:
        row = np.zeros(self.table_pages, np.int32)
        row[: len(seq.pages)] = seq.pages
        return row

    def _prefill(self, seq: Seq) -> None:
        end = len(seq.ids) - (1 if seq.generated else 0)
        start, stop = seq.computed, min(seq.computed + self.chunk, end)
        inputs = self.model.block.token_inputs(
            np.array(seq.ids[start:stop]), start, self._table(seq)
        )
        last = stop == end
        if last and not seq.generated:
            inputs["sampling"][-1] = seq.sampling.row()
            inputs["seed"][-1] = seed_row(seq.seed)
        out = self.model.compiled(inputs)
        seq.computed = stop
        if last and not seq.generated:
            self._emit(seq, int(np.asarray(_host(out["next"]))[-1]))

    def _decode(self, batch: list[Seq]) -> None:
        for seq in list(batch):
            # The id drawn last is fed at position len(ids) - 1: its page must be there.
            while not seq.done and not self._pages_for(seq, len(seq.ids)):
                if not self._preempt(keep=seq):
                    break
        batch = [s for s in batch if not s.done and s in self.running and not s.prefilling]
        if not batch:
            return
        size = next(b for b in BUCKETS if b >= len(batch))
        inputs = {
            "ids": np.zeros(size, np.int32),
            "pos": np.full(size, -1, np.int32),  # padding rows write and read nothing
            "pages": np.zeros((size, self.table_pages), np.int32),
            **self.model.block.draw_inputs(size),
        }
        for r, seq in enumerate(batch):
            inputs["ids"][r] = seq.ids[-1]
            inputs["pos"][r] = len(seq.ids) - 1
            inputs["pages"][r] = self._table(seq)
            inputs["sampling"][r] = seq.sampling.row()
            inputs["seed"][r] = seed_row(seq.seed)
        out = self._run_decode(size, inputs)
        drawn = np.asarray(_host(out["next"]))[: len(batch)]
        for seq, token in zip(batch, drawn.tolist(), strict=True):
            seq.computed = len(seq.ids)
            self._emit(seq, int(token))

    def _run_decode(self, size: int, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        compiled = self.model.compiled
        if compiled.backend == "reference":
            return compiled(inputs, rows="many")
        if size not in self._captures:
            self._captures[size] = compiled.capture(size, rows="many")
        return dict(self._captures[size](inputs))

    def _emit(self, seq: Seq, token: int) -> None:
        seq.ids.append(token)
        seq.generated += 1
        full = len(seq.ids) > self.model.max_seq  # no position left to feed it at
        seq.done = seq.generated >= seq.max_tokens or full or token in seq.eos
        seq.on_token(seq, token, seq.done)

    def _preempt(self, keep: Seq) -> bool:
        """Free the pages of the sequence admitted last (other than `keep`) and queue it to be
        recomputed; False if there is none."""
        victims = [s for s in self.running if s is not keep and not s.done]
        if not victims:
            return False
        victim = victims[-1]
        self.running.remove(victim)
        self.pool.give(victim.pages)
        victim.pages, victim.computed = [], 0
        self.waiting.appendleft(victim)
        self.preempted += 1
        return True


def _host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
