"""The sampling kernel against the interpreter (qir.sampling): the same ids bit for bit, for
every activation dtype, ragged vocabularies, every mask and skipped rows; under a reversed
schedule; captured; and its draws follow the warped softmax (chi-square)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qir.api import compile
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32, I32, DType
from qir.graph import Graph
from tests.conftest import BACKENDS
from tests.test_sampling import LOGITS, SETTINGS, chi_square_ok, warped


def sample_graph(vocab: int, act: DType) -> Graph:
    b = Builder("sample")
    logits = b.input("logits", ("M", vocab), act)
    params = b.input("params", ("M", 4), F32)
    seed = b.input("seed", ("M", 2), I32)
    pos = b.input("pos", ("M",), I32)
    b.output("next", b.sample(logits, params, seed, pos, name="next"))
    return b.graph


def random_inputs(rng: np.random.Generator, m: int, vocab: int, act: DType) -> dict:
    scale = rng.uniform(0.1, 8.0, (m, 1))
    logits = rng.standard_normal((m, vocab)) * scale
    logits[0, : vocab // 3] = logits[0].max()  # ties at the top
    params = np.stack(
        [
            rng.choice([-1.0, 0.0, 0.3, 1.0, 2.0], m),
            rng.choice([0, 1, 5, 50, vocab - 1, vocab + 7], m),
            rng.choice([1.0, 0.95, 0.5, 0.01], m),
            rng.choice([0.0, 0.02, 0.3], m),
        ],
        axis=1,
    ).astype(np.float32)
    return {
        "logits": logits.astype(act.np if act != BF16 else ml_dtypes.bfloat16),
        "params": params,
        "seed": rng.integers(-(2**31), 2**31, (m, 2)).astype(np.int32),
        "pos": rng.integers(0, 100_000, m).astype(np.int32),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("vocab", "act"), [(100, F16), (1000, BF16), (2053, F32)])
def test_kernel_ids_equal_the_interpreter(
    backend: str, vocab: int, act: DType, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = sample_graph(vocab, act)
    inputs = random_inputs(np.random.default_rng(vocab), 96, vocab, act)
    want = compile(graph, {}, backend="reference")(inputs)["next"]
    compiled = compile(graph, {}, backend=backend)
    got = np.asarray(compiled(inputs)["next"])
    assert got.tolist() == want.tolist()
    assert (want[inputs["params"][:, 0] < 0] == -1).all() and (want >= -1).all()
    assert compiled.capture(96)(inputs)["next"].tolist() == want.tolist()
    if backend == "host":
        monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
        assert np.asarray(compiled(inputs)["next"]).tolist() == want.tolist()


@pytest.mark.parametrize("params", SETTINGS[3:], ids=str)
def test_kernel_draws_follow_the_warped_softmax(params: tuple[float, ...]) -> None:
    n = 3000
    graph = sample_graph(len(LOGITS), F32)
    inputs = {
        "logits": np.tile(LOGITS, (n, 1)),
        "params": np.tile(np.array(params, np.float32), (n, 1)),
        "seed": np.tile(np.array([5, 0], np.int32), (n, 1)),
        "pos": np.arange(n, dtype=np.int32),
    }
    ids = np.asarray(compile(graph, {}, backend="host")(inputs)["next"])
    assert chi_square_ok(np.bincount(ids, minlength=len(LOGITS)), warped(LOGITS, *params))
