"""Mixtures of experts in the IR: the routing rules, stacked expert weights, the expert qlinear's
type rules and its interpreter semantics against a plain per-token reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

import qir
from qir import interpret, moe, parse, print_graph
from qir.builder import Builder
from qir.dtypes import F16, F32, I32
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4, quantize_activation_nvfp4
from qir.interpret import BindError, evaluate
from qir.ops import IRTypeError
from qir.types import QExperts, QWeight
from qir.verify import VerifyError
from tests.conftest import FMT4
from tests.moe_common import inputs, moe_graph, random_experts


def _route_by_hand(row: list[float], k: int, rule: str) -> tuple[list[int], list[float]]:
    """One row in float64, written out: the ids by (value descending, id ascending)."""
    order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]
    if rule == "sigmoid_topk":
        return order, [1 / (1 + math.exp(-row[e])) for e in order]
    if rule == "topk_softmax":
        top = [math.exp(row[e] - row[order[0]]) for e in order]
        return order, [t / sum(top) for t in top]
    probs = [math.exp(v - max(row)) for v in row]
    total = sum(probs[e] for e in order) if rule == "softmax_topk_norm" else sum(probs)
    return order, [probs[e] / total for e in order]


@pytest.mark.parametrize("rule", moe.RULES)
@pytest.mark.parametrize(("experts", "k"), [(8, 2), (5, 1), (6, 6), (12, 4)])
def test_route_follows_each_rule(rng, rule, experts, k):
    logits = rng.standard_normal((9, experts)).astype(np.float32) * 3
    ids, weights = moe.route(logits, k, rule)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    for m, row in enumerate(logits.tolist()):
        want_ids, want_w = _route_by_hand(row, k, rule)
        assert ids[m].tolist() == want_ids
        np.testing.assert_allclose(weights[m], want_w, rtol=2e-6)
    if rule not in ("softmax_topk", "sigmoid_topk"):
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_route_breaks_ties_to_the_lower_expert_id():
    # torch.topk on these rows (softmax probabilities of equal logits are equal) returns the
    # lower index first; so does the rule's selection on the logits.
    logits = np.array([[1, 3, 3, 0, 3], [2, 2, 2, 2, 2], [-1, 5, 5, 4, 4]], np.float32)
    ids, _ = moe.route(logits, 3, "softmax_topk_norm")
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 2, 3]]


def test_stacked_experts_print_parse_and_verify(rng):
    g, _ = moe_graph(rng, 64, 128, 5, 2, FMT4)
    text = print_graph(g)
    assert "experts<5, qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>[128, 64]>" in text
    assert '%route = route %logits {k=2, rule="softmax_topk_norm"} : (i32[M, 2], f32[M, 2])' in text
    assert (
        "%y = expert_qlinear %h, %w_down, %route.ids, %route.weights, %x "
        '{epilogue="combine_residual"} : f16[M, 64]' in text
    )
    again = parse(text)
    assert print_graph(again) == text
    assert again.node("w_gate").type == QExperts(QWeight(FMT4, 128, 64), 5)
    assert again.node("h").type.shape == ("M", 2, 128)


def _graph_with(build) -> None:
    b = Builder()
    x = b.input("x", ("M", 64), F16)
    logits = b.input("logits", ("M", 6), F16)
    we = b.weight("e", QExperts(QWeight(FMT4, 32, 64), 6), name="w_e")
    build(b, x, logits, we)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda b, x, lg, we: b.route(lg, 7, "softmax_topk"), r"k=7 .* in 1\.\.6"),
        (lambda b, x, lg, we: b.route(lg, 0, "softmax_topk"), r"k=0 .* in 1\.\.6"),
        (lambda b, x, lg, we: b.route(lg, 2, "sparsemixer"), "unknown rule 'sparsemixer'"),
        (
            lambda b, x, lg, we: b.expert_qlinear(x, we, b.route(lg, 2, "softmax_topk")[1]),
            r"operand 2 .*f32\[M, 2\]\) must be i32\[M, k\]",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                x,
                (we, b.weight("u", QExperts(QWeight(FMT4, 48, 64), 6))),
                b.route(lg, 2, "softmax_topk")[0],
            ),
            r"experts %w_e: .*\[32, 64\]> and %w\d: .*\[48, 64\]> differ",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                x,
                (we, b.weight("u", QExperts(QWeight(MlxAffine(8, 64, F16), 32, 64), 6))),
                b.route(lg, 2, "softmax_topk")[0],
            ),
            "one launch takes one format",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                x,
                (we, b.weight("u", QExperts(QWeight(FMT4, 32, 64), 4))),
                b.route(lg, 2, "softmax_topk")[0],
            ),
            "differ",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                b.input("x2", ("M", 128), F16), we, b.route(lg, 2, "softmax_topk")[0]
            ),
            r"has 128 features but experts %w_e.* in_features 64",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                x, we, b.route(lg, 2, "softmax_topk")[0], b.input("rw", ("M", 3), F32)
            ),
            r"must be the router's weights f32\[M, 2\]",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                b.input("h", ("M", 64), F16),
                we,
                b.route(lg, 2, "softmax_topk")[0],
                b.route(lg, 2, "softmax_topk", name="r2")[1],
                b.input("r", ("M", 64), F16),
            ),
            r"combine_residual: %r: f16\[M, 64\] does not match the result f16\[M, 32\]",
        ),
        (
            lambda b, x, lg, we: b.qlinear(x, we),
            r"operand 1 \(%w_e: experts<6, .*\) must be a weight",
        ),
        (  # gpt-oss's clamped SwiGLU needs its limit (and alpha)
            lambda b, x, lg, we: b.expert_qlinear(
                x, (we, we), b.route(lg, 2, "topk_softmax")[0], act={"act": "swiglu_clamp"}
            ),
            "limit goes with act swiglu_clamp",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                x,
                (we, we),
                b.route(lg, 2, "topk_softmax")[0],
                act={"act": "swiglu_clamp", "limit": -7.0, "alpha": 1.702},
            ),
            "limit must be a positive float, got -7.0",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                x, (we, we), b.route(lg, 2, "topk_softmax")[0], act={"limit": 7.0}
            ),
            "limit goes with act swiglu_clamp",
        ),
        (
            lambda b, x, lg, we: b.expert_qlinear(
                x, (we, we), b.route(lg, 2, "topk_softmax")[0], act={"act": "relu"}
            ),
            "act 'relu' needs epilogue silu_mul and one of silu, gelu_tanh, swiglu_clamp",
        ),
    ],
)
def test_moe_ops_refuse_bad_operands_naming_them(build, message):
    with pytest.raises(IRTypeError, match=message):
        _graph_with(build)


SLOTS = """
graph t {
  %x = input : f16[M, 64]
  %lg = input : f16[M, 6]
  %w = weight {key="e"} : experts<6, qweight<WFMT>[32, 64]>
  %w2 = weight {key="d"} : experts<6, qweight<WFMT>[16, 32]>
  %r = route %lg {k=2, rule="softmax_topk"} : (i32[M, 2], f32[M, 2])
  %r3 = route %lg {k=3, rule="softmax_topk"} : (i32[M, 3], f32[M, 3])
  %ids = get %r {index=0} : i32[M, 2]
  %ids3 = get %r3 {index=0} : i32[M, 3]
  %h = expert_qlinear %x, %w, %ids : f16[M, 2, 32]
  %y = expert_qlinear %h, %w2, IDS : f16[M, 2, 16]
  output y = %y
}
""".replace("WFMT", "mlx_affine<bits=4,group_size=64,scale_dtype=bf16>")


def test_an_input_of_one_row_per_slot_needs_the_ids_k():
    assert parse(SLOTS.replace("IDS", "%ids")).node("y").type.shape == ("M", 2, 16)
    with pytest.raises(VerifyError, match=r"has a row per slot but ids %ids3: i32\[M, 3\]"):
        parse(SLOTS.replace("IDS", "%ids3"))


def _by_hand(x, dequant, ids, rw) -> np.ndarray:
    """y = x + sum_j rw * down_e(silu(gate_e(x)) * up_e(x)) per token, float64."""
    g, u, d = (dequant[n].astype(np.float64) for n in ("gate", "up", "down"))
    out = x.astype(np.float64).copy()
    for m in range(x.shape[0]):
        for j, e in enumerate(ids[m]):
            a = x[m].astype(np.float64) @ g[e].T
            h = a / (1 + np.exp(-a)) * (x[m].astype(np.float64) @ u[e].T)
            out[m] += rw[m, j] * (h @ d[e].T)
    return out


@pytest.mark.parametrize(
    ("fmt", "rule"), [(FMT4, "softmax_topk_norm"), (Nvfp4("div", 16), "topk_softmax")]
)
def test_interpreter_moe_matches_a_per_token_reference(rng, fmt, rule):
    g, w = moe_graph(rng, 64, 128, 6, 2, fmt, act=F32, rule=rule, router_scale=4.0)
    x = inputs(rng, 11, 64, F32)
    env = evaluate(g, x, w)
    ids, rw = moe.route(env["logits"], 2, rule)
    np.testing.assert_array_equal(env["route.ids"], ids)
    np.testing.assert_array_equal(env["route.weights"], rw)
    assert len(np.unique(ids)) >= 4  # several experts chosen, so the gather is exercised
    dequant = {n: env[f"w_{n}"] for n in ("gate", "up", "down")}
    want = _by_hand(x["x"], dequant, ids, rw)
    np.testing.assert_allclose(env["y"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Each stacked expert dequantizes as that expert alone would.
    one = {n: buf[3] for n, buf in w["gate"].items()}
    np.testing.assert_array_equal(dequant["gate"][3], fmt.dequantize(one, 128, 64))


def test_f16_rounds_each_slot_then_combines_in_float32(rng):
    g, w = moe_graph(rng, 64, 128, 4, 3, FMT4, act=F16)
    env = evaluate(g, inputs(rng, 5, 64), w)
    ids, rw = env["route.ids"], env["route.weights"]
    slots = moe.expert_matmul(moe.per_slot(env["h"], 3), env["w_down"], ids).astype(np.float16)
    c = np.zeros((5, 64), np.float32)
    for j in range(3):
        c = c + rw[:, j, None] * slots[:, j].astype(np.float32)
    want = (env["x"].astype(np.float32) + c.astype(np.float16).astype(np.float32)).astype(
        np.float16
    )
    np.testing.assert_array_equal(env["y"], want)


def test_bad_expert_buffers_and_ids_name_the_weight(rng):
    g, w = moe_graph(rng, 64, 128, 4, 2, FMT4)
    x = inputs(rng, 2, 64)
    short = {**w, "down": {n: b[:3] for n, b in w["down"].items()}}
    with pytest.raises(BindError, match=r"weight 'down': buffer 'weight' is uint32 \[3, 64, 16\]"):
        interpret(g, x, short)
    nan = {**w, "up": {**w["up"], "scales": w["up"]["scales"].copy()}}
    nan["up"]["scales"][2, 5, 0] = np.nan
    with pytest.raises(Exception, match=r"up\[2\]\.scales: contains NaN"):
        interpret(g, x, nan)


def test_expert_ids_outside_the_experts_are_refused(rng):
    b = Builder()
    x = b.input("x", ("M", 64), F16)
    ids = b.input("ids", ("M", 2), I32)
    qe, bufs = random_experts(rng, 3, 32, 64, FMT4)
    y = b.expert_qlinear(x, b.weight("e", qe), ids)
    b.output("y", y)
    feed = {"x": np.zeros((1, 64), np.float16), "ids": np.array([[0, 3]], np.int32)}
    with pytest.raises(BindError, match=r"expert ids 0\.\.3 are outside the 3 experts"):
        interpret(b.graph, feed, {"e": bufs})


def test_clamped_swiglu_experts_with_biases_match_a_per_token_reference(rng):
    """gpt-oss's expert MLP in float64 by hand: each chosen expert's gate and up plus their
    biases, min(g, L) * sigmoid(alpha min(g, L)) * (clamp(u, -L, L) + 1), down plus its bias,
    combined; against the interpreter (float32). The limit clamps some gates and ups."""
    limit, alpha = 0.5, 1.702
    b = Builder("gptoss")
    x = b.input("x", ("M", 64), F32)
    ids = b.input("ids", ("M", 2), I32)
    rw = b.input("rw", ("M", 2), F32)
    weights, ws, w64, b64 = {}, {}, {}, {}
    for name, (o, i) in {"gate": (64, 64), "up": (64, 64), "down": (64, 64)}.items():
        _, bufs = random_experts(rng, 5, o, i, FMT4)
        bufs["bias"] = rng.standard_normal((5, o)).astype(np.float32) * 0.3
        weights[name] = bufs
        biased = QExperts(QWeight(FMT4, o, i, bias=True), 5)
        ws[name] = b.weight(name, biased, name=f"w_{name}")
        w64[name] = np.stack(
            [
                FMT4.dequantize({k: v[e] for k, v in bufs.items() if k != "bias"}, o, i)
                for e in range(5)
            ]
        ).astype(np.float64)
        b64[name] = bufs["bias"].astype(np.float64)
    act = {"act": "swiglu_clamp", "limit": limit, "alpha": alpha}
    h = b.expert_qlinear(x, (ws["gate"], ws["up"]), ids, name="h", act=act)
    b.output("y", b.expert_qlinear(h, ws["down"], ids, rw, name="y"))
    assert 'act="swiglu_clamp"' in print_graph(b.graph)
    assert print_graph(parse(print_graph(b.graph))) == print_graph(b.graph)
    feed = {
        "x": rng.standard_normal((7, 64)).astype(np.float32),
        "ids": rng.integers(0, 5, (7, 2)).astype(np.int32),
        "rw": rng.random((7, 2)).astype(np.float32),
    }
    ours = interpret(b.graph, feed, weights)["y"]
    want = np.zeros((7, 64))
    clamped = 0
    for m in range(7):
        xm = feed["x"][m].astype(np.float64)
        for j, e in enumerate(feed["ids"][m]):
            g = w64["gate"][e] @ xm + b64["gate"][e]
            u = w64["up"][e] @ xm + b64["up"][e]
            clamped += int((g > limit).sum() + (np.abs(u) > limit).sum())
            g = np.minimum(g, limit)
            hm = g / (1 + np.exp(-alpha * g)) * (np.clip(u, -limit, limit) + 1)
            want[m] += feed["rw"][m, j] * (w64["down"][e] @ hm + b64["down"][e])
    assert clamped > 100
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _normed(
    extra: str = "",
    attrs: str = 'eps=1e-05, prologue="rms_norm"',
    result: str = "f16[M, 2, 32]",
    nw: int = 64,
    inputs: str = "%x, %nw",
) -> str:
    fmt = "mlx_affine<bits=4,group_size=64,scale_dtype=bf16>"
    return f"""
graph t {{
  %x = input : f16[M, 64]
  %lg = input : f16[M, 6]
  %nw = weight {{key="norm"}} : bf16[{nw}]
  %w = weight {{key="e"}} : experts<6, qweight<{fmt}>[32, 64]>
  %r = route %lg {{k=2, rule="softmax_topk"}} : (i32[M, 2], f32[M, 2])
  %ids = get %r {{index=0}} : i32[M, 2]
  %rw = get %r {{index=1}} : f32[M, 2]
  %h = expert_qlinear {inputs}, %w, %ids{extra} {{{attrs}}} : {result}
  output y = %h
}}
"""


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {
                "extra": ", %rw",
                "attrs": 'epilogue="combine", eps=1e-05, prologue="rms_norm"',
                "result": "f16[M, 32]",
            },
            "the rms_norm prologue takes no combine epilogue",
        ),
        (
            {"attrs": 'eps=1e-05, prologue="silu_mul"'},
            "unknown prologue 'silu_mul'",
        ),
        ({"nw": 32}, "an rms_norm prologue normalises whole rows"),
        ({"inputs": "%x", "attrs": "eps=1e-05"}, "eps is the rms_norm prologue's"),
    ],
)
def test_the_experts_norm_prologue_is_verified(changes, message):
    """x and the norm's weight before the experts (prologue rms_norm, eps); refused in one line
    with a combine, another prologue, a norm of groups, or eps without the prologue."""
    assert parse(_normed()).node("h").attr("prologue") == "rms_norm"
    with pytest.raises(VerifyError, match=f"%h: expert_qlinear: {message}"):
        parse(_normed(**changes))


A4_EXPERTS = """
graph t {
  %x = input : f16[M, K]
  %ids = input : i32[M, 2]
  %w = weight {key="e"} : experts<6, qweight<WFMT>[32, K]>
  %h = expert_qlinear %x, %w, %ids ATTRS : f16[M, 2, 32]
  output h = %h
}
"""


@pytest.mark.parametrize(
    ("fmt", "k", "attrs", "message"),
    [
        ("mlx_affine<bits=4,group_size=64,scale_dtype=bf16>", 64, "", "need experts that take"),
        ("nvfp4<scale_mode=div,act_bits=4>", 48, "", r"need K % 64 == 0, got 48"),
        (
            "nvfp4<scale_mode=div,act_bits=4>",
            64,
            ", input_global_scale=2.0",
            r"unknown attributes \['input_global_scale'\]",
        ),
        ("nvfp4<scale_mode=div,act_bits=4>", 64, ', act_quant="mxfp4"', "unknown activation"),
    ],
)
def test_w4a4_experts_refuse_what_their_kernels_cannot_take(fmt, k, attrs, message):
    text = A4_EXPERTS.replace("WFMT", fmt).replace("K]", f"{k}]")
    quant = attrs if "act_quant" in attrs else f', act_quant="nvfp4"{attrs}'
    with pytest.raises(VerifyError, match=message):
        parse(text.replace("ATTRS", "{" + quant.lstrip(", ") + "}"))


def _a4_experts(rng, mode: str, act_bits: int = 4):
    """gate/up and down W4A4 experts whose calibrated input scales differ per expert (gate's
    and up's the same, as the producers calibrate them on one input)."""
    g, w = moe_graph(rng, 64, 128, 6, 2, Nvfp4(mode, act_bits), act=F32, router_scale=4.0)
    if act_bits == 4:
        spread = np.array([1.0, 4.0, 0.25, 2.0, 0.5, 8.0], np.float32)[:, None]
        for n in ("gate", "down"):
            w[n]["input_scale"] = w[n]["input_scale"] * (spread if mode == "mul" else 1 / spread)
        w["up"]["input_scale"] = w["gate"]["input_scale"].copy()
    return g, w


@pytest.mark.parametrize(("mode", "act_bits"), [("mul", 4), ("div", 4), ("div", 16)])
def test_w4a4_experts_quantize_each_slot_under_its_experts_scale(rng, mode, act_bits):
    """Each (token, expert) pair's input quantized as that expert module's input quantizer
    does in the producer (its own calibrated scale; a per-row one where it has none), for
    gate/up (x) and down (h, a row per slot); by hand, per token."""
    from qir.passes.manager import PassOptions, run_pipeline

    g, w = _a4_experts(rng, mode, act_bits)
    routed, _ = run_pipeline(g, options=PassOptions(weight_quantization="w4a4"))
    assert [routed.node(n).attr("act_quant") for n in ("h", "y")] == ["nvfp4", "nvfp4"]
    x = inputs(rng, 9, 64, F32)
    env = evaluate(routed, x, w)
    ids, rw = env["route.ids"], env["route.weights"]
    assert len(np.unique(ids)) >= 4
    fmt = Nvfp4(mode, act_bits)

    def quantized(v, name, e):
        if act_bits == 16:  # per row: 2688 / amax
            return quantize_activation_nvfp4(v)
        return fmt.quantize_activation(v, {"input_scale": w[name]["input_scale"][e]})

    deq = {n: env[f"w_{n}"] for n in ("gate", "up", "down")}
    want = x["x"].astype(np.float32).copy()
    for m in range(9):
        for j, e in enumerate(ids[m]):
            xq = quantized(x["x"][m], "gate", e)
            a, u = xq @ deq["gate"][e].T, xq @ deq["up"][e].T
            h = (a / (1 + np.exp(-a)) * u).astype(np.float32)
            np.testing.assert_allclose(env["h"][m, j], h, rtol=1e-5, atol=1e-6)
            want[m] += rw[m, j] * (quantized(env["h"][m, j], "down", e) @ deq["down"][e].T)
    np.testing.assert_allclose(env["y"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if act_bits == 4:  # every expert's own scale matters: expert 0's for all differs
        one = {n: dict(b) for n, b in w.items()}
        for n in ("gate", "up", "down"):
            one[n]["input_scale"] = np.repeat(w[n]["input_scale"][:1], 6, axis=0)
        assert np.abs(evaluate(routed, x, one)["y"] - env["y"]).max() > 1e-3


def test_a_w4a4_gate_up_pair_needs_one_input_scale_per_expert(rng):
    from qir.passes.manager import PassOptions, run_pipeline

    g, w = _a4_experts(rng, "mul")
    w["up"]["input_scale"] = w["up"]["input_scale"] * 2
    routed, _ = run_pipeline(g, options=PassOptions(weight_quantization="declared"))
    message = r"%h: W4A4 experts %w_gate and %w_up differ in input_scale \(expert 0: "
    with pytest.raises(BindError, match=message):
        evaluate(routed, inputs(rng, 2, 64, F32), w)
    with pytest.raises(BindError, match=message):  # the kernels too, when bound
        qir.compile(g, w, backend="host")
    w16 = qir.compile(g, w, backend="host", weight_quantization="w4a16")  # 16-bit: no matter
    assert w16.plan is not None
