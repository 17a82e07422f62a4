"""The `sample` op: one token id per row of logits, chosen on the device so a decode step hands
only the id back. This module is its definition; the interpreter runs it, and the kernel
(codegen/templates/sample.cu.j2) computes the same thing without sorting.

Per row m, with params[m] = (temperature, top_k, top_p, min_p), z = float32(logits[m]):

- temperature < 0: the row is not sampled; the result is -1 (a prefill's rows before its
  last, which no one reads).
- temperature 0 (or NaN): greedy, the first index of the largest z.
- else s = z * (1 / temperature) (float32, the reciprocal rounded once), and each token has an integer mass
  w = floor(e * 2^40) of its probability relative to the top token's, e = exp(s - max s) by
  `exp_neg` (float64). A token is kept when it passes, in
  transformers' order (temperature, top-k, top-p, min-p):
  - top-k (1 <= top_k < vocab): s >= the top_k-th largest s (ties with it are kept, as
    transformers' TopKLogitsWarper keeps them);
  - top-p (top_p < 1): with W the mass of the tokens top-k kept, the largest s such that the
    kept tokens with s at least that weigh top_p * W or more (float64 comparison) is the
    threshold: the nucleus, its ties kept together;
  - min-p (min_p > 0): e >= min_p (the token's probability over the top one's).
  Then r = floor(x * W' / 2^64), with W' the kept tokens' mass and x 64 bits of
  Philox4x32-10 (Salmon et al., SC'11) with counter (positions[m], 0, 0, 0) and key
  (seed[m, 0], seed[m, 1]) (a 64-bit seed's low and high words), and the result is the first kept token (in index order) whose running mass
  exceeds r: a draw from softmax(s) over the kept tokens, at the resolution of the masses (a
  token under 2^-40 of the top one's probability is never drawn). A seed and a position give
  the same id on every backend and in any batch.

Every step is exact or correctly rounded, so the kernel gives these ids bit for bit: masses
are integers (every sum exact in any order; the kernel adds them in parallel), e comes from
`exp_neg`, a fixed sequence of rounded float64 operations (no library exp, whose last bit
differs between libraries; the kernel spells the same operations without fused multiply-adds),
and comparisons of s are on its ordered integer key (float32 bits, negative values flipped),
which differs from float comparison only in -0 < +0."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qir.errors import UsageError

# The columns of the params input.
PARAMS = ("temperature", "top_k", "top_p", "min_p")
# A row whose temperature is below 0 is skipped and yields this id.
SKIPPED = -1
# Fixed-point bits of a token's mass: the sums over a vocabulary of up to 2^23 ids (the op's
# limit, qir.ops.MAX_VOCAB_BITS) stay below 2^64.
MASS_BITS = 40

# exp(x) for x <= 0: x = k ln2 + r with ln2 in two parts (the high one exact times any k
# here), exp(r) by its Taylor series to r^12 (|r| <= ln2/2: error below 2e-16), scaled by 2^k.
# Below EXP_FLOOR the result is 0: a mass would be 0 long before (e < 2^-40 at x < -27.8).
LOG2E = 1.4426950408889634
LN2_HI = 0.6931471803691238
LN2_LO = 1.9082149292705877e-10
EXP_COEFFS = tuple(1.0 / math.factorial(n) for n in range(12, -1, -1))
EXP_FLOOR = -64.0

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10


def philox4x32(
    counter: tuple[int, int, int, int], key: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Philox4x32-10 of one block: four uint32 counter words under two uint32 key words, on
    Python ints (a draw needs one block; numpy on one-element arrays was ~20x slower)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & 0xFFFFFFFF, (k1 + PHILOX_W[1]) & 0xFFFFFFFF
        p0, p1 = PHILOX_M[0] * c0, PHILOX_M[1] * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & 0xFFFFFFFF,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & 0xFFFFFFFF,
        )
    return c0, c1, c2, c3


def random_bits(seed: int, position: int) -> int:
    """The 64 random bits of a row at `position` drawn with `seed` (its low 64 bits: a
    negative seed is taken two's-complement)."""
    x = philox4x32((position & 0xFFFFFFFF, 0, 0, 0), (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    return x[0] << 32 | x[1]


def ordered(s: np.ndarray) -> np.ndarray:
    """uint32 keys ordered as the float32 values (negative: all bits flipped, else sign set)."""
    bits = np.ascontiguousarray(s, np.float32).view(np.uint32)
    negative = (bits >> np.uint32(31)).astype(bool)
    return np.where(negative, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def _first_argmax(values: np.ndarray) -> int:
    return int(np.flatnonzero(values == values.max())[0])


def exp_neg(x: np.ndarray) -> np.ndarray:
    """float64 exp(x) for x <= 0 (0 below EXP_FLOOR and for NaN), the kernel's operations in its
    order."""
    x = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        inside = x >= EXP_FLOOR
        x = np.where(inside, x, 0.0)
        k = np.floor(x * LOG2E + 0.5)
        r = (x - k * LN2_HI) - k * LN2_LO
        p = np.full_like(r, EXP_COEFFS[0])
        for c in EXP_COEFFS[1:]:
            p = p * r + c
        return np.where(inside, p * np.ldexp(1.0, k.astype(np.int64)), 0.0)


def masses(e: np.ndarray) -> np.ndarray:
    """uint64 floor(e * 2^MASS_BITS) of float64 e in [0, 1] (0 for NaN)."""
    return np.where(e > 0, np.floor(e * 2.0**MASS_BITS), 0).astype(np.uint64)


def sample_row(z: np.ndarray, params: np.ndarray, seed: int, position: int) -> int:
    """The id `sample` chooses for one row (see the module docstring)."""
    temperature, top_k, top_p, min_p = (float(p) for p in params)
    if temperature < 0:
        return SKIPPED
    z = np.asarray(z, np.float32)
    greedy = _first_argmax(ordered(z))
    if not temperature > 0:  # 0, or NaN
        return greedy
    s = (z * (np.float32(1) / np.float32(temperature))).astype(np.float32)
    key = ordered(s)
    vocab = len(s)
    keep = np.ones(vocab, bool)
    if 1 <= top_k < vocab:
        keep &= key >= np.sort(key)[vocab - int(top_k)]
    e = exp_neg(s.astype(np.float64) - np.float64(s[greedy]))  # s peaks where z does
    w = masses(e)
    if top_p < 1:
        target = top_p * float(np.sum(w[keep], dtype=np.uint64))
        # Down the distinct values of s: the mass of the kept tokens at or above each.
        order = np.argsort(key, kind="stable")[::-1]
        ks = key[order]
        at_least = np.cumsum(np.where(keep[order], w[order], 0), dtype=np.uint64)
        last = np.append(ks[1:] != ks[:-1], True)
        reached = np.flatnonzero(at_least[last].astype(np.float64) >= target)
        keep &= key >= ks[last][reached[0]]
    if min_p > 0:
        keep &= e >= min_p
    running = np.cumsum(np.where(keep, w, 0), dtype=np.uint64)
    total = int(running[-1])
    if total == 0:  # nothing kept (min_p above 1, NaN logits): the kernel's greedy start
        return greedy
    r = random_bits(seed, position) * total >> 64
    return int(np.searchsorted(running, r, side="right"))


def sample(
    logits: np.ndarray, params: np.ndarray, seed: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """int32 [M]: `sample_row` of every row (seed: int32 [M, 2], each row's low and high
    words)."""
    words = np.asarray(seed).astype(np.uint32).astype(np.int64)
    return np.array(
        [
            sample_row(
                logits[m], params[m], int(words[m, 0] | words[m, 1] << 32), int(positions[m])
            )
            for m in range(len(logits))
        ],
        np.int32,
    )


@dataclass(frozen=True)
class Sampling:
    """How a generation chooses its ids: the params row of the sample op and a seed (None: a
    fresh one per generation). temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        checks: tuple[tuple[str, object, str, Callable[[float], bool]], ...] = (
            ("temperature", self.temperature, "a number >= 0", lambda v: v >= 0),
            ("top_p", self.top_p, "a number in (0, 1]", lambda v: 0 < v <= 1),
            ("min_p", self.min_p, "a number in [0, 1]", lambda v: 0 <= v <= 1),
        )
        for name, value, what, ok in checks:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise UsageError(f"{name} must be {what}, got {value!r}")
            if not (math.isfinite(value) and ok(value)):
                raise UsageError(f"{name} must be {what}, got {value}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UsageError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise UsageError(f"seed must be an int, got {self.seed!r}")

    @classmethod
    def greedy(cls, seed: int | None = None) -> Sampling:
        return cls(seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def row(self) -> np.ndarray:
        """float32 [4]: this sampling as a row of the sample op's params."""
        return np.array([self.temperature, self.top_k, self.top_p, self.min_p], np.float32)

    def describe(self) -> str:
        if self.is_greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top_k {self.top_k}"] if self.top_k else []
        parts += [f"top_p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"min_p {self.min_p:g}"] if self.min_p else []
        return ", ".join(parts)


def seed_row(seed: int) -> np.ndarray:
    """A seed of any size as the op's int32 [2] row: its low 64 bits, low word first."""
    words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF]
    return np.array(words, np.uint32).view(np.int32)


def fresh_seed() -> int:
    """A random 64-bit seed (a generation given none)."""
    return int.from_bytes(os.urandom(8), "little")
