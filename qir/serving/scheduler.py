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

Each row also carries its sequence's logit rules (qir.serving.rules: a bitmask, logit_bias,
penalties) and asks for scores where the request wants them (qir.logits: the log-softmax of the
drawn id, or of the next prompt id for prompt_logprobs, and the top tokens): both are inputs and
outputs of the one captured step.

Prefix caching (qir.serving.pages): a page whose 16 positions are computed is registered under
a hash of its ids and of every id before it; a sequence admitted later whose prompt starts with
the same ids takes those pages (shared, reference-counted) and computes only the rest. Pages no
sequence holds stay cached until a new page is needed and none is free: the least recently
used goes first. A sequence that wants its prompt's logprobs computes its whole prompt; a model
whose layers all slide (rings of pages) caches nothing. The samples of one request (n, best_of)
share its prompt this way: the first computes it, the others are admitted once it has, take
its full pages, and copy the KV rows of its partial last page into a page of their own (each
draws into its own copy), computing only the last prompt id, whose row their first draw needs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qir.logits import DRAWN, SKIP
from qir.models import Model
from qir.models.blocks import PAGE_SIZE
from qir.sampling import Sampling, seed_row
from qir.serving.counters import Counters
from qir.serving.pages import PagePool, page_hash
from qir.serving.rules import SeqRules

# Batch sizes a decode step is captured for (up to the engine's max_batch).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class TokenScore:
    """An id's log-probability under the raw model, and the most likely ids' at its position
    (as many as asked, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Seq:
    """A sequence the scheduler runs: its ids (prompt, then what it generated), how many of
    them have K/V rows in its pages, and what to do with each new id."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    eos: frozenset[int]
    # (seq, id, its score or None, last): called as each id is drawn
    on_token: Callable[[Seq, int, TokenScore | None, bool], None]
    cancelled: Callable[[], bool] = lambda: False
    prompt_len: int = 0
    computed: int = 0  # ids whose K/V rows are written (positions 0..computed-1)
    pages: list[int] = field(default_factory=list)
    generated: int = 0
    done: bool = False
    tag: Any = None  # the caller's handle (the engine's Stream)
    rules: SeqRules | None = None
    logprobs: int | None = None  # top tokens with each drawn id's score (None: no scores)
    prompt_logprobs: int | None = None  # the same for each prompt id after the first
    prompt_scores: list[TokenScore | None] = field(default_factory=list)
    after: Seq | None = None  # a sibling whose prompt pages this one waits to share
    registered: int = 0  # leading pages registered in the prefix cache
    salt: bytes = b""  # the first page's key starts from it (a request's cache_salt)

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.ids)

    @property
    def prefilling(self) -> bool:
        """Still feeding ids it did not draw (its prompt, or all it had when preempted)."""
        return self.computed < len(self.ids) - (1 if self.generated else 0)


class Scheduler:
    def __init__(
        self, model: Model, max_batch: int = 16, chunk: int = 256, prefix_caching: bool = True
    ) -> None:
        self.model = model
        self.pool = PagePool(model.block.kv_pages)
        self.table_pages = model.block.table_pages
        self.max_batch = max_batch
        # A sliding layer's ring takes at most the block's prefill_chunk rows a run.
        self.chunk = min(chunk, model.block.prefill_chunk or chunk)
        # Rings of pages hold positions modulo their length: no page is a prefix's.
        self.prefix_caching = prefix_caching and not model.block.room
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in order of admission
        self._captures: dict[int, Any] = {}
        self.steps = 0
        self.preempted = 0
        self.prefilled = 0  # ids fed in prefill chunks (not those found in cached pages)
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
            first = seq.after
            if first is not None and first.prefilling and not first.done and first in self.running:
                break  # its sibling is still computing the prompt they share
            self._reuse(seq)
            # Its ids' pages now, and one more position for the first id it draws.
            if not self._pages_for(seq, len(seq.ids) + 1):
                self.pool.give(seq.pages)
                seq.pages, seq.computed, seq.registered = [], 0, 0
                break
            self._copy_partial(seq)
            self.running.append(self.waiting.popleft())

    def _copy_partial(self, seq: Seq) -> None:
        """A sample whose sibling computed their prompt, its full pages taken, copies the rows
        of the sibling's partial last page rather than computing them (each row depends on the
        ids up to it alone: the same values); its last prompt id is still fed, to draw."""
        first, full = seq.after, seq.computed // PAGE_SIZE
        end = len(seq.ids) - 1
        if (
            first is None
            or first not in self.running
            or first.prefilling
            or seq.generated
            or seq.prompt_logprobs is not None
            or seq.computed != (end // PAGE_SIZE) * PAGE_SIZE
            or seq.computed >= end
            or len(first.pages) <= full
            or first.ids[: len(seq.ids)] != seq.ids
        ):
            return
        n = end - seq.computed
        self.model.compiled.copy_state_rows(
            first.pages[full] * PAGE_SIZE, seq.pages[full] * PAGE_SIZE, n
        )
        seq.computed = end

    def _reuse(self, seq: Seq) -> None:
        """Take the cached pages of the longest prefix of `seq`'s ids that they hold, leaving
        at least its last id to feed."""
        if not self.prefix_caching or seq.computed:
            return
        if seq.prompt_logprobs is not None and not seq.generated:
            return  # its prompt's rows are computed to be scored
        full = (len(seq.ids) - 1) // PAGE_SIZE
        hashes = self._hashes(seq, full)
        seq.pages = self.pool.lookup(hashes)
        seq.computed, seq.registered = len(seq.pages) * PAGE_SIZE, len(seq.pages)
        if not seq.generated:
            self.counters.prefix_cache_queries += len(seq.ids)
            self.counters.prefix_cache_hits += seq.computed

    def _hashes(self, seq: Seq, pages: int) -> list[bytes]:
        out: list[bytes] = []
        parent = seq.salt
        for p in range(pages):
            parent = page_hash(parent, seq.ids[p * PAGE_SIZE : (p + 1) * PAGE_SIZE])
            out.append(parent)
        return out

    def _register(self, seq: Seq) -> None:
        """Put the pages `seq` has filled since its last registration in the prefix cache."""
        if not self.prefix_caching:
            return
        full = min(seq.computed // PAGE_SIZE, len(seq.pages))
        if full <= seq.registered:
            return
        for p, h in enumerate(self._hashes(seq, full)):
            if p >= seq.registered:
                self.pool.register(seq.pages[p], h)
        seq.registered = full

    def _table(self, seq: Seq) -> np.ndarray:
        row = np.zeros(self.table_pages, np.int32)
        row[: len(seq.pages)] = seq.pages
        return row

    def _set_row(self, inputs: dict[str, np.ndarray], r: int, seq: Seq) -> None:
        """Row r draws `seq`'s next id under its sampling and rules, scored where asked."""
        inputs["sampling"][r] = seq.sampling.row()
        inputs["seed"][r] = seed_row(seq.seed)
        if seq.logprobs is not None:
            inputs["targets"][r] = DRAWN
        rules = seq.rules
        if rules is None or not rules.active:
            return
        inputs["penalties"][r] = (
            rules.rules.repetition_penalty,
            rules.rules.frequency_penalty,
            rules.rules.presence_penalty,
        )
        entries = rules.entries(inputs["tokens"].shape[1])
        if entries is not None:
            inputs["tokens"][r], inputs["counts"][r], inputs["bias"][r] = entries
        allow = rules.allow()
        if allow is not None:
            inputs["allow"][r] = allow

    def _prefill(self, seq: Seq) -> None:
        end = len(seq.ids) - (1 if seq.generated else 0)
        start, stop = seq.computed, min(seq.computed + self.chunk, end)
        inputs = self.model.block.token_inputs(
            np.array(seq.ids[start:stop]), start, self._table(seq)
        )
        last = stop == end and not seq.generated
        scored = seq.prompt_logprobs is not None and not seq.generated
        if scored:  # row i scores the prompt id after it
            following = np.array(seq.ids[start + 1 : stop + 1], np.int32)
            inputs["targets"][: len(following)] = following
            if last:
                inputs["targets"][-1] = SKIP
        if last:
            self._set_row(inputs, -1, seq)
        out = self.model.compiled(inputs)
        self.prefilled += stop - start
        seq.computed = stop
        self._register(seq)
        if scored:
            if start == 0:
                seq.prompt_scores.append(None)
            top = seq.prompt_logprobs or 0
            scores = _scores(out, top)
            seq.prompt_scores += scores[: min(stop, seq.prompt_len - 1) - start]
        if last:
            score = _scores(out, seq.logprobs)[-1] if seq.logprobs is not None else None
            self._emit(seq, int(np.asarray(_host(out["next"]))[-1]), score)

    def _decode(self, batch: list[Seq]) -> None:
        for seq in list(batch):
            # The id drawn last is fed at position len(ids) - 1: its page must be there (not
            # for a sequence this loop preempted).
            while seq in self.running and not seq.done and not self._pages_for(seq, len(seq.ids)):
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
            self._set_row(inputs, r, seq)
        out = self._run_decode(size, inputs)
        drawn = np.asarray(_host(out["next"]))[: len(batch)]
        wanted = any(s.logprobs is not None for s in batch)
        scores = _scores(out, max(s.logprobs or 0 for s in batch)) if wanted else []
        for r, (seq, token) in enumerate(zip(batch, drawn.tolist(), strict=True)):
            seq.computed = len(seq.ids)
            self._register(seq)
            score = None
            if seq.logprobs is not None:
                full = scores[r]
                assert full is not None
                score = TokenScore(full.token, full.logprob, full.top[: seq.logprobs])
            self._emit(seq, int(token), score)

    def _run_decode(self, size: int, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        compiled = self.model.compiled
        if compiled.backend == "reference":
            return compiled(inputs, rows="many")
        if size not in self._captures:
            self._captures[size] = compiled.capture(size, rows="many")
        return dict(self._captures[size](inputs))

    def _emit(self, seq: Seq, token: int, score: TokenScore | None) -> None:
        seq.ids.append(token)
        seq.generated += 1
        if seq.rules is not None:
            seq.rules.accept(token)
        full = len(seq.ids) > self.model.max_seq  # no position left to feed it at
        seq.done = seq.generated >= seq.max_tokens or full or token in seq.eos
        seq.on_token(seq, token, score, seq.done)

    def _preempt(self, keep: Seq) -> bool:
        """Free the pages of the sequence admitted last (other than `keep`) and queue it to be
        recomputed; False if there is none."""
        victims = [s for s in self.running if s is not keep and not s.done]
        if not victims:
            return False
        victim = victims[-1]
        self.running.remove(victim)
        self.pool.give(victim.pages)
        victim.pages, victim.computed, victim.registered = [], 0, 0
        self.waiting.appendleft(victim)
        self.preempted += 1
        return True


def _scores(out: dict[str, Any], top: int) -> list[TokenScore | None]:
    """Each row's score with its `top` most likely ids (None where the row scored nothing)."""
    ids = np.asarray(_host(out["logprob_ids"]))
    values = np.asarray(_host(out["logprobs"]))
    rows: list[TokenScore | None] = []
    for i, v in zip(ids.tolist(), values.tolist(), strict=True):
        if i[0] < 0:
            rows.append(None)
            continue
        rows.append(TokenScore(i[0], v[0], tuple(zip(i[1 : 1 + top], v[1 : 1 + top], strict=True))))
    return rows


def _host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
