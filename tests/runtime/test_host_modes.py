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
from qir.builder import Builder
from qir.dtypes import F16, F32, DType
from qir.formats.base import WeightFormat
from qir.formats.ggml import Ggml
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.graph import Graph
from qir.models import Model
from qir.types import TensorType
from tests.conftest import DATA, FMT4, max_rel, random_weight
from tests.runtime.test_every_format import block, inputs

# Every code width the fast decode handles (2, 4, 8 as vectors; 3 and 6 straddle words), a
# zero-point format, and ggml's fields (4-bit with a min, 5-bit with high bits, bytes).
FORMATS: list[WeightFormat] = [
    MlxAffine(bits, 64, FMT4.scale_dtype) for bits in (2, 3, 4, 6, 8)
] + [Gptq(4, 128, "gptq", 0, F16)]
FORMATS += [Ggml(t) for t in ("Q4_1", "Q5_1", "Q8_0")]


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


HIDDEN = 256


def post_norm_block(fmt: WeightFormat, act: DType) -> tuple[Graph, dict]:
    """Gemma's post-norm into a projection, h = x + rms_norm(o, pw) and rms_norm(h, nw) @ a
    (the GEMV's norm_residual prologue: two row sums a block, h stored by the first block along
    N), beside a plain rms_norm prologue: the sums and the staged row the host forms once per
    block, in the order the threads would."""
    rng = np.random.default_rng(5)
    b = Builder("post_norm")
    x, o = (b.input(name, ("M", HIDDEN), act) for name in ("x", "o"))
    weights: dict = {}
    norms = {}
    for key in ("pw", "nw", "qw"):
        norms[key] = b.param(key, TensorType((HIDDEN,), F32), name=f"w_{key}")
        weights[key] = {"weight": (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    ws = {}
    for key in ("a", "p"):
        qw, weights[key] = random_weight(rng, HIDDEN, HIDDEN, fmt)
        ws[key] = b.weight(key, qw, name=f"w_{key}")
    h = b.add(x, b.rms_norm(o, norms["pw"], 1e-5))
    b.output("a", b.qlinear(b.rms_norm(h, norms["nw"], 1e-6), ws["a"]))
    b.output("h", h)
    b.output("p", b.qlinear(b.rms_norm(x, norms["qw"], 1e-6), ws["p"]))
    return b.graph, weights


@pytest.mark.parametrize(
    ("fmt", "act"), [(Ggml("Q4_1"), F32), (FORMATS[2], F16)], ids=("ggmlq41-f32", "mlx4-f16")
)
def test_norm_prologues_give_the_same_bytes_in_both_modes_and_schedules(
    fmt: WeightFormat, act: DType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast mode's once-a-block row sums and staged rows, and its warps run as lane loops,
    against the check mode's fibers (every thread its own share, the shuffles and barriers),
    forward and reversed: the same bytes, and the interpreter's numbers."""
    graph, weights = post_norm_block(fmt, act)
    ref = qir.compile(graph, weights, backend="reference")
    runs = {}
    for mode, schedule in (("fast", "forward"), ("check", "forward"), ("fast", "reverse")):
        runs[mode, schedule] = compiled(graph, weights, monkeypatch, mode)
    plan = runs["fast", "forward"].plan
    assert plan is not None
    kernels = [la.kernel.source for la in plan.launches]
    assert any("qir_act_res_norm<" in k for k in kernels), "no norm_residual prologue"
    assert any("qir_act_norm<" in k for k in kernels), "no rms_norm prologue"
    for m in (1, 5, 9):  # decode (staged), a partial m-tile, two tiles
        rng = np.random.default_rng(m)
        feed = {
            k: rng.standard_normal((m, HIDDEN), dtype=np.float32).astype(act.np) for k in ("x", "o")
        }
        want = ref(feed)
        got = {}
        for (mode, schedule), run in runs.items():
            monkeypatch.setenv("QIR_HOST_SCHEDULE", schedule)
            got[mode, schedule] = run(feed)
        monkeypatch.delenv("QIR_HOST_SCHEDULE")
        base = got["fast", "forward"]
        for key, out in got.items():
            for name in want:
                assert out[name].tobytes() == base[name].tobytes(), (m, key, name)
        for name, value in want.items():
            tol = 1e-5 if act == F32 else 2e-3
            assert max_rel(np.asarray(base[name]), value) <= tol, (m, name)
