"""The host backend's two modes give the same bytes: `fast` (the default: hot helpers' host
bodies, warp collectives in one exchange) and `check` (every helper's portable GPU-path body,
every shuffle a warp exchange), on every kernel family a model runs (embedding, the GEMV with
its norm prologue and epilogues, the GEMM, KV append, split and prefill attention, sampling) and
on every integer code width the fast decode reads, with float and 16-bit activations; and both
equal the interpreter as every host kernel must. The fast mode also runs the reversed schedule."""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir.dtypes import F16, F32, DType
from qir.formats.base import WeightFormat
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.models import Model
from tests.conftest import DATA, FMT4, max_rel
from tests.runtime.test_every_format import block, inputs

# Every code width the fast decode handles (2, 4, 8 as vectors; 3 and 6 straddle words) and a
# zero-point format.
FORMATS = [MlxAffine(bits, 64, FMT4.scale_dtype) for bits in (2, 3, 4, 6, 8)] + [
    Gptq(4, 128, "gptq", 0, F16)
]


def compiled(graph, weights, monkeypatch: pytest.MonkeyPatch, mode: str) -> qir.Compiled:
    """The block compiled for a host backend in `mode` (which it reads when it is made)."""
    monkeypatch.setenv("QIR_HOST_MODE", mode)
    try:
        return qir.compile(graph, weights, backend="host")
    finally:
        monkeypatch.delenv("QIR_HOST_MODE")


# The float decode differs per format between the modes; the 16-bit pair decode is one body in
# both (its pair arithmetic and warp sums differ), so one format covers it.
CASES = [(fmt, F32) for fmt in FORMATS] + [(FORMATS[2], F16)]


@pytest.mark.parametrize(
    ("fmt", "act"), CASES, ids=lambda v: v.tag() if hasattr(v, "tag") else v.name
)
def test_fast_and_check_modes_agree_on_every_code_width(
    fmt: WeightFormat, act: DType, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph, weights = block(fmt, act)
    ref = qir.compile(graph, weights, backend="reference")
    runs = {mode: compiled(graph, weights, monkeypatch, mode) for mode in ("fast", "check")}
    for m in (1, 9, 20):  # decode, an m-tile and a partial one, the GEMM (16-bit activations)
        x = inputs(m, act)
        want = ref(x)
        fast, check = (runs[mode](x) for mode in ("fast", "check"))
        for name, value in want.items():
            assert fast[name].tobytes() == check[name].tobytes(), (m, name)
            assert max_rel(np.asarray(fast[name]), value) <= (1e-5 if act == F32 else 2e-3), (
                m,
                name,
            )


@pytest.mark.parametrize("act", [F32, F16], ids=lambda d: d.name)
def test_a_whole_model_gives_the_same_bytes_in_both_modes_and_schedules(
    act: DType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill (M = 7) and decode steps of a real checkpoint: every decoder kernel."""
    ids = [3, 17, 40, 2, 99, 5, 11]
    logits = {}
    for mode, schedule in (("fast", "forward"), ("check", "forward"), ("fast", "reverse")):
        monkeypatch.setenv("QIR_HOST_MODE", mode)
        monkeypatch.setenv("QIR_HOST_SCHEDULE", schedule)
        model = Model.load(DATA / "mlx_affine4_g64_S", backend="host", act=act, max_seq=64)
        gen = model.generate(ids, max_new_tokens=4, temperature=0.0, keep_logits=True)
        assert gen.logits is not None
        logits[mode, schedule] = gen.logits
    monkeypatch.delenv("QIR_HOST_MODE")
    monkeypatch.delenv("QIR_HOST_SCHEDULE")
    reference = Model.load(DATA / "mlx_affine4_g64_S", backend="reference", act=act, max_seq=64)
    want = reference.generate(ids, max_new_tokens=4, temperature=0.0, keep_logits=True).logits
    assert want is not None
    base = logits["fast", "forward"]
    for key, value in logits.items():
        assert value.tobytes() == base.tobytes(), key
    assert max_rel(base, want) <= (1e-4 if act == F32 else 2e-2)
