"""W4A4 routing and shared activation quantization: IR, must-not-fire, counters, numbers."""

from __future__ import annotations

import numpy as np
import pytest

from qir import interpret, parse, print_graph
from qir.dtypes import F16, F32
from qir.models import load
from qir.models.blocks import build
from qir.passes.manager import PASSES, PIPELINES, PassOptions, run_pipeline
from tests.conftest import DATA, rel_err

A4 = "qweight<nvfp4<scale_mode=div,act_bits=4>>"
A16 = "qweight<nvfp4<scale_mode=div,act_bits=16>>"
W4 = "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>"

QKV = """
graph qkv {{
  %x = input : f16[M, 128]
  %wq = weight {{input_global_scale=588.0, key="q"}} : {w}[128, 128]
  %wk = weight {{input_global_scale=588.0, key="k"}} : {w}[64, 128]
  %q = qlinear %x, %wq : f16[M, 128]
  %k = qlinear %x, %wk : f16[M, 64]
  output q = %q
  output k = %k
}}
"""


def route(text: str, tier: str = "declared") -> tuple[str, int]:
    g = parse(text)
    fired = PASSES["route_w4a4"](PassOptions(weight_quantization=tier)).run(g)
    return print_graph(g), fired


def test_route_inserts_quantize_act_with_the_calibrated_scale():
    after, fired = route(QKV.format(w=A4))
    assert fired == 2
    assert (
        '%x_q = quantize_act %x {input_global_scale=588.0, scheme="nvfp4"} : qact<nvfp4, f16[M, 128]>'
        in after
    )
    assert "%q = qlinear %x_q, %wq" in after
    assert "%k = qlinear %x_q.1, %wk" in after


def test_share_act_quant_makes_one_quantization_of_a_shared_input():
    routed, _ = route(QKV.format(w=A4))
    g = parse(routed)
    assert PASSES["share_act_quant"](PassOptions()).run(g) == 1
    text = print_graph(g)
    assert text.count("quantize_act") == 1
    assert "%k = qlinear %x_q, %wk" in text


def test_share_act_quant_keeps_different_rules_apart():
    text = QKV.format(w=A4).replace(
        'input_global_scale=588.0, key="k"', 'input_global_scale=600.0, key="k"'
    )
    routed, _ = route(text)
    g = parse(routed)
    assert PASSES["share_act_quant"](PassOptions()).run(g) == 0
    assert print_graph(g).count("quantize_act") == 2


@pytest.mark.parametrize(
    ("weight", "tier", "fires"),
    [
        (A16, "declared", 0),  # W4A16 checkpoint: declared keeps 16-bit
        (A4, "w4a16", 0),
        (W4, "w4a4", 0),  # an MLX weight cannot take NVFP4 activations
        (A16, "w4a4", 2),  # forced: per-row scale
    ],
)
def test_route_tiers(weight, tier, fires):
    text = QKV.format(w=weight)
    if weight != A4:
        text = text.replace("input_global_scale=588.0, ", "")
    after, fired = route(text, tier)
    assert fired == fires
    if tier == "w4a4" and fires:
        assert '%x_q = quantize_act %x {scheme="nvfp4"}' in after


def test_route_does_not_fire_when_k_is_not_a_multiple_of_64():
    text = QKV.format(w=A4).replace("[M, 128]\n  %wq", "[M, 96]\n  %wq")
    text = text.replace("[128, 128]", "[128, 96]").replace("[64, 128]", "[64, 96]")
    _, fired = route(text)
    assert fired == 0


def test_unknown_tier_is_rejected():
    with pytest.raises(ValueError, match=r"unknown --weight-quantization .w2a2."):
        run_pipeline(parse(QKV.format(w=A4)), options=PassOptions(weight_quantization="w2a2"))


W4A4_FIXTURES = ("ct_nvfp4_w4a4_S", "modelopt_nvfp4_S")


@pytest.mark.parametrize("fixture", W4A4_FIXTURES)
def test_declared_mlp_quantizes_the_block_input_and_the_gated_product_once_each(fixture):
    b = build(load(DATA / fixture), "mlp", 0, F16)
    g, records = run_pipeline(b.graph)
    assert {r.name: r.matches for r in records}["route_w4a4"] == 2
    text = print_graph(g)
    assert text.count("= quantize_act %x") == 1 and text.count("= quantize_act %h") == 1
    assert '%h = qlinear %x_q, %w_gate, %w_up {epilogue="silu_mul"' in text
    assert "%y = qlinear %h_q, %w_down, %x" in text
    assert "act_quant" not in text and "prologue" not in text


@pytest.mark.parametrize("fixture", W4A4_FIXTURES)
def test_declared_mlp_prologue_fallback_quantizes_in_down_proj(fixture):
    """Without the gate/up pair (gate and up not merged), down_proj computes silu(g)*u in its
    prologue and route_w4a4 has it quantize there: no launch for the product."""
    b = build(load(DATA / fixture), "mlp", 0, F16)
    passes = [p for p in PIPELINES["default"] if p != "silu_epilogue"]
    g, records = run_pipeline(b.graph, passes)
    assert {r.name: r.matches for r in records}["route_w4a4"] == 2
    text = print_graph(g)
    assert text.count("= quantize_act") == 1
    assert "%gate_up = qlinear %x_q, %w_gate, %w_up" in text
    assert 'act_quant="nvfp4"' in text and 'prologue="silu_mul"' in text


GOLDEN = {"y": "mlp", "q": "q", "k": "k", "v": "v"}


@pytest.mark.parametrize("fixture", W4A4_FIXTURES)
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_tiers_match_the_tools_fake_quantized_and_plain_goldens(fixture, block):
    golden = np.load(DATA / fixture / "golden.npz")
    b = build(load(DATA / fixture), block, 0, F16)
    declared, _ = run_pipeline(b.graph, options=PassOptions(weight_quantization="declared"))
    w4a16, _ = run_pipeline(b.graph, options=PassOptions(weight_quantization="w4a16"))
    for m in (1, 5, 40):
        x = {"x": golden[f"x.M{m}"]}
        a4, a16 = interpret(declared, x, b.weights), interpret(w4a16, x, b.weights)
        for name in a4:
            key = GOLDEN[name]
            assert rel_err(a4[name], golden[f"{key}_a4.0.M{m}"]) <= 1e-2
            assert rel_err(a16[name], golden[f"{key}.0.M{m}"]) <= 1e-2
            # and the two really differ: W4A4 is not W4A16 under another name
            assert rel_err(a4[name], golden[f"{key}.0.M{m}"]) > 2 * rel_err(
                a4[name], golden[f"{key}_a4.0.M{m}"]
            )


def test_mlp_branch_under_w4a4_matches_the_tools():
    """The tools quantize down_proj's input from float32 silu(gate) * up; with f32 activations
    so do we (f16 rounding before quantization flips E2M1 codes: ~1.2% on this branch)."""
    golden = np.load(DATA / "ct_nvfp4_w4a4_S" / "golden.npz")
    b = build(load(DATA / "ct_nvfp4_w4a4_S"), "mlp", 0, F32)
    b.graph.outputs.append(("branch", "down"))
    g, _ = run_pipeline(b.graph)
    out = interpret(g, {"x": golden["x.M5"].astype(np.float32)}, b.weights)
    assert rel_err(out["branch"], golden["mlpd_a4.0.M5"]) <= 1e-2


def test_above_64_rows_w4a4_nodes_run_16_bit():
    b = build(load(DATA / "ct_nvfp4_w4a4_S"), "qkv", 0, F16)
    declared, _ = run_pipeline(b.graph)
    w4a16, _ = run_pipeline(b.graph, options=PassOptions(weight_quantization="w4a16"))
    x = {"x": np.random.default_rng(0).standard_normal((65, 256)).astype(np.float16)}
    a4, a16 = interpret(declared, x, b.weights), interpret(w4a16, x, b.weights)
    for k in a4:
        np.testing.assert_array_equal(a4[k], a16[k])


def test_weights_calibrated_for_different_activation_scales_are_not_merged():
    text = QKV.format(w=A4).replace(
        'input_global_scale=588.0, key="k"', 'input_global_scale=600.0, key="k"'
    )
    g, records = run_pipeline(parse(text))
    assert {r.name: r.matches for r in records}["merge_parallel"] == 0
    # each keeps its own calibrated quantization of x
    assert print_graph(g).count("= quantize_act %x") == 2


def test_verifier_rejects_4_bit_activations_for_weights_that_cannot_take_them():
    text = f"""
    graph t {{
      %x = input : f16[M, 128]
      %w = weight {{key="w"}} : {W4}[64, 128]
      %xq = quantize_act %x {{scheme="nvfp4"}} : qact<nvfp4, f16[M, 128]>
      %y = qlinear %xq, %w : f16[M, 64]
      output y = %y
    }}
    """
    with pytest.raises(ValueError, match="nvfp4 activations need weights that take them"):
        parse(text)


EXPERTS = """
graph moe {{
  %x = input : f16[M, 64]
  %ids = input : i32[M, 2]
  %rw = input : f32[M, 2]
  %wg = weight {{key="g"}} : experts<4, {w}[32, 64]>
  %wu = weight {{key="u"}} : experts<4, {w}[32, 64]>
  %wd = weight {{key="d"}} : experts<4, {w}[64, 32]>
  %h = expert_qlinear %x, %wg, %wu, %ids {{epilogue="silu_mul"}} : f16[M, 2, 32]
  %y = expert_qlinear %h, %wd, %ids, %rw, %x {{epilogue="combine_residual"}} : f16[M, 64]
  output y = %y
}}
"""


@pytest.mark.parametrize(
    ("w", "tier", "fired"),
    [
        (A4, "declared", 1),
        (A4, "w4a4", 1),
        (A16, "w4a4", 1),
        (A16, "declared", 0),
        (A4, "w4a16", 0),
    ],
)
def test_route_marks_experts_w4a4_by_tier(w, tier, fired):
    """Experts quantize in their own kernel (each slot under its expert's scale): the routed
    node gets `act_quant`, no quantize_act; gate/up at K 64, down at K 32 (not whole 64-element
    tiles: stays 16-bit)."""
    after, count = route(EXPERTS.format(w=w), tier)
    assert count == fired
    assert "quantize_act" not in after
    routed = 'expert_qlinear %x, %wg, %wu, %ids {act_quant="nvfp4", epilogue="silu_mul"}'
    assert (routed in after) == bool(fired)
    assert 'expert_qlinear %h, %wd, %ids, %rw, %x {epilogue="combine_residual"}' in after
    again = parse(after)  # and routing is idempotent
    assert PASSES["route_w4a4"](PassOptions(weight_quantization=tier)).run(again) == 0


def test_w4a4_experts_change_the_numbers_only_up_to_64_rows():
    """The differential run: the routed graph against the 16-bit one, through the interpreter."""
    from tests.moe_common import random_experts

    rng = np.random.default_rng(0)
    text = EXPERTS.format(w=A4).replace("[64, 32]", "[64, 64]").replace("2, 32]", "2, 64]")
    text = text.replace("[32, 64]", "[64, 64]")
    g = parse(text)
    fmt = g.node("wg").type.format
    weights = {k: random_experts(rng, 4, 64, 64, fmt)[1] for k in ("g", "u", "d")}
    weights["u"]["input_scale"] = weights["g"]["input_scale"]
    routed = parse(route(text)[0])
    assert sum(routed.node(n).attr("act_quant") == "nvfp4" for n in ("h", "y")) == 2
    for m, differs in ((5, True), (65, False)):
        x = {
            "x": rng.standard_normal((m, 64)).astype(np.float16),
            "ids": rng.integers(0, 4, (m, 2)).astype(np.int32),
            "rw": np.full((m, 2), 0.5, np.float32),
        }
        a4, a16 = interpret(routed, x, weights)["y"], interpret(g, x, weights)["y"]
        assert (rel_err(a4, a16) > 1e-3) == differs, (m, rel_err(a4, a16))
        assert rel_err(a4, a16) < 0.2
