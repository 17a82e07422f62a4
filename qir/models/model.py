"""A whole model: logits for a prompt, and generation with the KV cache, from ids or text.

    from qir.models import Model
    model = Model.load("path/to/checkpoint", backend="host")
    model.generate("The capital of France is", max_new_tokens=16)          # text
    for piece in model.generate("Once upon", stream=True): print(piece, end="")
    model.chat([{"role": "user", "content": "Hi!"}])                      # the chat template
    gen = model.generate([3, 10, 17], max_new_tokens=8)                    # gen.tokens, gen.logits

The model is one compiled `model` block (every layer; one paged KV cache per layer as the
block's state, by default one sequence's `max_seq` positions, which this class uses; a larger
pool serves qir.serving's many sequences) that ends in a `sample` op: each run also draws the
next id on the device, so a decode step hands back one int, not the logits. Generation runs the
prompt once (prefill, positions 0..T-1), then one token per step (decode, M = 1) replaying a
capture of the block where the backend has one: the token, its position, the sampling row and
the seed are inputs copied into the capture's buffers, so one capture serves every step.

Sampling defaults come from the checkpoint's generation_config.json as transformers takes them
(qir.text.generation_config); keyword arguments override them. A generation stops at any of
its eos_token_ids (unless ignore_eos), at a stop string (text), or after max_new_tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qir.api import Compiled, compile
from qir.collectives import Comm
from qir.dtypes import DType
from qir.errors import UsageError
from qir.models.blocks import build
from qir.models.checkpoint import Checkpoint
from qir.models.loader import load
from qir.models.shard_read import ShardReader, load_rank
from qir.sampling import Sampling, fresh_seed, seed_row
from qir.types import TensorType

# A generation's ids as they are drawn: (id, its logits or None, "" / "eos" / "length").
Steps = Generator[tuple[int, np.ndarray | None, str], None, None]
# Tokens a text generation makes when neither the caller nor generation_config.json says.
DEFAULT_NEW_TOKENS = 256


@dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # int64 [N]: the generated ids (an eos that ended it included)
    logits: np.ndarray | None  # float32 [N, vocab]: the logits each id was drawn from
    finish: str = "length"  # why it ended: "length", "eos" or "stop" (a stop string)
    text: str | None = None  # the text of the ids (text generations)


@dataclass
class Stats:
    """Timings of the last generation (kernel compiles excluded: they happen before)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0  # the prompt's forward, up to its first id on the host
    decode_s: float = 0.0  # every later step
    seed: int | None = None
    sampling: str = ""
    cached_tokens: int = 0  # prompt ids whose KV rows a chat turn reused

    @property
    def prompt_tps(self) -> float:
        fed = self.prompt_tokens - self.cached_tokens
        return fed / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s else 0.0

    def line(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        seed = f", seed {self.seed}" if self.seed is not None else ""
        return (
            f"prompt {self.prompt_tokens} tokens{cached} at {self.prompt_tps:.1f} tokens/s, "
            f"first token after {self.prefill_s * 1e3:.1f} ms, {self.new_tokens} generated "
            f"at {self.decode_tps:.1f} tokens/s ({self.sampling}{seed})"
        )


@dataclass
class _Cache:
    """The ids whose K/V rows the caches hold at positions 0..len-1 (for a chat's next turn)."""

    ids: list[int] = field(default_factory=list)

    def reusable(self, ids: Sequence[int]) -> int:
        """How many leading ids of `ids` need no recompute (at least one is always fed)."""
        n = 0
        for a, b in zip(self.ids, ids, strict=False):
            if a != b:
                break
            n += 1
        return min(n, len(ids) - 1)


class Model:
    def __init__(
        self,
        ck: Checkpoint,
        backend: str = "reference",
        act: DType | None = None,
        max_seq: int | None = None,
        passes: str | Sequence[str] = "default",
        weight_quantization: str = "declared",
        kv_pages: int | None = None,
        target: str | None = None,  # the GPU the kernels are for (qir.compile's)
        prefill_chunk: int | None = None,
        comm: Comm | None = None,
    ) -> None:
        """kv_pages: the KV cache's pool of pages (qir.models.blocks; default: one sequence's,
        which this class's own methods use; qir.serving shares a larger pool). prefill_chunk:
        what a sliding layer's ring holds besides its window (qir.models.blocks). comm: this
        rank's end of a tensor-parallel group (qir.collectives); the model is then its rank's
        part (qir.passes.tensor_parallel), every rank running the same calls in step."""
        self.checkpoint = ck
        self.comm = comm
        # A tensor-parallel rank reads only its shards (qir.models.shard_read), counted here.
        self.shard_reader: ShardReader | None = None
        if comm is not None and comm.size > 1:
            self.block, self.shard_reader = load_rank(
                ck, comm.size, comm.rank, act, max_seq, kv_pages, prefill_chunk
            )
        else:
            self.block = build(ck, "model", 0, act, max_seq, kv_pages, prefill_chunk)
        if self.block.kv_pages < self.block.table_pages:
            raise UsageError(
                f"kv_pages {self.block.kv_pages} hold less than one sequence of {self.block.max_seq} "
                f"positions ({self.block.table_pages} pages)"
            )
        self.act = act or ck.act_dtype
        self.max_seq = self.block.max_seq
        self.vocab_size = ck.vocab_size
        self.compiled: Compiled = compile(
            self.block.graph,
            self.block.weights,
            backend=backend,
            passes=passes,
            weight_quantization=weight_quantization,
            target=target,
            comm=comm,
        )
        self._decode: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None
        self._tokenizer: Any = None
        self._generation_config: Any = None
        self._cache = _Cache()
        self.stats = Stats()
        # The last generation's ids (and logits, where kept), finish reason and text.
        self.last = Generation(np.zeros(0, np.int64), None)

    @classmethod
    def load(cls, path: str | Path, **options: Any) -> Model:
        """The checkpoint at `path`; options as Model's."""
        return cls(load(path), **options)

    # Text: the checkpoint's own tokenizer, chat template and generation defaults.

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's qir.text.Tokenizer (a UsageError where it ships none)."""
        if self._tokenizer is None:
            self._tokenizer = self.checkpoint.tokenizer()
        return self._tokenizer

    @property
    def generation_config(self) -> Any:
        """The checkpoint's qir.text.GenerationConfig (transformers' defaults where it has none)."""
        if self._generation_config is None:
            from qir.text import GenerationConfig

            self._generation_config = GenerationConfig.load(
                self.checkpoint.path, self.checkpoint.config
            )
        return self._generation_config

    def encode(self, text: str) -> list[int]:
        """`text`'s ids, checked to fit the model's vocabulary."""
        ids = self.tokenizer.encode(text)
        self.tokens(ids or [0])
        return list(ids)

    def chat_prompt(
        self, messages: Any, template: str | None = None, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the chat template makes of `messages`."""
        from qir.text import ChatTemplate

        chat = ChatTemplate.load(self.tokenizer, template)
        return chat.render(messages, self.tokenizer, add_generation_prompt)

    # Ids.

    def tokens(self, tokens: Sequence[int] | np.ndarray, new: int = 0) -> np.ndarray:
        """`tokens` as int32 ids, checked: inside the vocabulary, and room in the KV cache for
        them and `new` more positions."""
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or (ids.dtype.kind not in "iu"):
            raise UsageError(
                f"tokens: expected a non-empty 1-D list of int ids, got {ids.dtype} "
                f"{list(ids.shape)}"
            )
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise UsageError(
                f"token id {int(bad[0])} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if len(ids) + new > self.max_seq:
            raise UsageError(
                f"a sequence of {len(ids) + new} positions ({len(ids)} prompt"
                + (f" + {new} generated" if new else "")
                + f") is past --max-seq {self.max_seq}"
            )
        return ids.astype(np.int32)

    def forward(self, tokens: Sequence[int] | np.ndarray, start: int = 0) -> np.ndarray:
        """float32 logits [T, vocab] of `tokens` at positions start..start+T-1, attending to
        what earlier calls left in the KV cache at positions before `start`."""
        ids = self.tokens(tokens, start)
        out = self._run(ids, start, None, 0)
        self._cache.ids = []  # what a chat kept is overwritten
        return self._logits(out)

    def logits(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 logits [T, vocab] of a fresh sequence (positions 0..T-1)."""
        return self.forward(tokens, 0)

    def sampling(self, **options: Any) -> Sampling:
        """The Sampling a generation with these options (do_sample, temperature, top_k,
        top_p, min_p, seed; None: the checkpoint's generation_config.json) uses."""
        result: Sampling = self.generation_config.sampling(**options)
        return result

    def generate(
        self,
        prompt: str | Sequence[int] | np.ndarray,
        max_new_tokens: int | None = None,
        *,
        stream: bool = False,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool | None = None,
        **sampling: Any,
    ) -> Any:
        """Continue `prompt`. Text in: the text out (`stream=True`: an iterator of its pieces
        as they come), the prompt encoded with the checkpoint's tokenizer (its BOS as it adds
        it). Ids in: a Generation (ids, and the logits they were drawn from).

        max_new_tokens: default generation_config.json's, else DEFAULT_NEW_TOKENS (text) or
        required (ids). stop: strings that end a text (not part of it). sampling: do_sample,
        temperature, top_k, top_p, min_p, seed (see `sampling`). on_token sees each id."""
        if isinstance(prompt, str):
            ids = self.encode(prompt)
            keep = bool(keep_logits)
            pieces = self._text(ids, max_new_tokens, stop, ignore_eos, on_token, keep, sampling)
            return pieces if stream else "".join(pieces)
        if stop:
            raise UsageError("stop strings need a text prompt (ids in, ids out)")
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens(len(prompt))
        if max_new_tokens is None:
            raise UsageError("max_new_tokens: give it (generation_config.json sets none)")
        steps = self.steps(
            prompt,
            max_new_tokens,
            self.sampling(**sampling),
            ignore_eos=ignore_eos,
            keep_logits=True if keep_logits is None else keep_logits,
        )
        for _ in self._pieces(steps, None, on_token):  # ids only: no pieces
            pass
        return self.last

    def chat(
        self,
        messages: Any,
        max_new_tokens: int | None = None,
        *,
        stream: bool = False,
        stop: Sequence[str] = (),
        template: str | None = None,
        ignore_eos: bool = False,
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
        **sampling: Any,
    ) -> Any:
        """The assistant's reply to `messages` ([{role, content}, ...]) through the
        checkpoint's chat template: text (`stream=True`: an iterator of pieces); ignore_eos
        runs past the end of the turn to max_new_tokens. The KV rows
        of the conversation stay in the cache: the next call with the same messages plus
        more recomputes only what follows (the longest common prefix of ids is reused)."""
        text = self.chat_prompt(messages, template)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.tokens(ids)
        pieces = self._text(
            ids, max_new_tokens, stop, ignore_eos, on_token, keep_logits, sampling, reuse=True
        )
        return pieces if stream else "".join(pieces)

    def reset(self) -> None:
        """Forget the conversation a chat keeps in the KV cache."""
        self._cache.ids = []

    def _text(
        self,
        ids: list[int],
        max_new_tokens: int | None,
        stop: Sequence[str],
        ignore_eos: bool,
        on_token: Callable[[int], None] | None,
        keep_logits: bool,
        sampling: dict[str, Any],
        reuse: bool = False,
    ) -> Iterator[str]:
        from qir.text import TextStream

        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens(len(ids))
        if max_new_tokens is None:
            max_new_tokens = max(1, min(DEFAULT_NEW_TOKENS, self.max_seq - len(ids)))
        steps = self.steps(
            ids,
            max_new_tokens,
            self.sampling(**sampling),
            ignore_eos=ignore_eos,
            keep_logits=keep_logits,
            reuse=reuse,
        )
        return self._pieces(steps, TextStream(self.tokenizer, stop), on_token)

    def _pieces(
        self,
        steps: Steps,
        text: Any,
        on_token: Callable[[int], None] | None,
    ) -> Iterator[str]:
        """The text of `steps` piece by piece (a qir.text.TextStream, or None for ids only);
        `last` holds the whole generation once it ends."""
        chosen: list[int] = []
        seen: list[np.ndarray] = []
        finish, parts = "length", []
        try:
            for token, logits, why in steps:
                chosen.append(token)
                finish = why or finish
                if logits is not None:
                    seen.append(logits)
                if on_token is not None:
                    on_token(token)
                if text is None:
                    continue
                piece = text.add(token)
                if piece:
                    parts.append(piece)
                    yield piece
                if text.stopped:
                    finish = "stop"
                    break
            rest = text.finish() if text is not None else ""
            if rest:
                parts.append(rest)
                yield rest
        finally:
            steps.close()  # a stop string, or a consumer that stopped reading
            self.last = Generation(
                np.array(chosen, np.int64),
                np.stack(seen).astype(np.float32) if seen else None,
                finish,
                "".join(parts) if text is not None else None,
            )

    def steps(
        self,
        prompt: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        sampling: Sampling,
        *,
        ignore_eos: bool = False,
        keep_logits: bool = False,
        reuse: bool = False,
    ) -> Steps:
        """Each generated id as it is drawn, with its logits (keep_logits) and why the
        generation ends after it ("" while it goes on, else "eos" or "length"). reuse: start
        from the KV rows a previous call left for a common prefix of ids (chat turns)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise UsageError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        # The last id is only handed back, never fed: it takes no cache row.
        ids = self.tokens(prompt, max_new_tokens - 1)
        eos = frozenset() if ignore_eos else frozenset(self.generation_config.eos_ids)
        seed = sampling.seed if sampling.seed is not None else fresh_seed()
        if (
            self.comm is not None
            and self.comm.size > 1
            and not getattr(self.compiled, "lockstep", False)
        ):  # every rank runs this call: each must draw rank 0's ids (a lockstep leader's
            # followers take their inputs from it instead, qir.serving.lockstep)
            seed = self.comm.bcast(seed)
        return self._steps(ids, max_new_tokens, sampling, seed, eos, keep_logits, reuse)

    def _steps(
        self,
        ids: np.ndarray,
        max_new_tokens: int,
        sampling: Sampling,
        seed: int,
        eos: frozenset[int],
        keep_logits: bool,
        reuse: bool,
    ) -> Steps:
        start = self._cache.reusable(ids.tolist()) if reuse else 0
        ring = self.block.prefill_chunk
        if ring and len(self._cache.ids) - start >= ring:
            start = 0  # a sliding layer's ring has lapped the rows the prefix would keep
        self.stats = Stats(len(ids), 0, sampling=sampling.describe(), cached_tokens=start)
        self.stats.seed = None if sampling.is_greedy else seed
        self._cache.ids = []  # the prefill overwrites rows from `start` on
        self.compiled.prepare(len(ids) - start)  # its kernels compile before the clock starts
        t0 = time.perf_counter()
        out = self._run(ids[start:], start, sampling, seed)
        # The ids whose K/V rows the caches hold: a later chat turn may reuse them.
        fed = self._cache.ids = ids.tolist()
        for step in range(max_new_tokens):
            token = int(np.asarray(_host(out["next"]))[-1])
            logits = self._logits(out)[-1] if keep_logits else None
            now = time.perf_counter()
            if step == 0:
                self.stats.prefill_s = now - t0
            else:
                self.stats.decode_s = now - t0 - self.stats.prefill_s
            self.stats.new_tokens = step + 1
            last = step + 1 == max_new_tokens
            finish = "eos" if token in eos else "length" if last else ""
            yield token, logits, finish
            if finish:
                return
            out = self._step(token, len(fed), sampling, seed)
            fed.append(token)

    def _inputs(
        self, ids: np.ndarray, start: int, sampling: Sampling | None, seed: int
    ) -> dict[str, Any]:
        """The block's inputs for `ids` at positions start..; the last row drawn with
        `sampling` (None: no row is)."""
        inputs: dict[str, Any] = self.block.token_inputs(ids, start)
        if sampling is not None:
            inputs["sampling"][-1] = sampling.row()
            inputs["seed"][-1] = seed_row(seed)
        return inputs

    def _run(
        self, ids: np.ndarray, start: int, sampling: Sampling | None, seed: int
    ) -> dict[str, Any]:
        """The block on `ids` at positions start.. (a prefill): one run, or runs of at most
        the block's prefill_chunk rows where sliding layers keep rings (their outputs
        concatenated)."""
        chunk = self.block.prefill_chunk
        if not chunk or len(ids) <= chunk:
            return self._run_once(ids, start, sampling, seed)
        outs = [
            self._run_once(
                ids[i : i + chunk], start + i, sampling if i + chunk >= len(ids) else None, seed
            )
            for i in range(0, len(ids), chunk)
        ]
        xp: Any = np
        if self.compiled.backend == "cuda":
            import cupy

            xp = cupy
        return {k: xp.concatenate([o[k] for o in outs]) for k in outs[-1]}

    def _run_once(
        self, ids: np.ndarray, start: int, sampling: Sampling | None, seed: int
    ) -> dict[str, Any]:
        inputs = self._inputs(ids, start, sampling, seed)
        if self.compiled.backend == "cuda":
            # Device inputs keep the outputs on the device: only the id (and the logits where
            # asked) are copied back, not [T, vocab] logits of a long prompt.
            import cupy

            inputs = {k: cupy.asarray(v) for k, v in inputs.items()}
        return self.compiled(inputs)

    def _step(self, token: int, position: int, sampling: Sampling, seed: int) -> dict[str, Any]:
        """One decode step (M = 1) on a capture of the block where the backend has one."""
        if self._decode is None:
            self._decode = (
                self.compiled.capture(1) if self.compiled.backend != "reference" else self.compiled
            )
        return self._decode(self._inputs(np.array([token]), position, sampling, seed))

    def _logits(self, out: dict[str, Any]) -> np.ndarray:
        a = _host(out["logits"])
        act = self.block.graph.node("logits").type
        assert isinstance(act, TensorType)
        if a.dtype != act.dtype.np:  # the cuda backend hands 16-bit floats back as raw bits
            a = a.view(act.dtype.np)
        return a.astype(np.float32)


def _host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
