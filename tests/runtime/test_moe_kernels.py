"""The mixture-of-experts kernels on the host backend against the interpreter: the router's top-k
(every rule, ties, more experts than a warp has lanes), the expert GEMVs (decode: expert-major
gate/up, token-major down with the combine and the residual) and the grouped path (prefill:
grouping on the device, grouped GEMMs, the combine), on ragged shapes (5 experts, N = 37, k = 1
and 2, experts chosen by many tokens and by none, M = 1 to 70); the reversed host schedule gives
the same bytes; a token's bytes do not depend on the batch's other tokens; a captured decode step
replays with new expert choices; an instrumented build counts the weight bytes each expert's
blocks read: each chosen expert's once, the others' never (poisoned, they leave no trace)."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np
import pytest

import qir
from qir import moe
from qir.api import Compiled
from qir.builder import Builder
from qir.codegen.moe import ExpertGemvSpec, expert_gemv_kernel, route_kernel
from qir.dtypes import BF16, F16, F32, I32, DType
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.fp8 import Fp8
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.runtime import nvrtc
from qir.runtime.backend import get_backend
from qir.types import QExperts, QWeight, TensorType
from tests.conftest import FMT4, max_rel
from tests.moe_common import random_experts
from tests.requires import requires

E, K_IN, N_OUT = 5, 64, 37  # N = 37: no multiple of a block's rows (nor of a warp's, 4)
FORMATS = (
    FMT4,  # integer codes, a scale and bias per group of each row
    Nvfp4("div", 16),  # E2M1 codes, a per-tensor scale per expert ([E, 1])
    Fp8("tensor"),  # E4M3, a per-tensor scale per expert
    Gptq(4, 32, "gptq", 1, F16),  # act-order: g_idx per expert, one row per warp
)


def experts_graph(
    fmt: WeightFormat, top: int, act: DType = F16, seed: int = 0, k_in: int = K_IN, inter: int = 64
) -> tuple[Graph, Any]:
    """ids and router weights as inputs, so a test chooses the experts: gate/up (silu(g) * u,
    [M, top, inter]) of x, down of those slots combined with the residual r ([M, 37]), and a
    plain expert projection of x ([M, top, 37])."""
    rng = np.random.default_rng(seed)
    b = Builder("experts")
    x = b.input("x", ("M", k_in), act)
    ids = b.input("ids", ("M", top), I32)
    rw = b.input("rw", ("M", top), F32)
    r = b.input("r", ("M", N_OUT), act)
    ws, weights = {}, {}
    for name, (o, i) in {
        "gate": (inter, k_in),
        "up": (inter, k_in),
        "down": (N_OUT, inter),
        "proj": (N_OUT, k_in),
    }.items():
        qe, weights[name] = random_experts(rng, E, o, i, fmt)
        ws[name] = b.weight(name, qe, name=f"w_{name}")
    h = b.expert_qlinear(x, (ws["gate"], ws["up"]), ids, name="h")
    b.output("h", h)
    b.output("y", b.expert_qlinear(h, ws["down"], ids, rw, r, name="y"))
    b.output("s", b.expert_qlinear(x, ws["proj"], ids, name="s"))
    return b.graph, weights


def choices(m: int, top: int, seed: int = 0) -> np.ndarray:
    """Expert 0 chosen by every token (m pairs: past a tile of 8 at m = 9), 1..3 by some, 4 by
    none."""
    rng = np.random.default_rng(seed + 100 * m)
    ids = np.zeros((m, top), np.int32)
    for t in range(m):
        others = rng.permutation([1, 2, 3])[: top - 1]
        slots = [0, *others.tolist()]
        ids[t] = rng.permutation(slots) if top > 1 else slots[:1]
    return ids


def feed(
    m: int, top: int, act: DType = F16, seed: int = 0, k_in: int = K_IN
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + m)
    rw = rng.random((m, top), dtype=np.float32) + 0.1
    return {
        "x": rng.standard_normal((m, k_in), dtype=np.float32).astype(act.np),
        "ids": choices(m, top, seed),
        "rw": (rw / rw.sum(axis=1, keepdims=True)).astype(np.float32),
        "r": rng.standard_normal((m, N_OUT), dtype=np.float32).astype(act.np),
    }


@cache
def compiled(
    fmt: WeightFormat, top: int, gemm_from_m: int | None = None
) -> tuple[Compiled, Compiled]:
    graph, weights = experts_graph(fmt, top)
    kernels = qir.compile(graph, weights, backend="host", gemm_from_m=gemm_from_m)
    return kernels, qir.compile(graph, weights, backend="reference")


def close(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
    """The GEMVs sum 16-bit pairs (about 1e-3 of a row's largest output, see docs/cost-model.md's
    static cost section); silu(g) * u multiplies two such sums."""
    for name, want in ref.items():
        got = np.asarray(ours[name])
        assert got.shape == want.shape and got.dtype == want.dtype, name
        tol = 4e-3 if name == "h" else 2e-3
        assert max_rel(got, want) <= tol, (name, max_rel(got, want))


def reversed_bytes(
    c: Compiled, x: dict[str, np.ndarray], mp: pytest.MonkeyPatch
) -> dict[str, bytes]:
    mp.setenv("QIR_HOST_SCHEDULE", "reverse")
    out = c(x)
    mp.delenv("QIR_HOST_SCHEDULE")
    return {k: np.asarray(v).tobytes() for k, v in out.items()}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.tag())
def test_expert_gemvs_match_the_interpreter(
    fmt: WeightFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    c, ref = compiled(fmt, 2)
    for m in (1, 9):  # the expert GEMVs serve decode batches
        assert all(
            la.kernel.name.startswith("moe_gemv_") for la in c.plan.launches if la.runs_for(m)
        )
    assert c.launches_for(1) == 3  # gate/up, down + combine + residual, the plain projection
    for m in (1, 3, 9):
        x = feed(m, 2)
        ours = c(x)
        close(ours, ref(x))
        if m == 9:
            assert reversed_bytes(c, x, monkeypatch) == {k: v.tobytes() for k, v in ours.items()}


@pytest.mark.parametrize(
    "fmt", [MlxAffine(4, 32, BF16), Gptq(4, 32, "gptq", 1, F16)], ids=lambda f: f.tag()
)
def test_short_rows_in_groups_of_lanes(fmt: WeightFormat) -> None:
    """K of 5 chunks (gate/up, the projection: one lane per row, its last pass one chunk) and 12
    (down: two lanes per row, three passes), N = 37 rows (no multiple of a group's rows, nor of a
    block's): the interpreter's results at decode (the M = 1 path, slot by slot) and in tiles,
    and a token's bytes alone equal its bytes in a batch."""
    graph, weights = experts_graph(fmt, 2, k_in=160, inter=384)
    c = qir.compile(graph, weights, backend="host")
    ref = qir.compile(graph, weights, backend="reference")
    names = [la.kernel.name for la in c.plan.launches if la.kernel.name.startswith("moe_gemv_")]
    assert any("_k160_m8_l1" in n for n in names) and any("_k384_m8_l2_" in n for n in names)
    for m in (1, 3, 9):
        x = feed(m, 2, k_in=160)
        ours = c(x)
        close(ours, ref(x))
        alone = c({k: v[2:3] for k, v in x.items()}) if m > 2 else None
        for name in ("h", "y", "s") if alone else ():
            assert alone[name][0].tobytes() == np.asarray(ours[name])[2].tobytes(), (name, m)


def test_one_expert_per_token() -> None:
    c, ref = compiled(FMT4, 1)
    for m in (1, 9):
        close(c(feed(m, 1)), ref(feed(m, 1)))


@pytest.mark.parametrize(
    ("fmt", "batches"), [(FMT4, (1, 17, 64)), (Nvfp4("div", 16), (70,))], ids=["mlx4", "nvfp4"]
)
def test_grouped_path_matches_the_interpreter(
    fmt: WeightFormat, batches: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    c, ref = compiled(fmt, 2, gemm_from_m=1)
    m = batches[-1]
    active = [la.kernel.name for la in c.plan.launches if la.runs_for(m)]
    kinds = sorted(n.split("_")[1] for n in active)  # one grouping shared by the three GEMMs
    assert kinds == ["combine", "group", "qgemm", "qgemm", "qgemm"], active
    for m in batches:
        x = feed(m, 2)
        ours = c(x)
        close(ours, ref(x))
    assert reversed_bytes(c, x, monkeypatch) == {k: v.tobytes() for k, v in ours.items()}


@pytest.mark.parametrize("gemm", [False, True], ids=["gemv", "grouped"])
def test_a_tokens_bytes_do_not_depend_on_the_other_tokens(gemm: bool) -> None:
    c, _ = compiled(FMT4, 2, gemm_from_m=1 if gemm else None)
    m = 20 if gemm else 5
    a, b = feed(m, 2, seed=1), feed(m, 2, seed=2)
    for k in ("x", "ids", "rw", "r"):
        b[k][3] = a[k][3]  # token 3 the same, every other token (and its experts) different
    ya, yb = c(a), c(b)
    for name in ("h", "y", "s"):
        assert ya[name][3].tobytes() == yb[name][3].tobytes(), name
    if not gemm:  # and alone: the decode step of that token
        alone = c({k: v[3:4] for k, v in a.items()})
        for name in ("h", "y", "s"):
            assert alone[name][0].tobytes() == ya[name][3].tobytes(), name


def test_a_captured_decode_step_replays_with_new_expert_choices() -> None:
    c, ref = compiled(FMT4, 2)
    step = c.capture(2)
    for seed in (3, 4, 5):
        x = feed(2, 2, seed=seed)
        x["ids"] = np.array([[seed % 4, 4], [4 - seed % 2, seed % 3]], np.int32)
        replayed = {k: np.array(v) for k, v in step(x).items()}
        assert {k: v.tobytes() for k, v in replayed.items()} == {
            k: v.tobytes() for k, v in c(x).items()
        }
        close(replayed, ref(x))


def normed_experts_graph(act: DType) -> tuple[Graph, Any]:
    """A post-attention norm read only by experts: gate/up (silu(g) * u) and a plain expert
    projection of rms_norm(x, w) (both [M, 2, 37]: a ragged N), w bf16; norm_prologue folds the
    norm into both."""
    rng = np.random.default_rng(11)
    b = Builder("normed_experts")
    x = b.input("x", ("M", K_IN), act)
    ids = b.input("ids", ("M", 2), I32)
    weights: dict[str, Any] = {
        "norm": {"weight": (1 + rng.standard_normal(K_IN) / 8).astype(BF16.np)}
    }
    xn = b.rms_norm(x, b.param("norm", TensorType((K_IN,), BF16)), 1e-5)
    ws = {}
    for name in ("gate", "up", "proj"):
        qe, weights[name] = random_experts(rng, E, N_OUT, K_IN, FMT4)
        ws[name] = b.weight(name, qe, name=f"w_{name}")
    b.output("h", b.expert_qlinear(xn, (ws["gate"], ws["up"]), ids, name="h"))
    b.output("s", b.expert_qlinear(xn, ws["proj"], ids, name="s"))
    return b.graph, weights


@pytest.mark.parametrize(
    ("act", "gemm"), [(BF16, False), (F32, False), (BF16, True)], ids=["bf16", "f32", "grouped"]
)
def test_the_norm_prologue_in_the_expert_kernels(act: DType, gemm: bool) -> None:
    """The experts normalise the rows they read (the decode GEMVs, slot by slot at M = 1 and
    in tiles of listed rows above; the grouped GEMMs' gathered rows): no launch computes the
    norm alone, and the results equal the interpreter's unfused graph on ragged batches."""
    graph, weights = normed_experts_graph(act)
    c = qir.compile(graph, weights, backend="host", gemm_from_m=1 if gemm else None)
    ref = qir.compile(graph, weights, backend="reference")
    assert c.plan is not None
    names = [la.kernel.name for la in c.plan.launches]
    experts = [n for n in names if n.startswith(("moe_gemv", "moe_qgemm"))]
    assert experts and all("_rmsnorm_wbf16" in n for n in experts), names
    assert not any(n.startswith("rms_norm") for n in names), names
    assert c.launches_for(1) == (3 if gemm else 2)  # (the grouping,) gate/up, the projection
    rng = np.random.default_rng(12)
    for m in (3, 9, 40) if gemm else (1, 3, 9):
        x = {
            "x": (3 * rng.standard_normal((m, K_IN), dtype=np.float32)).astype(act.np),
            "ids": choices(m, 2),
        }
        ours, want = c(x), ref(x)
        for name in ("h", "s"):
            tol = 1e-5 if act == F32 else 1.6e-2
            assert max_rel(np.asarray(ours[name]), want[name]) <= tol, (m, name)


@pytest.mark.parametrize("rule", moe.RULES)
def test_route_kernel_matches_the_interpreter(rule: str) -> None:
    """37 experts (two logits per lane), top 4 and top 1, ties among the largest logits."""
    be = get_backend("host")
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((6, 37)).astype(np.float16)
    logits[1, [3, 9, 30]] = 4.0  # a three-way tie for the top, lower ids first
    logits[2, :] = 1.0  # every expert tied
    for top in (4, 1):
        kernel = be.load(route_kernel(F16, 37, top, rule))
        ids, weights = np.zeros((6, top), np.int32), np.zeros((6, top), np.float32)
        be.launch(kernel, (1, 6, 1), [logits, ids, weights, 6])
        want_ids, want_w = moe.route(logits, top, rule)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want_w, rtol=2e-6)
    assert ids[1, 0] == 3 and ids[2, 0] == 0


def test_an_expert_launch_takes_at_most_32_experts_per_token() -> None:
    e, _ = random_experts(np.random.default_rng(0), 40, 8, 64, FMT4)
    ExpertGemvSpec((e,), F16, 8, 32)
    with pytest.raises(ValueError, match=r"top must be 1\.\.32 experts per token, got 33"):
        ExpertGemvSpec((e,), F16, 8, 33)


@requires("nvrtc")
def test_short_rows_get_more_lanes_where_the_combines_shared_memory_needs_them() -> None:
    """K = 128 (4 chunks: one lane a row) with 8 experts a token: the combine's floats per
    (tile row, slot, block row) would take 128 KB for a block's 512 rows; its rows get 4 lanes
    (128 rows a block), and the kernel builds for sm_90 (48 KB of static shared memory)."""
    e = QExperts(QWeight(Awq(4, 128), 2048, 128), 16)
    slots = ExpertGemvSpec((e, e), F16, 8, 8)
    combine = ExpertGemvSpec((e,), F16, 8, 8, combine="combine_residual", per_slot=True)
    assert slots.gemv.lanes == 1 and combine.gemv.lanes == 4 and combine.block_rows == 128
    assert "_k128_m8_l4_combine_res" in combine.name
    (result,) = nvrtc.check_no_spills(expert_gemv_kernel(combine), archs=("sm_90",))
    assert 0 < result.report.smem_bytes <= 48 * 1024


def _instrumented(spec: ExpertGemvSpec, args: list[Any], grid: tuple[int, int, int]) -> np.ndarray:
    """reads[e]: the weight bytes the blocks of expert e read in one launch of `spec`."""
    be = get_backend("host")
    reads = np.zeros(E, np.uint64)
    be.launch(be.load(expert_gemv_kernel(spec)), grid, [*args[:-1], reads, args[-1]])
    return reads


@pytest.mark.parametrize("m", [4, 1], ids=["tiles", "decode"])
@pytest.mark.parametrize("kind", ["slots", "combine"])
def test_each_chosen_expert_is_read_once_and_the_others_never(kind: str, m: int) -> None:
    """At M = 4 the tiles (0 and 3 chosen by three tokens, 2 by two), at M = 1 the decode path
    (token 0's slots, each straight through its expert)."""
    rng = np.random.default_rng(11)
    top = 2
    ids = np.array([[0, 3], [3, 2], [0, 3], [2, 0]], np.int32)[:m]
    chosen = sorted(set(ids.flat))
    x = rng.standard_normal((m, 64), dtype=np.float32).astype(np.float16)
    if kind == "slots":
        (g, gb), (u, ub) = (random_experts(rng, E, 64, 64, FMT4) for _ in range(2))
        spec = ExpertGemvSpec((g, u), F16, 8, top, count=True)
        bufs, rw = [gb, ub], []
        out = np.zeros((m, top, 64), np.float16)
    else:
        d, db = random_experts(rng, E, 64, 64, FMT4)
        spec = ExpertGemvSpec((d,), F16, 8, top, combine="combine", count=True)
        bufs, rw = [db], [np.full((m, top), 0.5, np.float32)]
        out = np.zeros((m, 64), np.float16)
    per_expert = sum(a.nbytes for b in bufs for a in b.values()) // E  # each is per-row data
    clean = [{k: v.copy() for k, v in b.items()} for b in bufs]
    for b in bufs:  # the experts nobody chose: NaN scales, which any read would spread
        for e in set(range(E)) - set(chosen):
            b["scales"][e] = np.nan
    weights = [a for b in bufs for a in b.values()]
    reads = _instrumented(spec, [x, *weights, ids, *rw, out, m], (spec.grid_x, 1, 1))
    assert reads.tolist() == [per_expert if e in chosen else 0 for e in range(E)]
    assert np.isfinite(out.astype(np.float32)).all()
    # The output is what the clean weights give (the interpreter on one expert_qlinear).
    b = Builder("one")
    xv = b.input("x", ("M", 64), F16)
    iv = b.input("ids", ("M", top), I32)
    ws = tuple(b.weight(f"w{i}", e) for i, e in enumerate(spec.experts))
    feed_ = {"x": x, "ids": ids}
    if kind == "combine":
        rv = b.input("rw", ("M", top), F32)
        feed_["rw"] = rw[0]
        y = b.expert_qlinear(xv, ws[0], iv, rv)
    else:
        y = b.expert_qlinear(xv, ws if len(ws) == 2 else ws[0], iv)
    b.output("y", y)
    want = qir.interpret(b.graph, feed_, {f"w{i}": c for i, c in enumerate(clean)})["y"]
    assert max_rel(out, want) <= 2e-3


@pytest.mark.parametrize("act", [F32, BF16])
def test_moe_mlp_with_its_router_matches_the_interpreter(act: DType) -> None:
    """A whole MoE MLP behind its RMSNorm (router, route, gate/up, down + combine + residual;
    the norm in the router's and the gate/up's prologues): f32 stays on the expert GEMVs at
    every M (1e-5), bf16 takes the grouped path from 17 rows."""
    from tests.moe_common import inputs, moe_graph

    rng = np.random.default_rng(5)
    graph, weights = moe_graph(rng, 64, 128, 6, 2, FMT4, act=act, router_scale=3.0, norm=True)
    c = qir.compile(graph, weights, backend="host")
    ref = qir.compile(graph, weights, backend="reference")
    for m in (1, 20):
        x = inputs(rng, m, 64, act)
        ours, want = c(x), ref(x)
        np.testing.assert_array_equal(ours["ids"], want["ids"])
        assert max_rel(ours["y"], want["y"]) <= (1e-5 if act == F32 else 1e-2)
    # router, route, gate/up, down + combine + residual: the norm has no launch of its own
    assert c.launches_for(1) == 4
    assert c.launches_for(20) == (4 if act == F32 else 6)  # + group, combine


def test_plans_count_the_bytes_of_the_chosen_experts_only() -> None:
    """A decode step's expert launches move k experts' weights (at most min(E, M k)); the plan's
    memory report gives every weight's bytes and a token's active share."""
    from qir.codegen.lower import lower
    from qir.dump import plan_json
    from qir.passes.manager import run_pipeline
    from tests.moe_common import moe_graph

    graph, weights = moe_graph(np.random.default_rng(0), 64, 128, 6, 2, FMT4)
    plan = lower(run_pipeline(graph, "default")[0])
    one = {n: sum(a.nbytes for a in weights[n].values()) // 6 for n in ("gate", "up", "down")}
    report = plan_json(plan, 1)
    router = sum(a.nbytes for a in weights["router"].values())
    assert report["memory"]["weights_bytes"] == router + 6 * sum(one.values())
    assert report["memory"]["active_weights_bytes"] == router + 2 * sum(one.values())
    gate_up = next(la for la in plan.launches if "silumul" in la.kernel.name and la.runs_for(1))
    moved = {m: plan.bytes_moved(gate_up, m) for m in (1, 2, 3, 4)}
    activations = {m: m * 64 * 2 + m * 2 * 4 + m * 2 * 128 * 2 for m in moved}  # x, ids, h
    assert {m: moved[m] - activations[m] for m in moved} == {
        m: min(6, 2 * m) * (one["gate"] + one["up"]) for m in moved
    }


def biased_swiglu_graph(fmt: WeightFormat, top: int) -> tuple[Graph, Any]:
    """gpt-oss's experts: every expert with a bias, gate/up through the clamped SwiGLU with a
    limit that clamps about half the gates and ups (0.6), down combined with the residual."""
    rng = np.random.default_rng(3)
    b = Builder("gptoss_experts")
    x = b.input("x", ("M", K_IN), F16)
    ids = b.input("ids", ("M", top), I32)
    rw = b.input("rw", ("M", top), F32)
    r = b.input("r", ("M", N_OUT), F16)
    ws, weights = {}, {}
    for name, (o, i) in {"gate": (64, K_IN), "up": (64, K_IN), "down": (N_OUT, 64)}.items():
        qe, bufs = random_experts(rng, E, o, i, fmt)
        bufs["bias"] = rng.standard_normal((E, o), dtype=np.float32) * 0.5
        weights[name] = bufs
        ws[name] = b.weight(name, QExperts(replace(qe.expert, bias=True), E), name=f"w_{name}")
    act = {"act": "swiglu_clamp", "limit": 0.6, "alpha": 1.702}
    h = b.expert_qlinear(x, (ws["gate"], ws["up"]), ids, name="h", act=act)
    b.output("h", h)
    b.output("y", b.expert_qlinear(h, ws["down"], ids, rw, r, name="y"))
    return b.graph, weights


@pytest.mark.parametrize("gemm", [False, True], ids=["gemv", "grouped"])
def test_expert_biases_and_the_clamped_swiglu_match_the_interpreter(gemm: bool) -> None:
    """MXFP4 experts with biases (gpt-oss's) through the expert GEMVs (decode) and the grouped
    GEMMs (prefill): each chosen expert's bias in its rows' sums, the clamped gate and up in
    the gate/up epilogue; ragged N (37), experts chosen by many tokens and by none."""
    graph, weights = biased_swiglu_graph(Mxfp4(), 2)
    c = qir.compile(graph, weights, backend="host", gemm_from_m=1 if gemm else None)
    ref = qir.compile(graph, weights, backend="reference")
    names = [la.kernel.name for la in c.plan.launches if la.runs_for(17 if gemm else 1)]
    experts = [n for n in names if n.startswith(("moe_gemv", "moe_qgemm"))]
    assert len(experts) == 2 and "_swiglu0p6a1p702" in experts[0], names
    # the names spell the biases: "_bias" (GEMV), "n64b" (GEMM: a biased weight's rows)
    assert all("_bias" in n or "n64b" in n or "n37b" in n for n in experts), names
    for m in (1, 9) if not gemm else (17, 40):
        x = feed(m, 2)
        close(c(x), ref(x))
    # the bias and the clamp are in the reference the kernels met: without them it differs
    h = ref(x)["h"]
    plain = {k: dict(v) for k, v in weights.items()}
    for k in plain:
        plain[k]["bias"] = np.zeros_like(plain[k]["bias"])
    assert max_rel(qir.compile(graph, plain, backend="reference")(x)["h"], h) > 0.1


def a4_weights(fmt: Nvfp4, weights: Any) -> Any:
    """Each expert its own calibrated input scale (gate's and up's the same, as calibrated on
    one input), so that a kernel quantizing under the wrong expert's scale shows."""
    if fmt.act_bits == 4:
        spread = np.array([1.0, 4.0, 0.25, 2.0, 0.5], np.float32)[:, None]
        for n in ("gate", "down", "proj"):
            s = spread if fmt.scale_mode == "mul" else 1 / spread
            weights[n]["input_scale"] = weights[n]["input_scale"] * s
        weights["up"]["input_scale"] = weights["gate"]["input_scale"].copy()
    return weights


@pytest.mark.parametrize(
    ("fmt", "act", "batches"),
    [
        (Nvfp4("mul", 4), F16, (1, 3, 9, 70)),  # ModelOpt's calibrated decode factors
        (Nvfp4("div", 4), BF16, (1, 3, 9)),  # compressed-tensors' encode factors
        (Nvfp4("div", 16), F32, (1, 9)),  # --weight-quantization w4a4: a per-row scale
    ],
    ids=lambda v: v.tag() if isinstance(v, Nvfp4) else None,
)
def test_w4a4_expert_gemvs_match_the_interpreter(
    fmt: Nvfp4, act: DType, batches: tuple[int, ...]
) -> None:
    """NVFP4 experts with 4-bit activations: the expert GEMVs quantize each slot's input as
    they read it, under its expert's scale (decode: the staged row; tiles: each block as read),
    up to 64 rows; above, the 16-bit grouped GEMMs (f32: the 16-bit expert GEMVs). Ragged N
    (37), experts chosen by many tokens and by none."""
    graph, weights = experts_graph(fmt, 2, act)
    weights = a4_weights(fmt, weights)
    c = qir.compile(graph, weights, backend="host", weight_quantization="w4a4")
    ref = qir.compile(graph, weights, backend="reference", weight_quantization="w4a4")
    a16 = qir.compile(graph, weights, backend="reference", weight_quantization="w4a16")
    mode = {"mul": "mul", "div": "div"}[fmt.scale_mode] if fmt.act_bits == 4 else "dynamic"
    for m in (*batches, 65):
        names = [la.kernel.name for la in c.plan.launches if la.runs_for(m)]
        experts = [n for n in names if n.startswith(("moe_gemv", "moe_qgemm"))]
        assert len(experts) == 3 and all(n.endswith(f"_a4{mode}") == (m <= 64) for n in experts)
        if m not in batches:
            continue
        x = feed(m, 2, act)
        ours, want = c(x), ref(x)
        close(ours, want)
        if m == 9:  # the 4-bit activations are in the reference the kernels met
            assert max_rel(a16(x)["s"], want["s"]) > 1e-2
