"""Shared checks for the integer-code formats (AWQ, GPTQ, compressed-tensors int): fixture
blocks on the reference and host backends against the goldens, and one qlinear host == reference.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import qir
from qir.builder import Builder
from qir.dtypes import F16, DType
from qir.formats import parse_format
from qir.formats.base import WeightFormat
from qir.models import load
from qir.models.blocks import build
from qir.types import QWeight
from tests.conftest import DATA, max_rel, max_rel_dot, rel_err
from tests.requires import requires

GOLDEN_KEY = {"y": "mlp", "q": "q", "k": "k", "v": "v"}
PROJ = ("q", "k", "v", "o", "gate", "up", "down")
# The host sums f16 products in pairs over short runs, the interpreter in f32; both round to f16.
HOST_TOL_F16 = 2e-3

needs_host = requires("gxx")


def golden(case: str) -> Mapping[str, np.ndarray]:
    return dict(np.load(DATA / case / "golden.npz"))


def check_fixture_block(case: str, block: str, backends: tuple[str, ...]) -> None:
    """Block outputs within 1e-2 of the golden on every backend, and host == reference."""
    gold = golden(case)
    b = build(load(DATA / case), block, 0, F16)
    compiled = {be: qir.compile(b.graph, b.weights, backend=be) for be in backends}
    for m in (1, 5, 40):
        x = gold[f"x.M{m}"]
        outs = {be: c({"x": x}) for be, c in compiled.items()}
        for name, ref in outs["reference"].items():
            for be, out in outs.items():
                assert out[name].dtype == np.float16
                assert rel_err(out[name], gold[f"{GOLDEN_KEY[name]}.0.M{m}"]) <= 1e-2, (be, m)
                assert max_rel(out[name], ref) <= HOST_TOL_F16, (be, name, m)


def check_qlinear_host(
    qw: QWeight, bufs: Mapping[str, np.ndarray], m: int, rng: np.random.Generator, act: DType
) -> None:
    b = Builder()
    x = b.input("x", ("M", qw.in_features), act)
    b.output("y", b.qlinear(x, b.weight("w", qw)))
    xa = rng.standard_normal((m, qw.in_features), dtype=np.float32).astype(act.np)
    weights = {"w": dict(bufs)}
    ours = qir.compile(b.graph, weights, backend="host")({"x": xa})["y"]
    ref = qir.compile(b.graph, weights, backend="reference")({"x": xa})["y"]
    assert ours.shape == (m, qw.out_features)
    tol = 1e-4 if act.itemsize == 4 else HOST_TOL_F16
    wd = qw.format.dequantize(bufs, qw.out_features, qw.in_features)
    assert max_rel_dot(ours, ref, xa, wd) <= tol


def check_spell(fmt: WeightFormat) -> None:
    assert parse_format(fmt.spell()) == fmt
