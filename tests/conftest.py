from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from qir.builder import Builder
from qir.dtypes import BF16, F16, F32, DType
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.ct_int import CtInt
from qir.formats.dense import Dense
from qir.formats.fp8 import Fp8
from qir.formats.fp8_block import Fp8Block
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4, Mxfp8
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.types import QWeight
from tests import nvrtc_record
from tests.requires import requires

# CI fails on skips that its machine should not take (QIR_CI=1): tests/skip_policy.py
pytest_plugins = ("tests.skip_policy",)
DATA = Path(__file__).parent / "data"
# Where generated kernels run: the host backend always, the cuda backend on a machine with a GPU.
ON_GPU = requires("gpu")
BACKENDS = ["host", pytest.param("cuda", marks=[pytest.mark.gpu, ON_GPU])]
MLX_FIXTURES = ("mlx_affine4_g64_S", "mlx_affine8_g64_S", "mlx_mixed_3_6_S")
# Checkpoints of the other model families (tests/models/test_families.py runs them as layers
# and models); their formats' blocks are the S fixtures' (the format tests skip them).
FAMILY_FIXTURES = frozenset(
    {
        "mlx_affine4_qwen2",
        "ct_w4a16_qwen2",
        "mlx_affine4_qwen3",
        "ct_w4a16_qwen3",
        "mlx_affine4_mistral",
        "ct_w4a16_mistral",
        "mlx_affine4_phi3",
        "ct_w4a16_phi3",
        "mlx_affine4_gemma3",
        "mlx_affine4_gemma3_mm",
        "mlx_affine4_gemma2",
        # Qwen2-MoE's shared expert: tests/models/test_moe_models.py
        "qwen2moe_mlx4_g64",
    }
)


def format_fixtures() -> list[str]:
    """The fixtures with block goldens (golden.npz) that the format tests take."""
    return sorted(
        p.name
        for p in DATA.iterdir()
        if (p / "golden.npz").is_file() and p.name not in FAMILY_FIXTURES
    )


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float32)
    return float(np.linalg.norm(ours.astype(np.float32) - ref) / np.linalg.norm(ref))


def max_rel(ours: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float32)
    return float(np.max(np.abs(ours.astype(np.float32) - ref)) / np.max(np.abs(ref)))


def max_rel_dot(ours: np.ndarray, ref: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    """max_rel for y = x @ w.T, relative to the larger of max |y| and the largest row's
    sqrt(sum_k (x_k w_k)^2): the size of the partial sums a dot product's rounding scales with.
    The GEMVs sum 16-bit products in f16/bf16 pairs, so where the terms cancel (a few outputs
    of a short K) the error stays ~1e-3 of the partial sums, not of the small result."""
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    terms = float(np.sqrt(np.max((x32 * x32) @ (w32 * w32).T)))
    ref32 = ref.astype(np.float32)
    return float(np.max(np.abs(ours.astype(np.float32) - ref32)) / max(np.abs(ref32).max(), terms))


# One of each weight format and variant the kernels specialise on (bit widths, group sizes,
# scale dtypes, scale modes, activation bits), for tests that must cover every format.
FORMAT_ZOO: tuple[WeightFormat, ...] = (
    MlxAffine(2, 32, F16),
    MlxAffine(3, 64, BF16),
    MlxAffine(4, 64, BF16),
    MlxAffine(5, 32, F32),
    MlxAffine(6, 128, F16),
    MlxAffine(8, 64, BF16),
    Awq(4, 64),
    Awq(4, 128),
    Gptq(2, 64, "gptq_v2", 0, F16),
    Gptq(3, 128, "gptq", 1, F16),
    Gptq(4, 128, "gptq", 0, BF16),
    Gptq(8, 32, "gptq_v2", 1, F32),
    CtInt(4, 32, BF16),
    CtInt(8, 128, F16),
    Fp8("channel"),
    Fp8("tensor"),
    Fp8Block(),
    Mxfp4(),
    Mxfp8(),
    Nvfp4("mul", 16),
    Nvfp4("div", 16),
    Nvfp4("mul", 4),
    Nvfp4("div", 4),
    Dense(F16),
    Dense(BF16),
)
# The input amax W4A4 weights are quantized with (their input_scale buffer). The graphs built
# from them carry no calibrated scale attribute, so their kernels quantize with per-row scales;
# the calibrated path is covered by the W4A4 checkpoints in tests/data.
INPUT_AMAX = 4.0


def random_weight(
    rng: np.random.Generator, out_f: int, in_f: int, fmt: WeightFormat
) -> tuple[QWeight, dict[str, np.ndarray]]:
    w = rng.standard_normal((out_f, in_f), dtype=np.float32) * 0.05
    if isinstance(fmt, Nvfp4) and fmt.act_bits == 4:
        return QWeight(fmt, out_f, in_f), fmt.quantize(w, input_amax=INPUT_AMAX)
    return QWeight(fmt, out_f, in_f), fmt.quantize(w)


def with_bias(
    rng: np.random.Generator, qw: QWeight, bufs: dict[str, np.ndarray]
) -> tuple[QWeight, dict[str, np.ndarray]]:
    """The weight with a random float32 bias, about the size of its outputs."""
    b = rng.standard_normal(qw.out_features, dtype=np.float32) * 0.5
    return dataclasses.replace(qw, bias=True), {**bufs, "bias": b}


def mlp_graph(
    rng: np.random.Generator,
    hidden: int,
    inter: int,
    fmt: WeightFormat,
    act: DType = F16,
    gate_act: str = "silu",
) -> tuple[Graph, dict[str, dict[str, np.ndarray]]]:
    """x + down(gate_act(gate(x)) * up(x)); gate_act: silu, or Gemma's gelu_tanh."""
    b = Builder("mlp")
    weights = {}
    x = b.input("x", ("M", hidden), act)
    ws = {}
    for name, (o, i) in {
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }.items():
        qw, bufs = random_weight(rng, o, i, fmt)
        weights[name] = bufs
        ws[name] = b.weight(name, qw, name=f"w_{name}")
    gate = b.qlinear(x, ws["gate"], name="gate")
    up = b.qlinear(x, ws["up"], name="up")
    h = b.mul(getattr(b, gate_act)(gate, name="act"), up, name="h")
    b.output("y", b.add(x, b.qlinear(h, ws["down"], name="down"), name="y"))
    return b.graph, weights


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


FMT4 = MlxAffine(4, 64, BF16)


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Every test compiles into one per-session cache, never the user's ~/.cache/qir, with host
    kernels built at -O1 without the unroll pragmas. Under pytest-xdist the workers share it
    (the cache locks per entry), so a kernel that tests on two workers need is compiled once."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "qir-cache"
    root.mkdir(exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("QIR_CACHE_DIR", str(root))
    # Host kernels at -O1: a quarter less g++ time, the same bytes as -O2
    # (tests/runtime/test_host.py::test_the_optimisation_level_changes_no_result).
    mp.setenv("QIR_HOST_OPT", "1")
    # Without the unroll pragmas: g++ builds a GEMV in 1.4 s instead of 10, the same bytes
    # (tests/runtime/test_host.py::test_the_optimisation_level_changes_no_result).
    mp.setenv("QIR_HOST_UNROLL", "0")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The workers keep the cores busy: a load's cold kernels build as one g++ unit (the
        # header loaded and the shared helpers generated once, qir/runtime/host_units.py).
        mp.setenv("QIR_COMPILE_JOBS", "1")
    # NVRTC's builds and nvdisasm's listings of exactly what the suite compiles, recorded.
    nvrtc_record.install(mp)
    yield
    mp.undo()


# Host kernels for tests whose time is in their launches rather than their builds (a real
# model's generation, a served engine's requests): -O2 builds ~10% slower and runs 2-2.5x
# faster. SmolLM2's 16 greedy tokens at f32, fresh cache: 6.0 -> 6.6 s of g++, 5.2 -> 2.6 s of
# run; the schemathesis and lm-eval serving tests 69 -> 55 s. The same bytes as -O1
# (tests/runtime/test_host.py::test_the_optimisation_level_changes_no_result); everywhere
# else -O1 pays (the family and MoE kernel tests: 87 -> 119 s of CPU at -O2).
LAUNCH_HEAVY_OPT = "2"


@pytest.fixture
def launch_heavy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host kernels at LAUNCH_HEAVY_OPT for this test."""
    monkeypatch.setenv("QIR_HOST_OPT", LAUNCH_HEAVY_OPT)


def greedy_prefix(step_logits: np.ndarray, ours: np.ndarray) -> int:
    """How many greedy steps of a reference are decided beyond our measured error: steps up to
    (not including) the first whose top-2 logit margin does not exceed the largest difference
    between our logits and the reference's at that step. Random-init models have near-ties
    that 16-bit arithmetic may break the other way."""
    ref = step_logits.astype(np.float32)
    err = np.max(np.abs(ours.astype(np.float32) - ref), axis=-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    close = np.flatnonzero(top2[:, 1] - top2[:, 0] <= err)
    return int(close[0]) if close.size else len(ref)


# The suite's longest tests (`pytest --durations`, each 20-200 s on 2 cores), started first: a
# long test that a worker picks up last leaves the other core idle until it ends.
LONGEST_FIRST = (
    "tests/serving/test_operations.py::test_schemathesis",
    "tests/test_cli.py::test_demo",
    "tests/test_gpu_check.py::test_every_stage_runs_dry",
    "tests/test_docs.py::test_the_blocks_of_a_page_run_in_order",
    "tests/test_benchmarks.py::test_tp_scaling_on_host",
    "tests/serving/test_lm_eval.py::test_lm_eval_local_completions",
    "tests/models/test_gguf_models.py::test_smollm2_generates_as_transformers_does",
    "tests/runtime/test_host.py::test_the_optimisation_level_changes_no_result",
    "tests/test_tp_mpi.py::test_generate_and_run_on_mpi_ranks_equal_one_rank",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)), 99)

    items.sort(key=rank)  # stable: the rest keep their order
