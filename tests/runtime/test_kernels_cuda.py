"""Generated kernels on a GPU (cuda backend) against the numpy interpreter and the goldens."""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir.builder import Builder
from qir.dtypes import F16
from qir.formats.mlx import MlxAffine
from qir.models import load
from qir.models.blocks import build
from qir.runtime.cuda import available
from tests.conftest import DATA, MLX_FIXTURES, max_rel, random_weight, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not available(), reason="no CUDA GPU (cupy.cuda.is_available() is false)"),
]
GOLDEN_KEY = {"y": "mlp", "q": "q", "k": "k", "v": "v"}


@pytest.mark.parametrize("fixture", MLX_FIXTURES)
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_cuda_matches_reference_and_golden(fixture, block):
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), block, 0, F16)
    gpu = qir.compile(b.graph, b.weights, backend="cuda")
    ref = qir.compile(b.graph, b.weights, backend="reference")
    for m in (1, 5, 40):
        x = golden[f"x.M{m}"]
        ours, theirs = gpu({"x": x}), ref({"x": x})
        for name, value in ours.items():
            assert max_rel(value, theirs[name]) <= 2e-3, (name, m)
            assert rel_err(value, golden[f"{GOLDEN_KEY[name]}.0.M{m}"]) <= 1e-2


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize(("n", "m"), [(37, 1), (130, 3), (4099, 8), (1, 9)])
def test_cuda_qlinear_ragged(bits, n, m):
    rng = np.random.default_rng(bits * 1000 + n)
    qw, bufs = random_weight(rng, n, 384, MlxAffine(bits, 128, F16))
    b = Builder()
    x = b.input("x", ("M", 384), F16)
    b.output("y", b.qlinear(x, b.weight("w", qw)))
    xa = rng.standard_normal((m, 384), dtype=np.float32).astype(np.float16)
    ours = qir.compile(b.graph, {"w": bufs}, backend="cuda")({"x": xa})["y"]
    ref = qir.compile(b.graph, {"w": bufs}, backend="reference")({"x": xa})["y"]
    assert max_rel(ours, ref) <= 2e-3
