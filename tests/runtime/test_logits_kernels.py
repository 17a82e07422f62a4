"""The adjust_logits and logprobs kernels against the interpreter (qir.logits), and those
definitions against by-hand references: vLLM's penalty formulas over dense per-token counts,
and numpy's log-softmax. Ragged vocabularies, every dtype, masked tokens, rows skipped, ties;
captured, and under a reversed schedule on the host."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qir import logits as lg
from qir.api import compile
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32, I32, DType
from qir.graph import Graph
from qir.ops import IRTypeError


def adjust_graph(vocab: int, entries: int, act: DType) -> Graph:
    b = Builder("adjust")
    z = b.input("logits", ("M", vocab), act)
    out = b.adjust_logits(
        z,
        b.input("penalties", ("M", 3), F32),
        b.input("tokens", ("M", entries), I32),
        b.input("counts", ("M", entries), I32),
        b.input("bias", ("M", entries), F32),
        b.input("allow", ("M", lg.allow_words(vocab)), I32),
        name="out",
    )
    b.output("out", out)
    return b.graph


def logprobs_graph(vocab: int, k: int, act: DType) -> Graph:
    b = Builder("scores")
    z = b.input("logits", ("M", vocab), act)
    ids, values = b.logprobs(
        z, b.input("drawn", ("M",), I32), b.input("targets", ("M",), I32), k, name="lp"
    )
    b.output("ids", ids)
    b.output("values", values)
    return b.graph


def _act(a: np.ndarray, act: DType) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16 if act == BF16 else act.np)


def adjust_inputs(rng: np.random.Generator, m: int, vocab: int, entries: int, act: DType) -> dict:
    tokens = np.full((m, entries), -1, np.int32)
    counts = np.zeros((m, entries), np.int32)
    for r in range(m):
        n = int(rng.integers(0, entries + 1))
        tokens[r, :n] = rng.choice(vocab, n, replace=False)
        counts[r, :n] = rng.integers(-1, 4, n)
    allowed = rng.random((m, vocab)) < rng.choice([1.0, 0.7, 0.05], (m, 1))
    return {
        "logits": _act(rng.standard_normal((m, vocab)) * 3, act),
        "penalties": np.stack(
            [
                rng.choice([1.0, 1.3, 0.7], m),
                rng.choice([0.0, 0.5, -1.1], m),
                rng.choice([0.0, 1.5, -0.4], m),
            ],
            axis=1,
        ).astype(np.float32),
        "tokens": tokens,
        "counts": counts,
        "bias": rng.uniform(-5, 5, (m, entries)).astype(np.float32),
        "allow": np.stack([lg.bitmask(a, vocab) for a in allowed]),
    }


def vllm_penalties(z: np.ndarray, inputs: dict, r: int) -> np.ndarray:
    """vLLM's order over dense per-token tensors: mask, logit_bias, then apply_penalties
    (repetition where the prompt or the output holds a token; frequency times the output count;
    presence where the output holds it)."""
    vocab = z.shape[0]
    z = np.where(lg.allowed(inputs["allow"][r], vocab), z.astype(np.float32), -np.inf)
    z = z.astype(np.float32)
    bias, seen, out_counts = np.zeros(vocab, np.float32), np.zeros(vocab, bool), np.zeros(vocab)
    for t, n, b in zip(inputs["tokens"][r], inputs["counts"][r], inputs["bias"][r], strict=True):
        if t >= 0:
            bias[t], seen[t], out_counts[t] = b, n >= 0, max(n, 0)
    rep, freq, pres = inputs["penalties"][r]
    z = (z + bias).astype(np.float32)
    with np.errstate(invalid="ignore"):
        z = np.where(seen, np.where(z > 0, z / rep, z * rep), z).astype(np.float32)
        z = (z - (freq * out_counts.astype(np.float32)).astype(np.float32)).astype(np.float32)
        z = (z - np.where(out_counts > 0, pres, np.float32(0))).astype(np.float32)
    return z


def test_adjust_logits_is_vllms_penalties_and_bias() -> None:
    inputs = adjust_inputs(np.random.default_rng(1), 12, 300, 40, F32)
    got = lg.adjust_logits(**inputs)
    for r in range(12):
        np.testing.assert_array_equal(got[r], vllm_penalties(inputs["logits"][r], inputs, r))
    # By hand: a repeated positive logit 2 under repetition 2, frequency 0.5 x 3, presence 1.
    one = {k: v[:1].copy() for k, v in inputs.items()}
    one["logits"][0, 7] = 2.0
    one["allow"][:] = lg.ALL_ALLOWED
    one["penalties"][0] = (2.0, 0.5, 1.0)
    one["tokens"][0, :] = -1
    one["tokens"][0, :2] = (7, 8)
    one["counts"][0, :2] = (3, -1)
    one["bias"][0, :2] = (0.0, 10.0)
    out = lg.adjust_logits(**one)[0]
    assert out[7] == 2.0 / 2 - 1.5 - 1.0
    assert out[8] == np.float32(one["logits"][0, 8] + np.float32(10.0))


@pytest.mark.parametrize(("vocab", "act"), [(100, F16), (301, BF16), (1000, F32)])
def test_adjust_logits_kernel_equals_the_interpreter(vocab: int, act: DType) -> None:
    graph = adjust_graph(vocab, 50, act)
    inputs = adjust_inputs(np.random.default_rng(vocab), 20, vocab, 50, act)
    want = compile(graph, {}, backend="reference")(inputs)["out"]
    compiled = compile(graph, {}, backend="host")
    assert np.asarray(compiled(inputs)["out"]).tobytes() == want.tobytes()
    assert np.isinf(want).any() and np.isfinite(want).any()
    assert np.asarray(compiled.capture(20)(inputs)["out"]).tobytes() == want.tobytes()


def scores_inputs(rng: np.random.Generator, m: int, vocab: int, act: DType) -> dict:
    z = rng.standard_normal((m, vocab)) * rng.uniform(0.5, 6, (m, 1))
    z[0, 5:20] = z[0].max() + 1  # ties at the top: the lower ids first
    z[1, :] = 0.0
    z[1, 3] = -0.0
    return {
        "logits": _act(z, act),
        "drawn": rng.integers(-1, vocab, m).astype(np.int32),
        "targets": rng.choice([lg.DRAWN, lg.SKIP, 0, vocab - 1, 3], m).astype(np.int32),
    }


def test_logprobs_are_the_log_softmax() -> None:
    rng = np.random.default_rng(2)
    inputs = scores_inputs(rng, 16, 77, F32)
    ids, values = lg.logprobs(inputs["logits"], inputs["drawn"], inputs["targets"], 5)
    z = inputs["logits"].astype(np.float64)
    want = z - z.max(1, keepdims=True)
    want -= np.log(np.exp(want).sum(1, keepdims=True))
    for r in range(16):
        target = inputs["drawn"][r] if inputs["targets"][r] == lg.DRAWN else inputs["targets"][r]
        if target < 0:
            assert ids[r].tolist() == [-1] * 6 and not values[r].any()
            continue
        order = sorted(range(77), key=lambda t: (-z[r, t], t))[:5]
        assert ids[r].tolist() == [target, *order]
        np.testing.assert_allclose(values[r], want[r, ids[r]], rtol=1e-6, atol=1e-6)
    assert ids[0, 1:].tolist() == list(range(5, 10))
    assert ids[1, 1:].tolist() == list(range(5))  # -0 ties with 0


@pytest.mark.parametrize(("vocab", "k", "act"), [(50, 20, F16), (513, 5, BF16), (1000, 0, F32)])
def test_logprobs_kernel_equals_the_interpreter(
    vocab: int, k: int, act: DType, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = logprobs_graph(vocab, k, act)
    inputs = scores_inputs(np.random.default_rng(vocab), 24, vocab, act)
    want = compile(graph, {}, backend="reference")(inputs)
    compiled = compile(graph, {}, backend="host")
    for got in (compiled(inputs), compiled.capture(24)(inputs)):
        assert np.asarray(got["ids"]).tolist() == want["ids"].tolist()
        np.testing.assert_allclose(np.asarray(got["values"]), want["values"], rtol=2e-7, atol=1e-7)
    monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
    assert np.asarray(compiled(inputs)["ids"]).tolist() == want["ids"].tolist()


def test_the_ops_refuse_what_they_cannot_take() -> None:
    b = Builder()
    z = b.input("z", ("M", 64), F16)
    pen, two = b.input("pen", ("M", 3), F32), b.input("two", ("M", 2), F32)
    tokens, counts = b.input("t", ("M", 8), I32), b.input("c", ("M", 7), I32)
    bias, allow = b.input("b", ("M", 8), F32), b.input("a", ("M", 2), I32)
    with pytest.raises(IRTypeError, match=r"must be f32\[M, 3\]"):
        b.adjust_logits(z, two, tokens, tokens, bias, allow)
    with pytest.raises(IRTypeError, match=r"operand 3 .* must be i32\[M, 8\] \(a count"):
        b.adjust_logits(z, pen, tokens, counts, bias, allow)
    with pytest.raises(IRTypeError, match=r"operand 5 .* must be i32\[M, 2\] \(a bit per token"):
        b.adjust_logits(z, pen, tokens, tokens, bias, tokens)
    ids = b.input("ids", ("M",), I32)
    with pytest.raises(IRTypeError, match=r"k must be an int in 0..20"):
        b.logprobs(z, ids, ids, 21)
