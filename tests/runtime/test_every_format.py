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
from qir.dtypes import F16, DType
from qir.formats.base import WeightFormat
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from tests.conftest import BACKENDS, FORMAT_ZOO, max_rel, random_weight

HIDDEN, INTER, RAGGED = 256, 384, 37  # hidden and inter: multiples of every group size
# 1: decode; 9: one full m-tile and a partial one; 70: past the W4A4 launches' 64 rows.
BATCHES = (1, 9, 70)


def block(
    fmt: WeightFormat, act: DType = F16, seed: int = 0
) -> tuple[Graph, dict[str, dict[str, np.ndarray]]]:
    """An MLP with residual plus a ragged projection of the same input: the passes merge gate,
    up and the projection into one launch (N = 2*384 + 37, not a multiple of any tile) and
    fuse SiLU and the residual into down_proj."""
    rng = np.random.default_rng(seed)
    b = Builder("zoo")
    x = b.input("x", ("M", HIDDEN), act)
    weights, ws = {}, {}
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "proj": (RAGGED, HIDDEN)}
    shapes["down"] = (HIDDEN, INTER)
    for name, (o, i) in shapes.items():
        qw, weights[name] = random_weight(rng, o, i, fmt)
        ws[name] = b.weight(name, qw, name=f"w_{name}")
    h = b.mul(b.silu(b.qlinear(x, ws["gate"])), b.qlinear(x, ws["up"]))
    b.output("y", b.add(x, b.qlinear(h, ws["down"])))
    b.output("p", b.qlinear(x, ws["proj"]))
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
    return bytes(a.get().tobytes() if hasattr(a, "get") else np.asarray(a).tobytes())


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
    # gate/up/proj in one launch, SiLU and residual in down_proj's (W4A4: plus one quantize_act
    # for x; above 64 rows 16-bit twins take over).
    assert compiled.launches_for(1) == (3 if w4a4(fmt) else 2)
    for m in BATCHES:
        x = inputs(m)
        ours = compiled(x)
        close(ours, reference(x), fmt)
        # The decode path: bound to fixed buffers (a CUDA graph on a GPU), the same bytes.
        replayed = compiled.capture(m)(x)
        for name, value in ours.items():
            assert host_bytes(replayed[name]) == value.tobytes(), ("capture", name, m)
        if backend == "host":
            monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
            backward = compiled(x)
            monkeypatch.delenv("QIR_HOST_SCHEDULE")
            for name, value in ours.items():
                assert value.tobytes() == backward[name].tobytes(), ("reverse", name, m)
