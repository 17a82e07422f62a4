"""The tensor-core GEMM family through the real plan (the test asserts the plan chose it), on
every backend this machine has, against the numpy interpreter: every weight format, every
fusion (multi-output with per-weight scales, the gate/up pair with silu(g) * u as epilogue, the
residual epilogue, the silu(g) * u prologue, W4A4 with quantize_act or quantizing in the
prologue), at the issue's batch sizes 1, 7, 16, 33, 64, 130, 257, with N and K that are not
multiples of the tiles; the real checkpoints against their tools' goldens; the reversed schedule
(same bytes) and an ASan/UBSan build on the host.

Kernels are what costs here (g++ builds each), so shapes are shared with test_every_format
(whose M = 70 runs already build the 128-row tiles of its block) and each format runs the small
tiles on one merged projection at one batch size of the sweep."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import numpy as np
import pytest

import qir
from qir.api import Compiled
from qir.builder import Builder
from qir.cli import main
from qir.codegen.kernel import Kernel
from qir.codegen.lower import lower
from qir.dtypes import BF16, F16, DType
from qir.formats.base import WeightFormat
from qir.formats.dense import Dense
from qir.formats.fp8 import Fp8
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.interpret import BindError
from qir.models import load
from qir.models.blocks import build
from qir.passes.manager import PassOptions, run_pipeline
from qir.runtime.executor import CompiledBlock
from qir.runtime.host import HostBackend
from qir.target import DEFAULT, Target
from tests.conftest import (
    BACKENDS,
    DATA,
    FORMAT_ZOO,
    ON_GPU,
    format_fixtures,
    max_rel,
    mlp_graph,
    random_weight,
    rel_err,
)
from tests.requires import requires
from tests.runtime.test_every_format import HIDDEN, INTER, RAGGED, block, close, inputs, w4a4

SMALL = (1, 7, 16, 33, 64)  # the 64-row tiles (and W4A4)
LARGE = (130, 257)  # the 128-row tiles
GOLDEN = {"y": "mlp", "q": "q", "k": "k", "v": "v"}


def assert_gemm(c: Compiled, m: int) -> None:
    """Every qlinear (and expert qlinear) launch a run at M=m makes is a GEMM (the grouped one
    for experts, beside its route, grouping and combine; elementwise ops beside qlinears)."""
    assert c.plan is not None
    active = [la for la in c.plan.launches if la.runs_for(m)]
    helpers = ("quantize_act", "moe_route", "moe_group", "moe_combine", "ew_")
    kernels = [la.kernel.name for la in active if not la.kernel.name.startswith(helpers)]
    assert kernels and all(k.startswith(("qgemm_", "moe_qgemm_")) for k in kernels), (m, kernels)


def same_bytes_reversed(
    c: Compiled, x: dict[str, np.ndarray], ours: dict[str, Any], mp: pytest.MonkeyPatch
) -> None:
    mp.setenv("QIR_HOST_SCHEDULE", "reverse")
    backward = c(x)
    mp.delenv("QIR_HOST_SCHEDULE")
    for name, value in ours.items():
        assert np.asarray(value).tobytes() == backward[name].tobytes(), ("reverse", name)


def projections(fmt: WeightFormat, seed: int = 0) -> tuple[Graph, dict[str, Any]]:
    """Two projections of x merged into one launch: N = 37 + 40, neither a multiple of a tile."""
    rng = np.random.default_rng(seed)
    b = Builder("proj")
    x = b.input("x", ("M", HIDDEN), F16)
    weights = {}
    for name, n in (("p1", RAGGED), ("p2", RAGGED + 3)):
        qw, weights[name] = random_weight(rng, n, HIDDEN, fmt)
        b.output(name, b.qlinear(x, b.weight(name, qw, name=f"w_{name}")))
    return b.graph, weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMAT_ZOO, ids=lambda f: f.tag())
def test_every_format_through_the_gemm(
    fmt: WeightFormat, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each format's small tiles on a merged ragged projection, at one batch size of the sweep
    (the formats share the sweep out); its large tiles on test_every_format's whole block (its
    pair, residual and merged projections) at 130 or 257 rows."""
    i = FORMAT_ZOO.index(fmt)
    graph, weights = projections(fmt)
    c = qir.compile(graph, weights, backend=backend, gemm_from_m=1)
    ref = qir.compile(graph, weights, backend="reference")
    m = SMALL[i % len(SMALL)]
    assert_gemm(c, m)
    x = inputs(m)
    ours = c(x)
    close(ours, ref(x), fmt)
    if backend == "host":
        same_bytes_reversed(c, x, ours, monkeypatch)
    graph, weights = block(fmt)
    c = qir.compile(graph, weights, backend=backend)  # the default table
    ref = qir.compile(graph, weights, backend="reference")
    m = LARGE[i % len(LARGE)]
    assert_gemm(c, m)
    close(c(inputs(m)), ref(inputs(m)), fmt)


# One 16-bit format with f16 activations and one W4A4 with bf16: every batch size of the sweep.
SWEEP = [
    pytest.param(MlxAffine(4, 64, BF16), F16, id="mlx4-f16"),
    pytest.param(Nvfp4("div", 4), BF16, id="nvfp4w4a4-bf16"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("fmt", "act"), SWEEP)
def test_every_fusion_at_every_batch_size(
    fmt: WeightFormat, act: DType, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate/up pair (silu(g) * u epilogue), down_proj with the residual, two ragged merged
    projections; W4A4: quantize_act of x, of silu(g) * u and of y up to 64 rows."""
    graph, weights = block(fmt, act)
    c = qir.compile(graph, weights, backend=backend, gemm_from_m=1)
    ref = qir.compile(graph, weights, backend="reference")
    for m in (*SMALL, *LARGE):
        assert_gemm(c, m)
        x = inputs(m, act)
        ours = c(x)
        close(ours, ref(x), fmt)
        if backend == "host" and m in (7, 130):
            same_bytes_reversed(c, x, ours, monkeypatch)


def prologue_mlp(
    gate: WeightFormat, up: WeightFormat, down: WeightFormat, gate_act: str = "silu"
) -> tuple[Graph, Any]:
    """gate and up that do not pair (up reads x + x, another value than the gate's x; W4A4
    weights of different formats would not merge anyway): silu(g) * u (or gate_act's) is
    down_proj's prologue; with W4A4 weights down_proj quantizes it there (per-row scales)."""
    rng = np.random.default_rng(3)
    b = Builder("prologue")
    x = b.input("x", ("M", HIDDEN), F16)
    weights, ws = {}, {}
    for name, fmt, (o, i) in (
        ("gate", gate, (INTER - 64, HIDDEN)),
        ("up", up, (INTER - 64, HIDDEN)),
        ("down", down, (HIDDEN - 64, INTER - 64)),
    ):
        qw, weights[name] = random_weight(rng, o, i, fmt)
        ws[name] = b.weight(name, qw, name=f"w_{name}")
    h = b.mul(getattr(b, gate_act)(b.qlinear(x, ws["gate"])), b.qlinear(b.add(x, x), ws["up"]))
    b.output("y", b.qlinear(h, ws["down"]))
    return b.graph, weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "formats",
    [
        pytest.param((MlxAffine(4, 64, BF16), MlxAffine(8, 64, BF16), Fp8("channel")), id="16bit"),
        pytest.param((Nvfp4("mul", 4), Nvfp4("div", 4), Nvfp4("div", 4)), id="w4a4"),
    ],
)
def test_silu_prologue_through_the_gemm(
    formats: tuple[WeightFormat, ...], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph, weights = prologue_mlp(*formats)
    c = qir.compile(graph, weights, backend=backend, gemm_from_m=1)
    ref = qir.compile(graph, weights, backend="reference")
    down = [
        la
        for la in c.plan.launches
        if la.kernel.name.startswith("qgemm") and "_silu" in la.kernel.name
    ]
    assert down, "down_proj takes silu(g) * u in its prologue"
    if w4a4(formats[2]):
        assert any(la.kernel.name.endswith("_silu_a4dynamic") for la in down)
    for m in (7, 33, 130):
        assert_gemm(c, m)
        x = inputs(m)
        ours = c(x)
        close(ours, ref(x), formats[2])
        if backend == "host" and m == 33:
            same_bytes_reversed(c, x, ours, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_gate_through_the_gemv_and_the_gemm(backend: str) -> None:
    """Gemma's gelu_tanh where silu fuses: the gate/up pair's epilogue, down_proj's prologue
    (16-bit, and W4A4 quantizing the product there), in the GEMV (M = 1, 5) and the GEMM
    (M = 33, 130), against the interpreter."""
    rng = np.random.default_rng(5)
    mlx4, w4a4_mul, w4a4_div = MlxAffine(4, 64, BF16), Nvfp4("mul", 4), Nvfp4("div", 4)
    cases = [  # the graph, its fusion's name, the format that sets the tolerance
        (mlp_graph(rng, HIDDEN, INTER, mlx4, F16, "gelu_tanh"), "_gelumul", mlx4),
        (prologue_mlp(mlx4, MlxAffine(8, 64, BF16), Fp8("channel"), "gelu_tanh"), "_gelu", mlx4),
        (prologue_mlp(w4a4_mul, w4a4_div, w4a4_div, "gelu_tanh"), "_gelu_a4dynamic", w4a4_div),
    ]
    for (graph, weights), fused, fmt in cases:
        c = qir.compile(graph, weights, backend=backend)
        ref = qir.compile(graph, weights, backend="reference")
        assert c.plan is not None
        names = [la.kernel.name for la in c.plan.launches]
        assert any(n.startswith("qgemv_") and fused in n for n in names), (fused, names)
        assert any(n.startswith("qgemm_") and fused in n for n in names), (fused, names)
        assert not any("silu" in n for n in names)
        for m in (1, 5, 33, 130):
            x = inputs(m)
            close(c(x), ref(x), fmt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_epilogue_through_the_gemv_and_the_gemm(backend: str) -> None:
    """Gemma's final logit soft-cap as the projection's store: GEMV (M = 1, 5), GEMM (M = 33,
    130), N = 37 (ragged), against the interpreter; the values reach the cap's range."""
    rng = np.random.default_rng(6)
    fmt = MlxAffine(4, 64, BF16)
    b = Builder("capped")
    x = b.input("x", ("M", HIDDEN), F16)
    qw, weights = random_weight(rng, RAGGED, HIDDEN, fmt)
    b.output("y", b.softcap(b.qlinear(x, b.weight("w", qw, name="w_w")), 3.0))
    c = qir.compile(b.graph, {"w": weights}, backend=backend)
    ref = qir.compile(b.graph, {"w": weights}, backend="reference")
    assert c.plan is not None
    names = [la.kernel.name for la in c.plan.launches]
    assert any(n.startswith("qgemv_") and n.endswith("_softcap_c3") for n in names), names
    assert any(n.startswith("qgemm_") and n.endswith("_softcap_c3") for n in names), names
    for m in (1, 5, 33, 130):
        assert c.launches_for(m) == 1
        xs = {"x": (3 * inputs(m)["x"].astype(np.float32)).astype(np.float16)}
        ours, want = c(xs), ref(xs)
        assert 2.5 < np.abs(want["y"].astype(np.float32)).max() <= 3.0
        # two f16 roundings (the projection, then the capped value) where the sums' order may
        # move the first by an ulp: 4e-3 of the cap
        assert max_rel(ours["y"], want["y"]) <= 4e-3, m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "fmt", [Dense(F16), Fp8("tensor"), Nvfp4("mul", 16)], ids=lambda f: f.tag()
)
def test_k_not_a_multiple_of_the_k_step(fmt: WeightFormat, backend: str) -> None:
    """K = 208: the last K step of every tile is half empty (zero-filled on both operands)."""
    k = 208
    rng = np.random.default_rng(5)
    b = Builder("ragged_k")
    x = b.input("x", ("M", k), F16)
    qw, bufs = random_weight(rng, RAGGED, k, fmt)
    b.output("y", b.qlinear(x, b.weight("w", qw, name="w_w")))
    c = qir.compile(b.graph, {"w": bufs}, backend=backend, gemm_from_m=1)
    ref = qir.compile(b.graph, {"w": bufs}, backend="reference")
    for m in (33, 130):
        assert_gemm(c, m)
        xm = {"x": rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)}
        assert max_rel(c(xm)["y"], ref(xm)["y"]) <= 2e-3


FIXTURES = format_fixtures()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fixture", FIXTURES)
def test_fixture_goldens_through_the_gemm(fixture: str, backend: str) -> None:
    """Each real checkpoint's MLP and q/k/v at the golden batch sizes 1, 5 and 40, all through
    the GEMM: == the interpreter, and the tool's own outputs (its fake-quantized *_a4 keys
    where the checkpoint declares W4A4) within 1e-2."""
    golden = np.load(DATA / fixture / "golden.npz")
    ck = load(DATA / fixture)
    for name in ("mlp", "qkv"):
        b = build(ck, name, 0, F16)
        c = qir.compile(b.graph, b.weights, backend=backend, gemm_from_m=1)
        ref = qir.compile(b.graph, b.weights, backend="reference")
        a4 = any(b.graph.node(w).type.format.declared_act_bits() == 4 for w in b.graph.weights)
        for m in (1, 5, 40):
            assert_gemm(c, m)
            x = {"x": golden[f"x.M{m}"]}
            ours, theirs = c(x), ref(x)
            for out, value in ours.items():
                want = golden[f"{GOLDEN[out]}{'_a4' if a4 else ''}.0.M{m}"]
                assert max_rel(value, theirs[out]) <= 2e-3, (name, out, m)
                assert rel_err(value, want) <= 1e-2, (name, out, m)


@pytest.mark.parametrize("fmt", [MlxAffine(3, 64, BF16), Nvfp4("div", 4)], ids=lambda f: f.tag())
def test_sanitized_gemm_matches_the_plain_build(fmt: WeightFormat, tmp_path: Any) -> None:
    """ASan/UBSan builds of the GEMM (and W4A4's quantize_act) on ragged N and M: no
    out-of-bounds global or shared access, no undefined arithmetic, the plain build's bytes."""
    graph, weights = projections(fmt)
    c = qir.compile(graph, weights, backend="host", gemm_from_m=1)
    assert c.plan is not None
    sanitized = CompiledBlock(c.plan, HostBackend(cache_dir=tmp_path, sanitize=True), weights)
    x = inputs(33)
    assert_gemm(c, 33)
    ours, theirs = c(x), sanitized.run(x)
    for name, value in ours.items():
        assert value.tobytes() == theirs[name].tobytes(), name


def silu(a: np.ndarray) -> np.ndarray:
    return a / (1.0 + np.exp(-a))


def test_cli_runs_130_rows_through_the_gemm(tmp_path: Any) -> None:
    """`qir compile --m 130` plans GEMM launches for every projection, and `qir run` with 130
    rows gives the float32 result of the tool's own decoded weights within 1e-2."""
    ckpt = DATA / "mlx_affine4_g64_S"
    golden = np.load(ckpt / "golden.npz")
    x = np.random.default_rng(130).standard_normal((130, 256)).astype(np.float16)
    np.save(tmp_path / "x.npy", x)
    w = {k.split(".")[-1]: golden[k] for k in golden.files if k.startswith("W.0.")}
    xf = x.astype(np.float32)
    want = {
        "mlp": {"y": xf + (silu(xf @ w["gate"].T) * (xf @ w["up"].T)) @ w["down"].T},
        "qkv": {p: xf @ w[p].T for p in "qkv"},
    }
    for name, outputs in want.items():
        plan = tmp_path / f"{name}.json"
        assert (
            main(["-q", "compile", str(ckpt), "--block", name, "--m", "130", "--json", str(plan)])
            == 0
        )
        kernels = [k["name"] for k in json.loads(plan.read_text())["kernels"]]
        assert kernels and all(k.startswith("qgemm_") for k in kernels), kernels
        out = tmp_path / f"{name}.npz"
        args = ["run", str(ckpt), "--block", name, "--input", str(tmp_path / "x.npy")]
        assert main(["-q", *args, "--out", str(out), "--backend", "host"]) == 0
        got = np.load(out)
        for key, value in outputs.items():
            assert got[key].shape == (130, value.shape[1])
            assert rel_err(got[key], value) <= 1e-2, (name, key)


def test_captured_batches_pad_within_a_family() -> None:
    """Captures of 16, 64 and 256 rows run the GEMV, the 64-row and the 128-row GEMM tiles: a
    batch replays the nearest capture that runs its own kernels, bit for bit as a plain run."""
    graph, weights = block(MlxAffine(4, 64, BF16))
    c = qir.compile(graph, weights, backend="host")
    assert c.plan is not None
    batches = c.capture_batches([16, 64, 256])
    for m, size in ((10, 16), (40, 64), (100, 256)):
        assert batches.capture_for(m) is batches.captures[size]
        x = inputs(m)
        for name, value in batches(x).items():
            assert value.tobytes() == c(x)[name].tobytes(), (m, name)
    with pytest.raises(BindError, match=r"M=10: no captured batch size of at least 10 rows"):
        c.capture_batches([64])(inputs(10))


def gemm_kernels(graph: Graph, target: Target = DEFAULT) -> list[Kernel]:
    passed, _ = run_pipeline(graph, options=PassOptions(gemm_from_m=1))
    launches = lower(passed, target=target).launches
    return list({la.kernel: None for la in launches if la.kernel.name.startswith("qgemm")})


@requires("nvcc")
def test_block_scaled_fp4_instruction_is_in_the_sm_120a_build(tmp_path: Any) -> None:
    """nvcc's PTX for sm_120a holds the block-scaled MMA; for sm_90 the kernel builds without it
    (its helper traps there), and ptxas refuses the instruction itself for sm_100a."""
    (kernel,) = [
        k
        for k in gemm_kernels(projections(Nvfp4("div", 4))[0], Target("sm_120a"))
        if "_nvf4" in k.name
    ]
    (tmp_path / "k.cu").write_text(kernel.source)
    for name, text in kernel.headers:
        (tmp_path / name).write_text(text)

    def ptx(arch: str) -> str:
        out = tmp_path / f"{arch}.ptx"
        cmd = ["nvcc", "-std=c++17", f"-arch={arch}", "-ptx", "k.cu", "-o", str(out)]
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
        return out.read_text()

    assert "kind::mxf4nvf4.block_scale.scale_vec::4X" in ptx("sm_120a")
    assert "block_scale" not in ptx("sm_90")
    forced = tmp_path / "forced.cu"
    forced.write_text("#define __CUDA_ARCH_FEAT_SM120_ALL 1\n" + kernel.source)
    cmd = ["nvcc", "-std=c++17", "-arch=sm_100a", "-cubin", str(forced), "-o", "f.cubin"]
    refused = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode != 0 and "not supported on .target 'sm_100a'" in refused.stderr


@pytest.mark.gpu
@ON_GPU
@pytest.mark.parametrize(("fmt", "act"), SWEEP)
def test_cuda_gemm_matches_the_host_gemm(fmt: WeightFormat, act: DType) -> None:
    """The same GEMM kernels on a GPU (PTX tensor cores) and on the host (their emulation): equal
    to fp32 summation order, and both to the interpreter."""
    graph, weights = block(fmt, act)
    gpu = qir.compile(graph, weights, backend="cuda", gemm_from_m=1)
    cpu = qir.compile(graph, weights, backend="host", gemm_from_m=1)
    ref = qir.compile(graph, weights, backend="reference")
    for m in (33, 130):
        x = inputs(m, act)
        ours, theirs, want = gpu(x), cpu(x), ref(x)
        for name, value in theirs.items():
            assert max_rel(np.asarray(ours[name]), value) <= 2e-3 * (10 if w4a4(fmt) else 1), name
        close(ours, want, fmt)


def test_kernels_load_when_a_batch_size_first_needs_them() -> None:
    """A block builds its decode kernels (M = 1) when compiled and the GEMM's only when a run
    needs them: serving decode alone never compiles prefill kernels."""
    graph, weights = block(MlxAffine(4, 64, BF16))
    c = qir.compile(graph, weights, backend="host")
    assert c.plan is not None and c._exec is not None

    def loaded() -> set[str]:
        assert c.plan is not None and c._exec is not None
        names = zip(c.plan.launches, c._exec._loaded, strict=True)
        return {la.kernel.name.split("_")[0] for la, k in names if k is not None}

    assert loaded() == {"qgemv"}
    c(inputs(5))
    assert loaded() == {"qgemv"}
    c(inputs(40))
    assert loaded() == {"qgemv", "qgemm"}
