"""A whole model: logits for a prompt and greedy generation with the KV cache.

    from qir.models import Model
    model = Model.load("path/to/checkpoint", backend="host")
    gen = model.generate([3, 10, 17], max_new_tokens=8)   # gen.tokens, gen.logits

The model is one compiled `model` block (every layer; one KV cache per layer as the block's
state, preallocated for `max_seq` rows). Generation runs the prompt once (prefill, positions
0..T-1), then one token per step (decode, M = 1) replaying a capture of the block where the
backend has one: the token and its position are inputs copied into the capture's buffers, so
one capture serves every step. Token ids in, token ids out: no tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qir.api import Compiled, compile
from qir.dtypes import DType
from qir.errors import UsageError
from qir.models.blocks import Block, build
from qir.models.checkpoint import Checkpoint, load
from qir.types import TensorType


@dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # int64 [N]: the generated ids
    logits: np.ndarray  # float32 [N, vocab]: the logits each step chose its id from


class Model:
    def __init__(
        self,
        ck: Checkpoint,
        backend: str = "reference",
        act: DType | None = None,
        max_seq: int | None = None,
        passes: str | Sequence[str] = "default",
        weight_quantization: str = "declared",
        target: str | None = None,  # the GPU the kernels are for (qir.compile's)
    ) -> None:
        self.checkpoint = ck
        self.block: Block = build(ck, "model", 0, act, max_seq)
        self.max_seq = self.block.max_seq
        self.vocab_size = ck.vocab_size
        self.compiled: Compiled = compile(
            self.block.graph,
            self.block.weights,
            backend=backend,
            passes=passes,
            weight_quantization=weight_quantization,
            target=target,
        )
        self._decode: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None

    @classmethod
    def load(cls, path: str | Path, **options: Any) -> Model:
        """The checkpoint at `path`; options as Model's."""
        return cls(load(path), **options)

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
        pos = np.arange(start, start + len(ids), dtype=np.int32)
        return self._logits(self.compiled({"ids": ids, "pos": pos}))

    def logits(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 logits [T, vocab] of a fresh sequence (positions 0..T-1)."""
        return self.forward(tokens, 0)

    def generate(
        self,
        tokens: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Greedy: prefill `tokens`, then `max_new_tokens` ids, each the argmax of the logits of
        the one before (no stop token). `on_token` sees each id as it is chosen."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise UsageError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        # The last id is only printed, never fed back: it takes no cache row.
        ids = self.tokens(tokens, max_new_tokens - 1)
        logits = self.forward(ids, 0)[-1]
        chosen: list[int] = []
        seen: list[np.ndarray] = []
        for step in range(max_new_tokens):
            token = int(np.argmax(logits))
            chosen.append(token)
            seen.append(logits)
            if on_token is not None:
                on_token(token)
            if step + 1 < max_new_tokens:
                logits = self._step(token, len(ids) + step)
        return Generation(np.array(chosen, np.int64), np.stack(seen).astype(np.float32))

    def _step(self, token: int, position: int) -> np.ndarray:
        """Logits [vocab] of one token at `position` (decode, M = 1)."""
        inputs = {"ids": np.array([token], np.int32), "pos": np.array([position], np.int32)}
        if self._decode is None:
            self._decode = (
                self.compiled.capture(1) if self.compiled.backend != "reference" else self.compiled
            )
        return self._logits(self._decode(inputs))[0]

    def _logits(self, out: dict[str, Any]) -> np.ndarray:
        a = out["logits"]
        a = a.get() if hasattr(a, "get") else np.asarray(a)
        act = self.block.graph.node("logits").type
        assert isinstance(act, TensorType)
        if a.dtype != act.dtype.np:  # the cuda backend hands 16-bit floats back as raw bits
            a = a.view(act.dtype.np)
        return a.astype(np.float32)
