"""The GEMV's packed path: products summed in f16/bf16 pairs over a run, the group's scale applied
to the run's sum. Against the numpy interpreter: bf16 activations for every code path of the
decoders (f16 is covered per format by test_every_format.py), and f16 activations near f16's
largest value, where an unscaled run of products would overflow."""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.ct_int import CtInt
from qir.formats.fp8 import Fp8
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4, Mxfp8
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.types import QWeight
from tests.conftest import BACKENDS, max_rel

# One format per decoder path: 1/2/4-bit words (strides 16, 8, 4), 3/5/6-bit straddling codes,
# 8-bit bytes (bf16 through f16), zeros packed / per byte / constant, E4M3, E2M1 (16 and 32 per
# scale).
DECODERS: tuple[WeightFormat, ...] = (
    MlxAffine(1, 32, BF16),
    Gptq(2, 32, "gptq", 1, F16),
    Gptq(3, 64, "gptq_v2", 0, BF16),
    MlxAffine(5, 64, F16),
    Awq(4, 64),
    CtInt(8, 32, F16),
    Fp8("channel"),
    Mxfp8(),
    Mxfp4(),
    Nvfp4("div", 16),
)


def qlinear(fmt: WeightFormat, n: int, k: int, act: object, w: np.ndarray) -> tuple[Graph, dict]:
    b = Builder()
    x = b.input("x", ("M", k), act)  # type: ignore[arg-type]
    b.output("y", b.qlinear(x, b.weight("w", QWeight(fmt, n, k))))
    return b.graph, {"w": fmt.quantize(w)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", DECODERS, ids=lambda f: f.tag())
def test_bf16_activations_every_decoder(fmt: WeightFormat, backend: str) -> None:
    """N = 37 rows (a warp's last set shifted back over its neighbour's), K = 3 groups of 64 or
    6 blocks of 32; M = 1 (runs over whole groups) and 9 (a full tile and a ragged one)."""
    rng = np.random.default_rng(3)
    n, k = 37, 192
    g, weights = qlinear(fmt, n, k, BF16, rng.standard_normal((n, k), dtype=np.float32) * 0.05)
    compiled = qir.compile(g, weights, backend=backend)
    reference = qir.compile(g, weights, backend="reference")
    for m in (1, 9):
        x = rng.standard_normal((m, k), dtype=np.float32).astype(BF16.np)
        assert max_rel(compiled({"x": x})["y"], reference({"x": x})["y"]) <= 1.6e-2, m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "fmt",
    [Awq(4, 128), Gptq(8, 32, "gptq", 1, F16), MlxAffine(4, 64, F16), Fp8("tensor"), Mxfp4()],
    ids=lambda f: f.tag(),
)
def test_runs_of_products_near_f16_max_stay_finite(fmt: WeightFormat, backend: str) -> None:
    """Weights alternating in sign (codes at both ends of the range), activations of 60000 whose
    signs follow the weights': every product of a run pushes the same way, the largest sums an
    f16 run can meet. The row's second half repeats the first with the activations negated, so
    the result is about zero and finite in f16, while each half's sum is far beyond f16."""
    n, k = 8, 512
    half = np.where(np.arange(k // 2) % 2 == 0, 0.05, -0.05).astype(np.float32)
    w = np.tile(np.concatenate([half, half]), (n, 1))
    g, weights = qlinear(fmt, n, k, F16, w)
    x = 60000.0 * np.sign(np.concatenate([half, -half]))[None, :].astype(np.float16)
    ours = qir.compile(g, weights, backend=backend)({"x": x})["y"].astype(np.float32)
    ref = qir.compile(g, weights, backend="reference")({"x": x})["y"].astype(np.float32)
    assert np.all(np.isfinite(ours)), ours
    scale = float(np.abs(fmt.dequantize(weights["w"], n, k)).sum(axis=1).max() * 60000.0)
    # The halves cancel up to float32 rounding of sums near `scale`.
    assert np.abs(ours - ref).max() <= 1e-5 * scale, (ours, ref)


def test_f32_activations_keep_float_products() -> None:
    """f32 activations take the float path (AWQ here: MLX is covered by test_kernels_host.py)."""
    rng = np.random.default_rng(5)
    n, k = 37, 256
    fmt = Awq(4, 64)
    g, weights = qlinear(fmt, n, k, F32, rng.standard_normal((n, k), dtype=np.float32) * 0.05)
    x = rng.standard_normal((3, k), dtype=np.float32)
    ours = qir.compile(g, weights, backend="host")({"x": x})["y"]
    ref = qir.compile(g, weights, backend="reference")({"x": x})["y"]
    assert max_rel(ours, ref) <= 1e-5
