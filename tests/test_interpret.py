"""The numpy reference against the tools' golden outputs, and its input checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

import qir
from qir import interpret
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32
from qir.interpret import BindError, gelu_tanh
from qir.models import load
from qir.models.blocks import build
from qir.ops import IRTypeError
from qir.types import TensorType
from tests.conftest import BACKENDS, DATA, FMT4, MLX_FIXTURES, mlp_graph, rel_err

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


def test_the_reference_backend_dequantizes_each_weight_once(rng, monkeypatch):
    """A compiled block on the reference backend keeps its dequantized weights between runs
    (a generation's steps), as read-only views: the same outputs as a fresh interpret, and
    the caller's arrays (a dense weight's is used as it is) are left writeable."""
    import importlib

    from qir.formats.dense import Dense
    from qir.types import QWeight

    module = importlib.import_module("qir.interpret")  # `qir.interpret` is the function
    graph, weights = mlp_graph(rng, 64, 128, FMT4)
    b = Builder("dense")
    x = b.input("x", ("M", 64), F32)
    b.output("y", b.qlinear(x, b.weight("w", QWeight(Dense(F32), 32, 64), name="w_w")))
    dense = {"w": {"weight": rng.standard_normal((32, 64), dtype=np.float32)}}
    calls = []
    real = module.dequantized
    monkeypatch.setattr(module, "dequantized", lambda *a: calls.append(a[0]) or real(*a))
    for g, w, act in ((graph, weights, np.float16), (b.graph, dense, np.float32)):
        c = qir.compile(g, w, backend="reference")
        calls.clear()
        for m in (1, 3, 1):
            xs = {"x": rng.standard_normal((m, 64)).astype(act)}
            ours = c(xs)
            fresh = interpret(g, xs, w)
            assert all(np.array_equal(ours[k], fresh[k]) for k in fresh)
        assert len(calls) == 4 * len(g.weights)  # once for c, once a fresh interpret
        assert all(a.flags.writeable for bufs in w.values() for a in bufs.values())


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


def test_gelu_tanh_is_torchs_tanh_approximation():
    x = np.linspace(-8, 8, 1001, dtype=np.float32)
    d = x.astype(np.float64)
    tanh_form = 0.5 * d * (1 + np.tanh(np.sqrt(2 / np.pi) * (d + 0.044715 * d**3)))
    np.testing.assert_allclose(gelu_tanh(x), tanh_form, rtol=1e-6, atol=1e-6)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in d])
    assert np.abs(gelu_tanh(x) - exact).max() < 5e-4  # the approximation's own error


@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_tanh_and_softcap_kernels_match_the_reference(backend, rng):
    """Ragged rows (N = 300, not a multiple of the 256 threads), bf16 and f32."""
    for act in (BF16, F32):
        b = Builder(f"ew_{act.name}")
        x = b.input("x", ("M", 300), act)
        b.output("y", b.softcap(b.gelu_tanh(x, name="g"), 5.0, name="c"))
        ours = qir.compile(b.graph, {}, backend=backend)
        ref = qir.compile(b.graph, {}, backend="reference")
        assert ours.launches_for(3) == 2
        xs = (4 * rng.standard_normal((3, 300))).astype(act.np)
        y, want = ours({"x": xs})["y"], ref({"x": xs})["y"]
        assert np.abs(want.astype(np.float32)).max() <= 5.0
        np.testing.assert_allclose(
            y.astype(np.float32),
            want.astype(np.float32),
            rtol=1e-2 if act is BF16 else 1e-5,
            atol=1e-6,
        )


def test_softcap_and_embedding_scale_refuse_bad_attributes():
    b = Builder("bad")
    x = b.input("x", ("M", 8), F16)
    with pytest.raises(IRTypeError, match=r"softcap: cap must be a positive float, got -1.0"):
        b.softcap(x, -1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_norm_before_a_residual_add_is_one_kernel(backend, rng):
    """norm_residual (Gemma's post-norms): r + rms_norm(x, w) with float32 weights, N = 300,
    one launch, the reference's numbers."""
    for act in (BF16, F32):
        b = Builder(f"post_norm_{act.name}")
        x, r = b.input("x", ("M", 300), act), b.input("r", ("M", 300), act)
        w = b.param("post", TensorType((300,), F32), name="w")
        b.output("y", b.add(r, b.rms_norm(x, w, 1e-6, name="n"), name="y"))
        weights = {"post": {"weight": (1 + 0.2 * rng.standard_normal(300)).astype(np.float32)}}
        ours = qir.compile(b.graph, weights, backend=backend)
        ref = qir.compile(b.graph, weights, backend="reference", passes="none")
        assert ours.launches_for(3) == 1
        xs = {k: rng.standard_normal((3, 300)).astype(act.np) for k in ("x", "r")}
        y, want = ours(xs)["y"], ref(xs)["y"]
        tol = 1e-2 if act is BF16 else 1e-5
        np.testing.assert_allclose(
            y.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol
        )
