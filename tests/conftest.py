from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qir.builder import Builder
from qir.dtypes import BF16, F16, DType
from qir.formats.mlx import MlxAffine
from qir.graph import Graph
from qir.types import QWeight

DATA = Path(__file__).parent / "data"
MLX_FIXTURES = ("mlx_affine4_g64_S", "mlx_affine8_g64_S", "mlx_mixed_3_6_S")


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float32)
    return float(np.linalg.norm(ours.astype(np.float32) - ref) / np.linalg.norm(ref))


def max_rel(ours: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float32)
    return float(np.max(np.abs(ours.astype(np.float32) - ref)) / np.max(np.abs(ref)))


def random_weight(
    rng: np.random.Generator, out_f: int, in_f: int, fmt: MlxAffine
) -> tuple[QWeight, dict[str, np.ndarray]]:
    w = rng.standard_normal((out_f, in_f), dtype=np.float32) * 0.05
    return QWeight(fmt, out_f, in_f), fmt.quantize(w)


def mlp_graph(
    rng: np.random.Generator,
    hidden: int,
    inter: int,
    fmt: MlxAffine,
    act: DType = F16,
) -> tuple[Graph, dict[str, dict[str, np.ndarray]]]:
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
    h = b.mul(b.silu(gate, name="act"), up, name="h")
    b.output("y", b.add(x, b.qlinear(h, ws["down"], name="down"), name="y"))
    return b.graph, weights


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


FMT4 = MlxAffine(4, 64, BF16)


@pytest.fixture(autouse=True, scope="session")
def _session_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Every test compiles into one per-session cache, never the user's ~/.cache/qir."""
    mp = pytest.MonkeyPatch()
    mp.setenv("QIR_CACHE_DIR", str(tmp_path_factory.mktemp("qir-cache")))
    yield
    mp.undo()
