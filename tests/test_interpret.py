"""The numpy reference against the tools' golden outputs, and its input checks."""

from __future__ import annotations

import numpy as np
import pytest

from qir import interpret
from qir.builder import Builder
from qir.dtypes import F16
from qir.interpret import BindError
from qir.models import load
from qir.models.blocks import build
from tests.conftest import DATA, FMT4, MLX_FIXTURES, mlp_graph, rel_err

GOLDEN_KEY = {"y": "mlp", "q": "q", "k": "k", "v": "v"}


@pytest.mark.parametrize("fixture", MLX_FIXTURES)
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_reference_matches_golden(fixture, block):
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), block, 0, F16)
    for m in (1, 5, 40):
        out = interpret(b.graph, {"x": golden[f"x.M{m}"]}, b.weights)
        for name, value in out.items():
            assert rel_err(value, golden[f"{GOLDEN_KEY[name]}.0.M{m}"]) <= 1e-2


@pytest.mark.parametrize("fixture", MLX_FIXTURES)
def test_reference_mlp_branch_matches_golden(fixture):
    """The MLP branch is ~10x smaller than the residual, so check it on its own."""
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), "mlp", 0, F16)
    b.graph.outputs.append(("branch", "down"))
    for m in (1, 5, 40):
        out = interpret(b.graph, {"x": golden[f"x.M{m}"]}, b.weights)
        assert rel_err(out["branch"], golden[f"mlpd.0.M{m}"]) <= 1e-2


def test_bind_errors_name_the_input(rng):
    g, w = mlp_graph(rng, 64, 128, FMT4)
    x = np.zeros((2, 64), np.float16)
    with pytest.raises(BindError, match=r"input %x: shape \[2, 65\], expected f16\[M, 64\]"):
        interpret(g, {"x": np.zeros((2, 65), np.float16)}, w)
    with pytest.raises(BindError, match=r"input %x: dtype float32, expected f16"):
        interpret(g, {"x": x.astype(np.float32)}, w)
    with pytest.raises(BindError, match=r"input %x .* was not given"):
        interpret(g, {}, w)
    with pytest.raises(BindError, match="weight 'down' was not given"):
        interpret(g, {"x": x}, {k: v for k, v in w.items() if k != "down"})


def test_inputs_are_not_modified(rng):
    b = Builder()
    x = b.input("x", ("M", 64), F16)
    b.output("y", b.add(x, x))
    xa = rng.standard_normal((3, 64)).astype(np.float16)
    keep = xa.copy()
    out = interpret(b.graph, {"x": xa}, {})
    np.testing.assert_array_equal(xa, keep)
    np.testing.assert_array_equal(out["y"], (keep.astype(np.float32) * 2).astype(np.float16))
