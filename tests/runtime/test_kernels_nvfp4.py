"""NVFP4 kernels: host backend against the numpy reference and the tools' goldens for all three
conventions, random shapes (their NVRTC builds: tests/runtime/test_compile_gate.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qir
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32
from qir.formats.nvfp4 import Nvfp4
from qir.models import load
from qir.models.blocks import build
from qir.passes.manager import PIPELINES
from qir.types import QWeight
from tests.conftest import DATA, max_rel, max_rel_dot, rel_err

FIXTURES = ("modelopt_nvfp4_S", "ct_nvfp4a16_S", "ct_nvfp4_w4a4_S", "mlx_nvfp4_S")
GOLDEN_KEY = {"y": "mlp", "q": "q", "k": "k", "v": "v"}


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_host_matches_reference_and_w4a16_golden(fixture, block):
    """The plain keys: NVFP4 weights, unquantized activations (--weight-quantization w4a16)."""
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), block, 0, F16)
    host = qir.compile(b.graph, b.weights, backend="host", weight_quantization="w4a16")
    ref = qir.compile(b.graph, b.weights, backend="reference", weight_quantization="w4a16")
    for m in (1, 5, 40):
        x = golden[f"x.M{m}"]
        ours, theirs = host({"x": x}), ref({"x": x})
        for name, value in ours.items():
            assert max_rel(value, theirs[name]) <= 2e-3, (name, m)
            assert rel_err(value, golden[f"{GOLDEN_KEY[name]}.0.M{m}"]) <= 1e-2, (name, m)
            assert rel_err(theirs[name], golden[f"{GOLDEN_KEY[name]}.0.M{m}"]) <= 1e-2


W4A4_FIXTURES = ("ct_nvfp4_w4a4_S", "modelopt_nvfp4_S")
# Launches per block under W4A4 (declared), at M = 1: a quantize_act for each 4-bit input
# (x; in the MLP also silu(g)*u, stored by the gate/up pair) and the GEMVs. In the plan, each
# qlinear also has its W4A4 GEMM (from select_kernels' crossover to 64 rows) and a 16-bit GEMM
# twin for M > 64. With silu(g)*u in down_proj's prologue instead (the fallback for gate and up
# that cannot be paired), down_proj quantizes it there: one launch fewer.
PROLOGUE = tuple(p for p in PIPELINES["default"] if p != "silu_epilogue")
W4A4_LAUNCHES = {("mlp", "default"): (4, 8), ("qkv", "default"): (2, 4), ("mlp", PROLOGUE): (3, 7)}


# q/k/v has no SiLU, so the prologue pipeline is the default there.
BLOCK_PASSES = [
    pytest.param("mlp", "default", id="mlp-default"),
    pytest.param("mlp", PROLOGUE, id="mlp-prologue"),
    pytest.param("mlp", "none", id="mlp-none"),
    pytest.param("qkv", "default", id="qkv-default"),
    pytest.param("qkv", "none", id="qkv-none"),
]


@pytest.mark.parametrize("fixture", W4A4_FIXTURES)
@pytest.mark.parametrize(("block", "passes"), BLOCK_PASSES)
def test_host_w4a4_matches_reference_and_the_tools_fake_quantized_golden(fixture, block, passes):
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), block, 0, F16)
    host = qir.compile(b.graph, b.weights, backend="host", passes=passes)
    ref = qir.compile(b.graph, b.weights, backend="reference", passes=passes)
    routed = passes != "none"  # the unfused pipeline does not route
    if routed:
        assert (host.launches_for(1), host.kernel_count) == W4A4_LAUNCHES[block, passes]
    suffix = "_a4" if routed else ""
    for m in (1, 5, 40):
        x = golden[f"x.M{m}"]
        ours = host({"x": x})
        for name, value in ours.items():
            assert max_rel(value, ref({"x": x})[name]) <= 2e-3, (name, m)
            assert rel_err(value, golden[f"{GOLDEN_KEY[name]}{suffix}.0.M{m}"]) <= 1e-2, (name, m)


def test_host_w4a4_runs_the_16_bit_twins_above_64_rows():
    b = build(load(DATA / "ct_nvfp4_w4a4_S"), "mlp", 0, F16)
    host = qir.compile(b.graph, b.weights, backend="host")
    w4a16 = qir.compile(b.graph, b.weights, backend="reference", weight_quantization="w4a16")
    x = {"x": np.random.default_rng(0).standard_normal((65, 256)).astype(np.float16)}
    assert max_rel(host(x)["y"], w4a16(x)["y"]) <= 2e-3


@pytest.mark.parametrize("tier", ["w4a4"])
@pytest.mark.parametrize("fixture", ["ct_nvfp4a16_S", "mlx_nvfp4_S"])
def test_host_forced_w4a4_with_per_row_scales_matches_reference(fixture, tier):
    """W4A16 checkpoints forced to 4-bit activations: no calibrated scale, so each row gets its
    own global scale at run time, in each quantize_act (x, and silu(g)*u for down_proj)."""
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), "mlp", 0, F16)
    host = qir.compile(b.graph, b.weights, backend="host", weight_quantization=tier)
    ref = qir.compile(b.graph, b.weights, backend="reference", weight_quantization=tier)
    quantizers = [k.kernel.name for k in host.plan.launches if k.kernel.name.startswith("quant")]
    assert len(quantizers) == 2 and all(k.endswith("_dynamic") for k in quantizers)
    for m in (1, 5):
        x = {"x": golden[f"x.M{m}"]}
        assert max_rel(host(x)["y"], ref(x)["y"]) <= 2e-3


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mode=st.sampled_from(["mul", "div"]),
    act_bits=st.sampled_from([4, 16]),
    n=st.integers(1, 37),
    blocks=st.integers(1, 9),
    m=st.integers(1, 9),
    act=st.sampled_from([F16, BF16, F32]),
    seed=st.integers(0, 2**16),
)
def test_host_qlinear_equals_reference(mode, act_bits, n, blocks, m, act, seed):
    """Odd block counts take the 16-element chunk path; n spans partial 4-row blocks."""
    rng = np.random.default_rng(seed)
    k = 16 * blocks
    fmt = Nvfp4(mode, act_bits)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    bufs = fmt.quantize(w, input_amax=3.0)
    b = Builder()
    x = b.input("x", ("M", k), act)
    b.output("y", b.qlinear(x, b.weight("w", QWeight(fmt, n, k))))
    xa = rng.standard_normal((m, k), dtype=np.float32).astype(act.np)
    ours = qir.compile(b.graph, {"w": bufs}, backend="host")({"x": xa})["y"]
    ref = qir.compile(b.graph, {"w": bufs}, backend="reference")({"x": xa})["y"]
    assert ours.shape == (m, n)
    if act == F32:
        # Dequant is bit-exact on both sides; only the summation order differs.
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    else:
        # 16-bit pair sums (W4A4: exact block sums) against the interpreter's f32.
        wd = fmt.dequantize(bufs, n, k)
        assert max_rel_dot(ours, ref, xa, wd) <= {F16: 2e-3, BF16: 1.6e-2}[act]
