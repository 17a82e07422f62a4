"""ggml's (GGUF's) types through the generated kernels, on every backend this machine has, against
the numpy interpreter: every type in the GEMV (M = 1, the staged decode path, and M = 5) and the
GEMM (M = 33) at a ragged N = 37 and K = 256 (one K-quant block); a Q4_K_M-style layer whose
q/k (Q4_K) and v (Q6_K) share one launch (GEMV and GEMM), gate/up (Q4_K) paired, down (Q6_K)
with the residual; gate and up of two types paired; embedding rows read from quantized tables, the tied table as lm_head; stacked experts."""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir.builder import Builder
from qir.codegen.lower import lower
from qir.dtypes import BF16, F16, F32, I32, DType
from qir.formats.ggml import Ggml
from qir.formats.ggml_blocks import SPECS
from qir.interpret import BindError
from qir.passes.manager import PassOptions, run_pipeline
from qir.types import TensorType
from tests.conftest import BACKENDS, max_rel, random_weight, with_bias
from tests.runtime.test_moe_kernels import close as moe_close
from tests.runtime.test_moe_kernels import experts_graph, feed

HIDDEN, INTER, RAGGED = 256, 512, 37
ALL = tuple(Ggml(t) for t in SPECS)
# One type per decode path (4-bit codes with a min, 5-bit, 6-bit, 2 + 1-bit, bytes, a table):
# bf16's narrower window takes other shifts, and its bytes go through f16; f32 activations take
# the float decode, which is the f16 pair decode's codes times the run's scale.
PATHS = tuple(Ggml(t) for t in ("Q4_K", "Q5_0", "Q6_K", "Q3_K", "Q8_0", "IQ4_XS"))
TOL = {F16: 3e-3, BF16: 2e-2, F32: 1e-5}
PAIR_ROWS = 300  # past one GEMV block of a pair's rows at f16 for Q4_K, not for Q8_0/Q2_K


def inputs(m: int, act: DType, name: str = "x", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((m, seed))
    return {name: rng.standard_normal((m, HIDDEN), dtype=np.float32).astype(act.np)}


def close(ours: dict, ref: dict, tol: float) -> None:
    for name, want in ref.items():
        got = np.asarray(ours[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert max_rel(got, want) <= tol, name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("act", "formats"), [(F16, ALL), (BF16, PATHS), (F32, PATHS)], ids=["f16", "bf16", "f32"]
)
def test_every_type_in_the_gemv_and_the_gemm(backend: str, act: DType, formats) -> None:
    """One projection of N = 37 per type, the types taking turns over three inputs (the types
    of one input share one GEMV launch, each a part of it, and one GEMM launch, each decoded by
    its own fragment: chunks of 16, 32 and 64 weights in one K step). Biased where the type has
    a min, so a part's biases and a bias-free one sit side by side."""
    rng = np.random.default_rng(1)
    b = Builder("types")
    xs = [b.input(f"x{i}", ("M", HIDDEN), act) for i in range(3)]
    weights = {}
    for i, fmt in enumerate(formats):
        qw, weights[fmt.type] = random_weight(rng, RAGGED, HIDDEN, fmt)
        if fmt.spec.mins:
            qw, weights[fmt.type] = with_bias(rng, qw, weights[fmt.type])
        w = b.weight(fmt.type, qw, name=f"w_{fmt.type}")
        b.output(fmt.type, b.qlinear(xs[i % 3], w))
    compiled = qir.compile(b.graph, weights, backend=backend)
    reference = qir.compile(b.graph, weights, backend="reference")
    assert compiled.launches_for(1) == 3
    batches = (1, 5) if act == F32 else (1, 5, 33)
    if act != F32:
        assert compiled.launches_for(33) == 3
    for m in batches:
        x_m = {k: v for i in range(3) for k, v in inputs(m, act, f"x{i}", i).items()}
        close(compiled(x_m), reference(x_m), TOL[act])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", [F16, F32], ids=["f16", "f32"])
def test_gate_and_up_of_two_types_pair(backend: str, act: DType) -> None:
    """gate and up of different types paired (one launch, silu(g) * u its epilogue): Q4_K with
    a biased Q6_K up behind Gemma's post-norm residual and a norm (h stored once), and Q8_0 with
    Q2_K (16- and 64-weight chunks in one GEMM tile), at a
    ragged N = 300 through the GEMV (M = 1, 5) and the GEMM (M = 33). A GEMV block's rows are
    the most either type's code takes (f16: 256 and 128, 128 and 512): the other runs as several
    of its blocks in turn, some of them past the last row."""
    rng = np.random.default_rng(4)
    b = Builder("pairs")
    weights: dict = {}
    for i, (tg, tu) in enumerate((("Q4_K", "Q6_K"), ("Q8_0", "Q2_K"))):
        x = b.input(f"x{i}", ("M", HIDDEN), act)
        if i == 0:
            # Gemma's post-norm residual into the pair's norm: the gate's part stores h
            for n in ("pw", "nw"):
                weights[n] = {"weight": (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(act.np)}
            pw, nw = (b.param(n, TensorType((HIDDEN,), act), name=f"w_{n}") for n in ("pw", "nw"))
            h = b.add(b.input("r0", ("M", HIDDEN), act), b.rms_norm(x, pw, 1e-6))
            b.output("h", h)
            x = b.rms_norm(h, nw, 1e-6)
        ws = []
        for name, t in ((f"gate{i}", tg), (f"up{i}", tu)):
            qw, weights[name] = random_weight(rng, PAIR_ROWS, HIDDEN, Ggml(t))
            if name == "up0":
                qw, weights[name] = with_bias(rng, qw, weights[name])
            ws.append(b.weight(name, qw, name=f"w_{name}"))
        b.output(f"y{i}", b.mul(b.silu(b.qlinear(x, ws[0])), b.qlinear(x, ws[1])))
    compiled = qir.compile(b.graph, weights, backend=backend)
    reference = qir.compile(b.graph, weights, backend="reference")
    assert compiled.plan is not None
    names = [la.kernel.name for la in compiled.plan.launches]
    for tags in ("ggmlq4k_ggmlq6k", "ggmlq80_ggmlq2k"):
        assert any(n.startswith(f"qgemv_{tags}_") and n.endswith("_silumul") for n in names)
    assert any("ggmlq6k_" in n and "_resnormh_" in n for n in names), names
    assert compiled.launches_for(1) == 2
    for m in (1, 5) if act == F32 else (1, 5, 33):
        x_m = {k: v for i in range(2) for k, v in inputs(m, act, f"x{i}", i).items()}
        x_m.update(inputs(m, act, "r0", 2))
        close(compiled(x_m), reference(x_m), TOL[act])


def q4_k_m_layer() -> tuple[Builder, dict]:
    """x -> rms_norm -> q, k (Q4_K), v (Q6_K); x -> gate, up (Q4_K) -> silu(g) * u -> down
    (Q6_K) + x: llama.cpp's Q4_K_M on a use_more_bits layer."""
    rng = np.random.default_rng(2)
    b = Builder("q4km")
    x = b.input("x", ("M", HIDDEN), F16)
    nw = b.param("nw", TensorType((HIDDEN,), F16), name="w_norm")
    weights: dict = {"nw": {"weight": (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float16)}}
    xn = b.rms_norm(x, nw, 1e-5)
    shapes = {
        "q": (Ggml("Q4_K"), 64, HIDDEN),
        "k": (Ggml("Q4_K"), RAGGED, HIDDEN),
        "v": (Ggml("Q6_K"), RAGGED + 3, HIDDEN),
        "gate": (Ggml("Q4_K"), INTER, HIDDEN),
        "up": (Ggml("Q4_K"), INTER, HIDDEN),
        "down": (Ggml("Q6_K"), HIDDEN, INTER),
    }
    ws = {}
    for name, (fmt, o, i) in shapes.items():
        qw, weights[name] = random_weight(rng, o, i, fmt)
        if name == "k":
            qw, weights[name] = with_bias(rng, qw, weights[name])
        ws[name] = b.weight(name, qw, name=f"w_{name}")
    for name in ("q", "k", "v"):
        b.output(name, b.qlinear(xn, ws[name]))
    h = b.mul(b.silu(b.qlinear(x, ws["gate"])), b.qlinear(x, ws["up"]))
    b.output("y", b.add(x, b.qlinear(h, ws["down"])))
    return b, weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_q4_k_m_layer_fuses_across_types(backend: str, monkeypatch) -> None:
    """q/k/v of two types in one launch with the norm prologue, the pair's epilogue, down's
    residual: 3 launches a decode step and a prefill chunk, as for one format; a captured
    replay gives the same bytes, and on the host so does the reverse schedule."""
    b, weights = q4_k_m_layer()
    compiled = qir.compile(b.graph, weights, backend=backend)
    reference = qir.compile(b.graph, weights, backend="reference")
    assert compiled.plan is not None
    names = [la.kernel.name for la in compiled.plan.launches if la.runs_for(1)]
    assert compiled.launches_for(1) == 3, names
    assert any(n.startswith("qgemv_ggmlq4k_ggmlq6k_f16_n64_37b_40_k256") for n in names), names
    assert any(n.endswith("_silumul") for n in names) and any(n.endswith("_res") for n in names)
    # the GEMM too: one launch, Q4_K's and Q6_K's fragments each in it
    assert compiled.launches_for(33) == 3
    gemms = [la.kernel.name for la in compiled.plan.launches if la.runs_for(33)]
    assert any(n.startswith("qgemm_ggmlq4k_ggmlq6k_f16_n64_37b_40_k256") for n in gemms), gemms
    for m in (1, 5, 33):
        x = inputs(m, F16)
        ours = compiled(x)
        close(ours, reference(x), TOL[F16])
        replayed = compiled.capture(m)(x)
        for name, value in ours.items():
            got = replayed[name]
            assert (got.get() if hasattr(got, "get") else np.asarray(got)).tobytes() == (
                value.tobytes()
            ), (name, m)
        if backend == "host":
            monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
            backward = compiled(x)
            monkeypatch.delenv("QIR_HOST_SCHEDULE")
            for name, value in ours.items():
                assert value.tobytes() == backward[name].tobytes(), (name, m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_rows_and_tied_lm_head_from_ggml_tables(backend: str) -> None:
    """token_embd in Q4_K, Q6_K and Q8_0 (vocab 37): the gathered rows equal the
    interpreter's bytes (the decode is exact); each table is
    also the lm_head (tied) of its rows."""
    rng = np.random.default_rng(4)
    b = Builder("embed")
    ids = b.input("ids", ("M",), I32)
    weights = {}
    for t in ("Q4_K", "Q6_K", "Q8_0"):
        qw, weights[t] = random_weight(rng, RAGGED, HIDDEN, Ggml(t))
        table = b.weight(t, qw, name=f"w_{t}")
        rows = b.embedding(ids, table, F16, name=f"embed_{t}")
        b.output(f"embed_{t}", rows)
        b.output(f"logits_{t}", b.qlinear(rows, table))
    compiled = qir.compile(b.graph, weights, backend=backend)
    reference = qir.compile(b.graph, weights, backend="reference")
    for m, seed in ((1, 0), (6, 1)):
        x = {"ids": np.random.default_rng(seed).integers(0, RAGGED, m).astype(np.int32)}
        ours, want = compiled(x), reference(x)
        for name, value in want.items():
            if name.startswith("embed_"):
                assert np.asarray(ours[name]).tobytes() == value.tobytes(), name
            else:
                assert max_rel(np.asarray(ours[name]), value) <= TOL[F16], name


@pytest.mark.parametrize("gemm_from_m", [None, 1], ids=["gemv", "grouped"])
def test_expert_tensors_in_ggml_types(gemm_from_m: int | None) -> None:
    """Stacked experts (a GGUF's ffn_*_exps) in Q4_K: the expert GEMVs (decode), and the
    grouped GEMM, on the host."""
    graph, weights = experts_graph(Ggml("Q4_K"), 2, k_in=HIDDEN, inter=HIDDEN)
    compiled = qir.compile(graph, weights, backend="host", gemm_from_m=gemm_from_m)
    reference = qir.compile(graph, weights, backend="reference")
    prefix = "moe_qgemm_" if gemm_from_m else "moe_gemv_"
    assert compiled.plan is not None
    assert any(la.kernel.name.startswith(prefix) for la in compiled.plan.launches)
    for m in (1, 9):
        x = feed(m, 2, k_in=HIDDEN)
        moe_close(compiled(x), reference(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_types_at_one_row_sum_integer_activations(backend: str) -> None:
    """At M = 1 a table type's GEMV (IQ4_NL, IQ4_XS) quantizes its row of x to 14-bit integers
    per run of codes and sums the products by DP4A (qgemv.cu.j2's int path), a launch of its
    own (`_xi16`) that runs at M = 1 only; from M = 2 the f16 pair path runs. Through the
    fusions: an rms_norm prologue and a bias (a ragged N, an odd number of chunks: K = 544),
    gate/up paired with silu(g) * u from a normed input, down with the residual; against the interpreter on rows whose runs
    hold an outlier, values below 2^-10 (fewer bits kept), zeros; a non-finite x gives no finite
    output. A batch captured at 2 rows does not serve 1 (other numerics)."""
    rng = np.random.default_rng(5)
    k, kq = 2 * HIDDEN, 2 * HIDDEN + 32
    b = Builder("tables")
    weights = {}

    def weight(name: str, fmt: str, rows: int, cols: int, bias: bool = False):
        qw, bufs = random_weight(rng, rows, cols, Ggml(fmt))
        if bias:
            qw, bufs = with_bias(rng, qw, bufs)
        weights[name] = bufs
        return b.weight(name, qw, name=f"w_{name}")

    def normed(name: str, size: int):
        x = b.input(name, ("M", size), F16)
        norm = (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float16)
        weights[f"n_{name}"] = {"weight": norm}
        nw = b.param(f"n_{name}", TensorType((size,), F16), name=f"w_n_{name}")
        return x, b.rms_norm(x, nw, 1e-5)

    _, q_in = normed("q", kq)
    b.output("q", b.qlinear(q_in, weight("wq", "IQ4_NL", RAGGED, kq, bias=True)))
    x, x_in = normed("x", k)
    g = b.qlinear(x_in, weight("gate", "IQ4_XS", HIDDEN, k))
    u = b.qlinear(x_in, weight("up", "IQ4_XS", HIDDEN, k))
    b.output("y", b.add(b.qlinear(b.mul(b.silu(g), u), weight("down", "IQ4_NL", k, HIDDEN)), x))
    compiled = qir.compile(b.graph, weights, backend=backend)
    reference = qir.compile(b.graph, weights, backend="reference")
    gemvs = {
        m: [
            la.kernel.name
            for la in compiled.plan.launches
            if la.runs_for(m) and la.kernel.name.startswith("qgemv_")
        ]
        for m in (1, 2)
    }
    assert len(gemvs[1]) == 3 and all(n.endswith("_xi16") for n in gemvs[1]), gemvs[1]
    assert "_rmsnorm_wf16" in gemvs[1][0] and "_silumul" in "".join(gemvs[1]), gemvs[1]
    assert len(gemvs[2]) == 3 and not any("_xi16" in n for n in gemvs[2]), gemvs[2]

    def row(seed: int, size: int) -> np.ndarray:
        v = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
        v[:32] *= 0.01
        v[5] = 300.0  # one run: an outlier among small values
        v[32:64] *= 1e-4  # one run below 2^-10, normed too: fewer bits kept
        v[64:96] = 0.0
        return v

    def feed(m: int) -> dict[str, np.ndarray]:
        return {
            name: np.stack([row(i, size)[::step] for i in range(m)]).astype(np.float16)
            for name, size, step in (("q", kq, 1), ("x", k, -1))
        }

    for m in (1, 2):
        close(compiled(feed(m)), reference(feed(m)), TOL[F16])
    bad = feed(1)
    for v in bad.values():
        v[0, 100] = np.inf
    out = compiled(bad)
    assert not np.isfinite(np.asarray(out["q"], np.float32)).any()
    assert not np.isfinite(np.asarray(out["y"], np.float32)).any()
    with pytest.raises(BindError, match=r"M=1: no captured batch size of at least 1 rows"):
        compiled.capture_batches([2])(feed(1))
    # bf16 activations keep the pair path at every batch size (the quantization rounds in f16).
    bf = Builder("bf16")
    xb = bf.input("x", ("M", k), BF16)
    qw, _ = random_weight(rng, RAGGED, k, Ggml("IQ4_NL"))
    bf.output("y", bf.qlinear(xb, bf.weight("w", qw, name="w_w")))
    names = [la.kernel.name for la in lower(run_pipeline(bf.graph, "default")[0]).launches]
    assert names and not any("_xi16" in n for n in names), names
    # Without a GEMV at M = 1 (GEMMs from M = 1) the launches do not split at M = 2.
    gemms = lower(run_pipeline(b.graph, "default", options=PassOptions(gemm_from_m=1))[0])
    assert not any(la.kernel.name.startswith("qgemv_") for la in gemms.launches)
    assert all(la.runs_for(1) == la.runs_for(2) for la in gemms.launches), [
        (la.kernel.name, la.when) for la in gemms.launches
    ]
