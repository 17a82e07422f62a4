"""Every weight format through the fused kernels at ragged shapes, on every backend this machine
has: what the generated kernels compute equals the numpy interpreter, and a captured replay
(the decode path) gives the same bytes as a plain run. On the host backend the kernels also run
under the reverse schedule and must give the same bytes (a missing barrier would not)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import qir
from qir.builder import Builder
from qir.dtypes import BF16, F16, DType
from qir.formats.base import WeightFormat
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from tests.conftest import BACKENDS, FORMAT_ZOO, max_rel, random_weight, with_bias

HIDDEN, INTER, RAGGED = 256, 384, 37  # hidden and inter: multiples of every group size
# 1: decode; 9: one full m-tile and a partial one; 70: past the W4A4 launches' 64 rows.
BATCHES = (1, 9, 70)


def block(
    fmt: WeightFormat, act: DType = F16, seed: int = 0
) -> tuple[Graph, dict[str, dict[str, np.ndarray]]]:
    """An MLP with residual, then two ragged projections of its result: the passes pair gate and
    up in one launch (silu(g)*u in its epilogue), add the residual in down_proj's epilogue and
    merge the projections into one launch of N = 37 + 40 rows, not a multiple of any tile. Up,
    down and p1 carry biases (gate and p2 none): a pair and a merged launch with one biased
    segment, and a bias before the residual."""
    rng = np.random.default_rng(seed)
    b = Builder("zoo")
    x = b.input("x", ("M", HIDDEN), act)
    weights, ws = {}, {}
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    shapes |= {"p1": (RAGGED, HIDDEN), "p2": (RAGGED + 3, HIDDEN)}
    for name, (o, i) in shapes.items():
        qw, weights[name] = random_weight(rng, o, i, fmt)
        if name in ("up", "down", "p1"):
            qw, weights[name] = with_bias(rng, qw, weights[name])
        ws[name] = b.weight(name, qw, name=f"w_{name}")
    h = b.mul(b.silu(b.qlinear(x, ws["gate"])), b.qlinear(x, ws["up"]))
    y = b.add(x, b.qlinear(h, ws["down"]))
    b.output("p1", b.qlinear(y, ws["p1"]))
    b.output("p2", b.qlinear(y, ws["p2"]))
    return b.graph, weights


def inputs(m: int, act: DType = F16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(m)
    return {"x": rng.standard_normal((m, HIDDEN), dtype=np.float32).astype(act.np)}


def close(ours: dict[str, Any], ref: dict[str, np.ndarray], fmt: WeightFormat) -> None:
    # The kernels and the interpreter differ only in fp32 summation order; a W4A4 down_proj
    # also re-quantizes silu(g)*u to FP4, where that difference can flip a code.
    tol = 2e-2 if w4a4(fmt) else 2e-3
    for name, want in ref.items():
        got = np.asarray(ours[name])
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert max_rel(got, want) <= tol, (fmt.spell(), name)


def host_bytes(a: Any) -> bytes:
    """The bytes of a numpy or CuPy array (capture outputs stay on the device)."""
    return (a.get() if hasattr(a, "get") else np.asarray(a)).tobytes()


def w4a4(fmt: WeightFormat) -> bool:
    return isinstance(fmt, Nvfp4) and fmt.act_bits == 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMAT_ZOO, ids=lambda f: f.tag())
def test_fused_block_matches_the_interpreter(
    fmt: WeightFormat, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph, weights = block(fmt)
    compiled = qir.compile(graph, weights, backend=backend)
    # The interpreter on the same pipeline: for W4A4 weights that includes routing them to
    # 4-bit activations, which the unfused graph would not do.
    reference = qir.compile(graph, weights, backend="reference")
    # gate/up, down_proj + residual, p1/p2; W4A4 adds a quantize_act for x, silu(g)*u and y
    # (above 64 rows 16-bit twins take over, with no quantize_act).
    assert compiled.launches_for(1) == (6 if w4a4(fmt) else 3)
    assert compiled.launches_for(70) == 3
    # Batches 1, 9, 70 replay the captures of 8, 16, 72 rows, padded: no kernel may mix rows.
    # (Each pads within its kernel family: 70 and 72 rows run the GEMM, 9 and 16 the GEMV, or
    # for W4A4 the GEMM from 9 rows on.)
    padded = compiled.capture_batches([8, 16, 72])
    for m in BATCHES:
        x = inputs(m)
        ours = compiled(x)
        close(ours, reference(x), fmt)
        # The decode path: bound to fixed buffers (a CUDA graph on a GPU), the same bytes.
        replayed = compiled.capture(m)(x)
        for name, value in ours.items():
            assert host_bytes(replayed[name]) == value.tobytes(), ("capture", name, m)
        for name, value in padded(x).items():
            assert host_bytes(value) == ours[name].tobytes(), ("padded", name, m)
        if backend == "host":
            monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
            backward = compiled(x)
            monkeypatch.delenv("QIR_HOST_SCHEDULE")
            for name, value in ours.items():
                assert value.tobytes() == backward[name].tobytes(), ("reverse", name, m)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "fmt",
    [MlxAffine(4, 64, BF16), Gptq(3, 128, "gptq", 1, F16), Nvfp4("div", 4)],
    ids=lambda f: f.tag(),
)
def test_gate_up_pair_with_ragged_rows(fmt: WeightFormat, backend: str) -> None:
    """silu(g) * u of a pair whose N (37) is not a multiple of the rows per block: the last
    block's idle warps leave early and the ragged stores land where the interpreter's do. The
    mul takes its operands in the other order (up first), and up is the first weight merged."""
    rng = np.random.default_rng(1)
    b = Builder("pair")
    x = b.input("x", ("M", HIDDEN), F16)
    weights = {}
    ws = {}
    for name in ("up", "gate"):
        qw, weights[name] = random_weight(rng, RAGGED, HIDDEN, fmt)
        ws[name] = b.weight(name, qw, name=f"w_{name}")
    up = b.qlinear(x, ws["up"])
    b.output("h", b.mul(up, b.silu(b.qlinear(x, ws["gate"]))))
    compiled = qir.compile(b.graph, weights, backend=backend)
    assert any(
        la.kernel.name.endswith(("_silumul", "_silumul_a4")) for la in compiled.plan.launches
    )
    reference = qir.compile(b.graph, weights, backend="reference")
    for m in (1, 13, 70):
        x_m = inputs(m)
        close(compiled(x_m), reference(x_m), fmt)
