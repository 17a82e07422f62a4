"""Generated kernels on the host backend (and, where marked, the cuda backend on a GPU) against the
numpy interpreter and the tools' goldens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qir
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from qir.models import load
from qir.models.blocks import build
from tests.conftest import BACKENDS, DATA, MLX_FIXTURES, max_rel, mlp_graph, random_weight, rel_err
from tests.passes.test_fusion import random_graphs

GOLDEN_KEY = {"y": "mlp", "q": "q", "k": "k", "v": "v"}
# Host and reference differ only in fp32 summation order, then both round to the act dtype.
TOL = {F16: 2e-3, BF16: 1.6e-2, F32: 1e-5}


# Fused, each qlinear has a GEMV and the GEMM's two tile buckets (select_kernels); unfused
# (no select_kernels), one GEMV per node.
KERNELS = {("mlp", "default"): 6, ("qkv", "default"): 3, ("mlp", "none"): 6, ("qkv", "none"): 3}


@pytest.mark.parametrize("passes", ["default", "none"])
@pytest.mark.parametrize("fixture", MLX_FIXTURES)
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_host_matches_reference_and_golden(fixture, block, passes):
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), block, 0, F16)
    host = qir.compile(b.graph, b.weights, backend="host", passes=passes)
    ref = qir.compile(b.graph, b.weights, backend="reference")
    # the mixed checkpoint's 3-bit q/k and 6-bit v: one GEMV of two parts and one GEMM a bucket
    # (each format's fragment in it), as for one format
    assert host.kernel_count == KERNELS[block, passes]
    for m in (1, 5, 40):
        x = golden[f"x.M{m}"]
        ours, theirs = host({"x": x}), ref({"x": x})
        for name, value in ours.items():
            assert value.dtype == np.float16
            assert max_rel(value, theirs[name]) <= TOL[F16], (name, m)
            assert rel_err(value, golden[f"{GOLDEN_KEY[name]}.0.M{m}"]) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", [F16, BF16, F32], ids=lambda d: d.name)
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_mlp_all_act_dtypes(rng, act, m, backend):
    """M=11 spans two m-tiles of 8, the second one partial."""
    g, w = mlp_graph(rng, 192, 96, MlxAffine(4, 32, BF16), act)
    x = rng.standard_normal((m, 192), dtype=np.float32).astype(act.np)
    ours = qir.compile(g, w, backend=backend)({"x": x})["y"]
    ref = qir.compile(g, w, backend="reference")({"x": x})["y"]
    assert max_rel(ours, ref) <= TOL[act]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 37, 130, 4099])
def test_qlinear_out_features_not_a_multiple_of_rows_per_block(rng, n, m, backend):
    qw, bufs = random_weight(rng, n, 128, MlxAffine(4, 64, F16))
    b = Builder()
    x = b.input("x", ("M", 128), F16)
    b.output("y", b.qlinear(x, b.weight("w", qw)))
    xa = rng.standard_normal((m, 128), dtype=np.float32).astype(np.float16)
    ours = qir.compile(b.graph, {"w": bufs}, backend=backend)({"x": xa})["y"]
    ref = qir.compile(b.graph, {"w": bufs}, backend="reference")({"x": xa})["y"]
    assert ours.shape == (m, n)
    assert max_rel(ours, ref) <= TOL[F16]


@pytest.mark.parametrize(
    "fmt",
    [MlxAffine(4, 32, BF16), Gptq(4, 32, "gptq", 1, F16), Nvfp4("div", 16)],
    ids=lambda f: f.tag(),
)
def test_short_rows_in_groups_of_lanes(rng, fmt):
    """Rows of 5 chunks (one lane a row, its last pass one chunk) and 12 (two lanes, three
    passes), N = 37 (no multiple of a group's rows): a gate/up pair with silu(g) * u, a plain
    projection with a residual, on the packed and the float path, at decode and in tiles."""
    for k in (160, 384):
        b = Builder("short")
        x = b.input("x", ("M", k), F16)
        r = b.input("r", ("M", 37), F16)
        weights, ws = {}, {}
        for name in ("gate", "up", "p"):
            qw, weights[name] = random_weight(rng, 37, k, fmt)
            ws[name] = b.weight(name, qw, name=f"w_{name}")
        b.output("h", b.mul(b.silu(b.qlinear(x, ws["gate"])), b.qlinear(x, ws["up"])))
        b.output("y", b.add(r, b.qlinear(x, ws["p"])))
        ours = qir.compile(b.graph, weights, backend="host")
        lanes = f"_m8_l{1 if k == 160 else 2}"
        assert sum(lanes in la.kernel.name for la in ours.plan.launches) == 2
        ref = qir.compile(b.graph, weights, backend="reference")
        for m in (1, 3, 9):
            feed = {
                "x": rng.standard_normal((m, k), dtype=np.float32).astype(np.float16),
                "r": rng.standard_normal((m, 37), dtype=np.float32).astype(np.float16),
            }
            got, want = ours(feed), ref(feed)
            assert max_rel(got["y"], want["y"]) <= TOL[F16], (k, m)
            assert max_rel(got["h"], want["h"]) <= 2 * TOL[F16], (k, m)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bits=st.sampled_from([1, 2, 3, 4, 5, 6, 8]),
    group=st.sampled_from([32, 64, 128]),
    n=st.integers(1, 37),
    k_groups=st.integers(1, 3),
    m=st.integers(1, 9),
    scale_dtype=st.sampled_from([F16, BF16, F32]),
    seed=st.integers(0, 2**16),
)
def test_host_qlinear_equals_reference_for_any_format(
    bits, group, n, k_groups, m, scale_dtype, seed
):
    rng = np.random.default_rng(seed)
    k = group * k_groups
    qw, bufs = random_weight(rng, n, k, MlxAffine(bits, group, scale_dtype))
    b = Builder()
    x = b.input("x", ("M", k), F32)
    b.output("y", b.qlinear(x, b.weight("w", qw)))
    xa = rng.standard_normal((m, k), dtype=np.float32)
    ours = qir.compile(b.graph, {"w": bufs}, backend="host")({"x": xa})["y"]
    ref = qir.compile(b.graph, {"w": bufs}, backend="reference")({"x": xa})["y"]
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(graph=random_graphs(), seed=st.integers(0, 2**16), m=st.integers(1, 9))
def test_host_fused_random_graphs_equal_reference(graph, seed, m):
    """Whatever the passes fuse, the generated kernels compute what the interpreter does on the
    unfused graph (up to fp32 summation order)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for w in graph.weights:
        t = graph.node(w).type
        weights[graph.node(w).attr("key")] = random_weight(
            rng, t.out_features, t.in_features, t.format
        )[1]
    t = graph.node("x").type
    x = rng.standard_normal((m, t.shape[1])).astype(t.dtype.np)
    ours = qir.compile(graph, weights, backend="host")({"x": x})
    ref = qir.interpret(graph, {"x": x}, weights)
    for k in ref:
        scale = max(float(np.abs(ref[k].astype(np.float32)).max()), 1e-3)
        err = float(np.abs(ours[k].astype(np.float32) - ref[k].astype(np.float32)).max()) / scale
        assert err <= 2 * TOL[t.dtype], k
