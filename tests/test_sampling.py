"""The sample op's definition (qir.sampling): its random numbers, its exp, and that its draws
follow the distribution transformers' warpers define (temperature, top-k, top-p, min-p)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qir import sampling

# Random123's known-answer vectors for Philox4x32-10 (counter, key, result).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "want"), PHILOX_KAT)
def test_philox_known_answers(counter, key, want) -> None:
    assert sampling.philox4x32(counter, key) == want


def test_exp_neg_is_exp_to_double_precision() -> None:
    x = -np.concatenate([np.geomspace(1e-12, 63.9, 5000), [0.0, 0.5, math.log(2) / 2]])
    got, want = sampling.exp_neg(x), np.exp(x)
    assert np.max(np.abs(got - want) / want) < 4e-16
    assert sampling.exp_neg(np.array([-64.5, -np.inf, np.nan])).tolist() == [0.0, 0.0, 0.0]


def test_ordered_keys_order_like_the_floats() -> None:
    v = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf], np.float32)
    keys = sampling.ordered(v)
    assert (np.diff(keys.astype(np.int64)) > 0).all()


def warped(z: np.ndarray, t: float, k: int, p: float, min_p: float) -> np.ndarray:
    """The probabilities transformers' warpers leave (float64, sorting), for logits without
    ties: TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper."""
    s = z.astype(np.float64) / t
    if k:
        s = np.where(s < np.sort(s)[-k], -np.inf, s)
    if p < 1:
        order = np.argsort(s)  # ascending, as TopPLogitsWarper sorts
        probs = np.exp(s[order] - s.max())
        probs /= probs.sum()
        remove = np.cumsum(probs) <= 1 - p
        remove[-1] = False
        s[order[remove]] = -np.inf
    if min_p:
        probs = np.exp(s - s.max())
        s = np.where(probs < min_p, -np.inf, s)
    out = np.exp(s - s.max())
    return out / out.sum()


def draws(z: np.ndarray, params: tuple[float, ...], n: int, seed: int = 7) -> np.ndarray:
    """Counts of n draws: a fresh position (the Philox counter) per draw."""
    row = np.array(params, np.float32)
    ids = [sampling.sample_row(z, row, seed, pos) for pos in range(n)]
    return np.bincount(ids, minlength=len(z))


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, alpha_z: float = 3.719) -> bool:
    """Pearson's test at alpha = 1e-4 (Wilson-Hilferty's critical value), over the tokens the
    expected distribution gives mass; a draw outside them fails at once."""
    if counts[probs == 0].any():
        return False
    n, live = counts.sum(), probs > 0
    expected = n * probs[live]
    stat = float(np.sum((counts[live] - expected) ** 2 / expected))
    df = int(live.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


LOGITS = np.random.default_rng(3).permutation(np.linspace(-3.0, 3.0, 40)).astype(np.float32)
SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.5, 10, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (1.3, 25, 0.9, 0.02),
]


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_draws_follow_the_warped_softmax(params: tuple[float, ...]) -> None:
    counts = draws(LOGITS, params, 6000)
    assert chi_square_ok(counts, warped(LOGITS, *params))


def test_the_chi_square_test_can_fail() -> None:
    # top-p 0.8 draws against the distribution without the nucleus cut, and plain draws
    # against a slightly hotter softmax.
    counts = draws(LOGITS, (1.0, 0, 0.8, 0.0), 6000)
    assert not chi_square_ok(counts, warped(LOGITS, 1.0, 0, 1.0, 0.0))
    counts = draws(LOGITS, (1.0, 0, 1.0, 0.0), 6000)
    assert not chi_square_ok(counts, warped(LOGITS, 1.1, 0, 1.0, 0.0))


def test_greedy_skip_and_ties() -> None:
    z = np.array([0.5, 2.0, -1.0, 2.0], np.float32)
    assert sampling.sample_row(z, np.array([0, 0, 1, 0], np.float32), 1, 0) == 1
    assert sampling.sample_row(z, np.array([-1, 0, 1, 0], np.float32), 1, 0) == sampling.SKIPPED
    # top-k 1 keeps both tied maxima (as transformers does): both are drawn.
    got = {sampling.sample_row(z, np.array([1, 1, 1, 0], np.float32), 1, p) for p in range(64)}
    assert got == {1, 3}
    # Nothing kept (min_p above 1): the greedy id.
    assert sampling.sample_row(z, np.array([1, 0, 1, 2.0], np.float32), 1, 0) == 1


def test_seed_and_position_decide_the_draw() -> None:
    row = np.array([1, 0, 1, 0], np.float32)
    a = [sampling.sample_row(LOGITS, row, 11, p) for p in range(50)]
    assert a == [sampling.sample_row(LOGITS, row, 11, p) for p in range(50)]
    assert a != [sampling.sample_row(LOGITS, row, 12, p) for p in range(50)]
    # Every one of a seed's 64 bits counts: the high word is the key's second word.
    assert a != [sampling.sample_row(LOGITS, row, 11 + (1 << 40), p) for p in range(50)]
    assert sampling.random_bits(2**64 - 1, 3) == sampling.random_bits(-1, 3)
    x = sampling.philox4x32((3, 0, 0, 0), (0x89ABCDEF, 0x1234567))
    assert sampling.random_bits(0x123456789ABCDEF, 3) == x[0] << 32 | x[1]
    rows = np.stack([sampling.seed_row(s) for s in (11, 11 + (1 << 40), -1)])
    assert rows.dtype == np.int32 and rows.tolist() == [[11, 0], [11, 256], [-1, -1]]
    drawn = sampling.sample(
        np.tile(LOGITS, (3, 1)), np.tile(row, (3, 1)), rows, np.full(3, 7, np.int32)
    )
    assert drawn.tolist() == [
        sampling.sample_row(LOGITS, row, s, 7) for s in (11, 11 + (1 << 40), -1)
    ]


def test_the_op_refuses_what_it_cannot_sample() -> None:
    from qir.builder import Builder
    from qir.dtypes import F16, F32, I32
    from qir.ops import IRTypeError

    b = Builder()
    seed, pos = b.input("seed", ("M", 2), I32), b.input("pos", ("M",), I32)
    params = b.input("params", ("M", 4), F32)
    wide = b.input("wide", ("M", 2**23 + 1), F16)
    with pytest.raises(IRTypeError, match=r"more than 2\^23 ids"):
        b.sample(wide, params, seed, pos)
    logits = b.input("logits", ("M", 64), F16)
    three = b.input("three", ("M", 3), F32)
    with pytest.raises(IRTypeError, match=r"must be f32\[M, 4\]"):
        b.sample(logits, three, seed, pos)
    with pytest.raises(IRTypeError, match="a 64-bit seed per row"):
        b.sample(logits, params, pos, pos)
    with pytest.raises(IRTypeError, match="one index per row"):
        b.sample(logits, params, seed, logits)
