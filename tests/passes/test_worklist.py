"""The worklist rewrite driver against the restarting one it replaced (tests/passes/
restarting_driver.py): on random graphs every pass and the default pipeline print the same IR
and count the same matches. And the passes at model scale: a 200-layer graph comes out with the
structure of one layer, 200 times."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qir import print_graph
from qir.builder import Builder, Value
from qir.codegen.lower import lower
from qir.dtypes import BF16, F16
from qir.formats.base import WeightFormat
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph, Node
from qir.passes.manager import PASSES, PassOptions, run_pipeline
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, apply_rules
from qir.types import QWeight
from tests.passes import restarting_driver
from tests.passes.restarting_driver import restarting

# Formats that merge with each other or not, take 4-bit activations or not; W4A4 weights
# calibrated for two different activation scales (never merged, never sharing a quantize_act);
# two NVFP4 formats that are not merged but (routed by the w4a4 tier) share one quantize_act.
FORMATS: tuple[tuple[WeightFormat, dict[str, float]], ...] = (
    (MlxAffine(4, 64, BF16), {}),
    (MlxAffine(8, 64, BF16), {}),
    (Nvfp4("mul", 4), {"input_scale": 0.5}),
    (Nvfp4("mul", 4), {"input_scale": 0.25}),
    (Nvfp4("mul", 16), {}),
    (Nvfp4("div", 16), {}),
)
WIDTHS = (64, 128)


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    """Blocks of MLPs, q/k/v groups and loose ops over a few inputs, some sharing inputs, with
    names that sometimes collide when joined (merge_parallel names a merged node a_b_c)."""
    b = Builder("r")
    values: list[Value] = [
        b.input(f"x{i}", ("M", draw(st.sampled_from(WIDTHS))), F16)
        for i in range(draw(st.integers(1, 3)))
    ]
    n = 0

    def name() -> str:
        nonlocal n
        n += 1
        return draw(st.sampled_from((f"v{n}", f"a_{n}", f"b{n}_c")))

    def qlinear(
        x: Value, out: int | None = None, fmt: tuple[WeightFormat, dict[str, float]] | None = None
    ) -> Value:
        fmt, rule = fmt or draw(st.sampled_from(FORMATS))
        out = out or draw(st.sampled_from(WIDTHS))
        w = b.weight(f"w{n}", QWeight(fmt, out, int(x.type.shape[1])), name(), rule)
        return b.qlinear(x, w, name())

    for _ in range(draw(st.integers(1, 8))):
        x = draw(st.sampled_from(values))
        kind = draw(st.sampled_from(("mlp", "mlp", "qkv", "qlinear", "silu", "mul", "add")))
        if kind == "mlp":
            width = draw(st.sampled_from(WIDTHS))
            fmt = draw(st.sampled_from(FORMATS))  # gate and up mostly of one format
            g, u = qlinear(x, width, fmt), qlinear(x, width, fmt if draw(st.booleans()) else None)
            silu_first = draw(st.booleans())
            s = b.silu(g, name())
            h = b.mul(s, u, name()) if silu_first else b.mul(u, s, name())
            down = qlinear(h, int(x.type.shape[1]))
            values += [g, u, h, b.add(x, down, name()) if draw(st.booleans()) else b.add(down, x)]
        elif kind == "qkv":
            fmt = draw(st.sampled_from(FORMATS))
            values += [qlinear(x, None, fmt) for _ in range(draw(st.integers(2, 3)))]
        elif kind == "qlinear":
            values.append(qlinear(x))
        elif kind == "silu":
            values.append(b.silu(x, name()))
        else:
            y = draw(st.sampled_from([v for v in values if v.type == x.type]))
            values.append(b.mul(x, y, name()) if kind == "mul" else b.add(x, y, name()))
    outs = draw(st.sets(st.sampled_from(values[-6:]), min_size=1))
    for i, v in enumerate(sorted(outs, key=lambda v: v.name)):
        b.output(f"o{i}", v)
    return b.graph


def both(graph: Graph, pipeline: str | tuple[str, ...], tier: str) -> None:
    options = PassOptions(weight_quantization=tier)
    with restarting():
        want, want_records = run_pipeline(graph, pipeline, options=options)
    got, got_records = run_pipeline(graph, pipeline, options=options)
    assert print_graph(got) == print_graph(want)
    assert [(r.name, r.matches) for r in got_records] == [(r.name, r.matches) for r in want_records]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=graphs(),
    pipeline=st.sampled_from(("default", "default", *((p,) for p in PASSES))),
    tier=st.sampled_from(("declared", "w4a4", "w4a16")),
)
def test_every_pass_and_the_pipeline_match_the_restarting_driver(
    graph: Graph, pipeline: str | tuple[str, ...], tier: str
):
    options = PassOptions(weight_quantization=tier)
    with restarting():
        want, want_records = run_pipeline(graph, pipeline, options=options)
    got, got_records = run_pipeline(graph, pipeline, options=options)
    assert print_graph(got) == print_graph(want)
    assert [(r.name, r.matches) for r in got_records] == [(r.name, r.matches) for r in want_records]


def layers(n: int, fmt: WeightFormat, rule: dict[str, float]) -> Graph:
    """n decoder layers without attention (q stands in for its output): q/k/v read h, the MLP
    reads q and adds it back."""
    b = Builder("layers")
    h = b.input("x", ("M", 128), BF16)
    for i in range(n):

        def w(proj: str, out: int, k: int, i: int = i) -> Value:
            return b.weight(f"layers.{i}.{proj}", QWeight(fmt, out, k), f"w{i}_{proj}", rule)

        q = b.qlinear(h, w("q", 128, 128), f"q{i}")
        b.output(f"k{i}", b.qlinear(h, w("k", 64, 128), f"k{i}"))
        b.output(f"v{i}", b.qlinear(h, w("v", 64, 128), f"v{i}"))
        gate = b.qlinear(q, w("gate", 256, 128), f"gate{i}")
        up = b.qlinear(q, w("up", 256, 128), f"up{i}")
        prod = b.mul(b.silu(gate, f"act{i}"), up, f"prod{i}")
        h = b.add(q, b.qlinear(prod, w("down", 128, 256), f"down{i}"), f"h{i + 1}")
    b.output("y", h)
    return b.graph


@pytest.mark.parametrize(
    ("fmt", "rule", "a4"),
    [
        (MlxAffine(4, 64, BF16), {}, False),
        (Nvfp4("div", 4), {"input_global_scale": 2688.0}, True),
    ],
    ids=["w4a16", "w4a4"],
)
def test_200_layers_come_out_as_one_layer_200_times(fmt: WeightFormat, rule, a4: bool):
    n = 200
    after, records = run_pipeline(layers(n, fmt, rule), "default")
    ops = Counter(node.op for _, node in after.items())
    # per layer: q/k/v one launch (3 gets), gate/up with silu * up as epilogue, down with the
    # residual as epilogue; W4A4: the layer input, q and the gate/up product quantized once each
    assert ops == {
        "input": 1,
        "weight": 6 * n,
        "qlinear": 3 * n,
        "get": 3 * n,
        **({"quantize_act": 3 * n} if a4 else {}),
    }
    matches = {r.name: r.matches for r in records}
    assert matches["merge_parallel"] == 2 * n and matches["silu_epilogue"] == n
    assert matches["residual_epilogue"] == n and matches["route_w4a4"] == (3 * n if a4 else 0)
    for i in (0, n // 2, n - 1):
        gate_up, down = after.node(f"prod{i}"), after.node(f"h{i + 1}")
        assert gate_up.attr("epilogue") == "silu_mul" and down.attr("epilogue") == "residual"
        assert after.operands(f"h{i + 1}")[-1] == f"q{i}"
        assert after.node(f"q{i}").op == "get" and f"q{i}_k{i}_v{i}" in after
        x = after.operands(f"q{i}_k{i}_v{i}")[0]
        assert after.node(x).op == ("quantize_act" if a4 else "input" if i == 0 else "qlinear")
    assert after.outputs[-1] == ("y", f"h{n}")
    plan = lower(after)
    # A qlinear runs the GEMV, then the GEMM by tile bucket (to 64 rows, then 128-row tiles);
    # W4A4's GEMM above 64 rows is a 16-bit twin; quantize_act runs only below
    assert len(plan.launches) == (12 * n if a4 else 9 * n)
    assert sum(la.runs_for(1) for la in plan.launches) == (6 * n if a4 else 3 * n)
    assert sum(la.runs_for(128) for la in plan.launches) == 3 * n
    # every layer lowers to the same few kernels, rendered once each and shared
    assert len({id(la.kernel) for la in plan.launches}) == len(
        {la.kernel.name for la in plan.launches}
    )


# Toy rules (not numerics-preserving; only the driver is under test) whose rewrites make other
# nodes match, earlier ones included: `mul %a, %a` becomes `silu %a`, which can give %a a
# second silu user, which the CSE rule (rooted at %a, reading its users) then folds.
def _square_to_silu(rw: Rewriter, m: Match) -> bool:
    (a, _) = rw.graph.operands(m.root)
    rw.redefine(m.root, Node("silu", rw.graph.node(m.root).type), [a])
    return True


def _has_two_silus(graph: Graph, value: str) -> bool:
    return sum(graph.node(u).op == "silu" for u in graph.users(value)) >= 2


def _cse_silu(rw: Rewriter, m: Match) -> bool:
    first, second = [u for u in rw.graph.users(m.root) if rw.graph.node(u).op == "silu"][:2]
    rw.replace(second, first)
    return True


def _double_silu(rw: Rewriter, m: Match) -> bool:
    rw.redefine(m.root, rw.graph.node(m.root), [m["v"]])
    return True


TOY_RULES = (
    Rule("square", Pat("mul", (Pat(name="a"), Pat(name="a"))), _square_to_silu),
    Rule("cse_silu", Pat(check=_has_two_silus), _cse_silu),
    Rule("silu_silu", Pat("silu", (Pat("silu", (Pat(name="v"),), one_use=True),)), _double_silu),
)


@st.composite
def toy_graphs(draw: st.DrawFn) -> Graph:
    b = Builder("toy")
    values = [b.input(f"x{i}", ("M", 64), F16) for i in range(draw(st.integers(1, 2)))]
    for i in range(draw(st.integers(1, 12))):
        a, c = draw(st.sampled_from(values)), draw(st.sampled_from(values))
        op = draw(st.sampled_from(("silu", "mul", "square", "add")))
        if op == "silu":
            values.append(b.silu(a, f"s{i}"))
        elif op == "square":
            values.append(b.mul(a, a, f"m{i}"))
        else:
            values.append(b.mul(a, c, f"m{i}") if op == "mul" else b.add(a, c, f"a{i}"))
    for i, v in enumerate(draw(st.sets(st.sampled_from(values[-4:]), min_size=1))):
        b.output(f"o{i}", v)
    return b.graph


@settings(max_examples=80, deadline=None)
@given(graph=toy_graphs())
def test_rewrites_that_enable_matches_elsewhere_reach_the_same_fixpoint(graph: Graph):
    want, got = graph.copy(), graph.copy()
    assert apply_rules(got, TOY_RULES) == restarting_driver.apply_rules(want, TOY_RULES)
    assert print_graph(got) == print_graph(want)


def test_rules_that_never_settle_are_stopped():
    b = Builder("t")
    b.output("y", b.silu(b.input("x", ("M", 64), F16)))
    again = Rule(
        "again",
        Pat("silu"),
        lambda rw, m: rw.redefine(m.root, rw.graph.node(m.root), rw.graph.operands(m.root)) is None,
    )
    with pytest.raises(RuntimeError, match="did not reach a fixpoint"):
        apply_rules(b.graph, [again])
