"""What a sequence's next id may be, and how its logits are shifted: the rows of the model
block's adjust_logits op (qir.logits) for one sequence at one step.

- the allow bitmask: allowed_token_ids (only those), bad_words (a word's last token, where the
  ids before it end the output so far), min_tokens (the eos and stop ids held back until that
  many ids came) and a grammar's mask (qir.serving.grammar), all ANDed;
- the entries: logit_bias, and the penalties' per-token counts (repetition over the prompt and
  the output, frequency and presence over the output, as vLLM applies them).

A sequence without any of these gives the default rows (Block.draw_inputs): nothing to do."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qir.errors import UsageError
from qir.logits import NO_PENALTIES, bitmask


@dataclass(frozen=True)
class Rules:
    """A request's restrictions and penalties (ids already tokenized)."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: frozenset[int] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("repetition_penalty", self.repetition_penalty, "a number > 0", lambda v: v > 0),
            ("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]", _in_2),
            ("presence_penalty", self.presence_penalty, "a number in [-2, 2]", _in_2),
        )
        for name, value, what, ok in checks:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise UsageError(f"{name} must be {what}, got {value!r}")
            if not (math.isfinite(value) and ok(value)):
                raise UsageError(f"{name} must be {what}, got {value}")
        for t, b in self.logit_bias.items():
            if not -100 <= b <= 100:
                raise UsageError(f"logit_bias: token {t}'s bias must be in [-100, 100], got {b}")
        if self.min_tokens < 0:
            raise UsageError(f"min_tokens must be at least 0, got {self.min_tokens}")

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
        ) != NO_PENALTIES

    @property
    def shifts(self) -> bool:
        """Whether the entries input has anything to do."""
        return self.penalized or bool(self.logit_bias)

    @property
    def masks(self) -> bool:
        return self.allowed_token_ids is not None or bool(self.bad_words) or self.min_tokens > 0


def _in_2(v: float) -> bool:
    return -2 <= v <= 2


class SeqRules:
    """One sequence's rules as it runs: the counts of its output, its grammar's state."""

    def __init__(
        self,
        rules: Rules,
        prompt: Sequence[int],
        vocab: int,
        held_back: frozenset[int],
        grammar: Any = None,
    ) -> None:
        self.rules = rules
        self.vocab = vocab
        self.held_back = held_back  # the ids min_tokens holds back: eos and stop_token_ids
        self.grammar = grammar
        self.prompt = frozenset(prompt) if rules.repetition_penalty != 1.0 else frozenset()
        self.output: Counter[int] = Counter()
        self.generated: list[int] = []

    @property
    def active(self) -> bool:
        return self.rules.shifts or self.rules.masks or self.grammar is not None

    def accept(self, token: int) -> None:
        """The sequence drew `token`."""
        self.output[token] += 1
        self.generated.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    def entries(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(tokens, counts, bias) rows of `width` entries, or None for the defaults."""
        r = self.rules
        if not r.shifts:
            return None
        seen: dict[int, int] = {}
        if r.penalized:
            seen = {t: 0 for t in self.prompt}
            seen.update(self.output)
        keys = sorted(seen.keys() | r.logit_bias.keys())
        if len(keys) > width:  # (the block's entries hold every distinct id of a sequence)
            raise AssertionError(f"{len(keys)} entries for a row of {width}")
        tokens = np.full(width, -1, np.int32)
        counts = np.zeros(width, np.int32)
        bias = np.zeros(width, np.float32)
        tokens[: len(keys)] = keys
        counts[: len(keys)] = [seen.get(t, -1) for t in keys]
        bias[: len(keys)] = [r.logit_bias.get(t, 0.0) for t in keys]
        return tokens, counts, bias

    def allow(self) -> np.ndarray | None:
        """The allow bitmask row, or None where nothing is masked."""
        r = self.rules
        if not r.masks and self.grammar is None:
            return None
        ok = np.ones(self.vocab, bool)
        if r.allowed_token_ids is not None:
            ok[:] = False
            ok[list(r.allowed_token_ids)] = True
        for word in r.bad_words:
            head = list(word[:-1])
            if not head or self.generated[-len(head) :] == head:
                ok[word[-1]] = False
        if len(self.generated) < r.min_tokens:
            ok[[t for t in self.held_back if t < self.vocab]] = False
        if self.grammar is not None:
            ok &= self.grammar.allowed()
        return bitmask(ok, self.vocab)
