"""Fusion passes: IR before/after, must-not-fire cases, match counters, and the interpreter
before == after (bit for bit: fusion keeps the unfused rounding)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qir import interpret, parse, print_graph
from qir.builder import Builder, Value
from qir.dtypes import BF16, F16, F32
from qir.formats.mlx import MlxAffine
from qir.passes.manager import PASSES, PassOptions, run_pipeline
from qir.passes.rewrite import Pat, match
from qir.types import QWeight
from qir.verify import VerifyError
from tests.conftest import random_weight, with_bias
from tests.passes.test_layer_passes import assert_same_numbers as same_numbers

W4 = "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>"
W8 = "qweight<mlx_affine<bits=8,group_size=64,scale_dtype=bf16>>"

MLP = f"""
graph mlp {{
  %x = input : f16[M, 128]
  %w_gate = weight {{key="gate"}} : {W4}[256, 128]
  %w_up = weight {{key="up"}} : {W4}[256, 128]
  %w_down = weight {{key="down"}} : {W4}[128, 256]
  %gate = qlinear %x, %w_gate : f16[M, 256]
  %up = qlinear %x, %w_up : f16[M, 256]
  %act = silu %gate : f16[M, 256]
  %h = mul %act, %up : f16[M, 256]
  %down = qlinear %h, %w_down : f16[M, 128]
  %y = add %x, %down : f16[M, 128]
  output y = %y
}}
"""


def run_pass(text: str, name: str) -> tuple[str, int]:
    g = parse(text)
    fired = PASSES[name](PassOptions()).run(g)
    return print_graph(g), fired


def weights_for(text: str, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    g = parse(text)
    out = {}
    for w in g.weights:
        t = g.node(w).type
        qw, bufs = random_weight(rng, t.out_features, t.in_features, t.format)
        out[g.node(w).attr("key")] = with_bias(rng, qw, bufs)[1] if t.bias else bufs
    return out


def assert_same_numbers(before: str, after: str, rng: np.random.Generator, m: int = 3) -> None:
    gb, ga = parse(before), parse(after)
    w = weights_for(before, rng)
    inputs = {}
    for name in gb.inputs:
        t = gb.node(name).type
        inputs[name] = rng.standard_normal((m, t.shape[1])).astype(t.dtype.np)
    ob, oa = interpret(gb, inputs, w), interpret(ga, inputs, w)  # same signature after passes
    assert ob.keys() == oa.keys()
    for k in ob:
        np.testing.assert_array_equal(ob[k], oa[k])


def test_merge_parallel_fires_on_gate_up(rng):
    after, fired = run_pass(MLP, "merge_parallel")
    assert fired == 1
    assert (
        '%gate_up = qlinear %x, %w_gate, %w_up {fused=["gate", "up"]} : (f16[M, 256], f16[M, 256])'
        in after
    )
    assert "%gate = get %gate_up {index=0} : f16[M, 256]" in after
    assert "%up = get %gate_up {index=1} : f16[M, 256]" in after
    assert_same_numbers(MLP, after, rng)


def test_biases_ride_with_their_weights_through_every_fusion(rng):
    """q/k merged with a bias on one segment, the gate/up pair with up's bias in the silu_mul
    epilogue, down's bias before the residual: the weights carry them, so each pass fires as
    without biases and the interpreter gives the same bits before and after."""
    biased = {"up": "[256, 128]", "down": "[128, 256]"}
    text = MLP
    for key, shape in biased.items():
        text = text.replace(f'{{key="{key}"}} : {W4}{shape}', f'{{key="{key}"}} : {W4}{shape}+bias')
    text = text.replace(
        "  output y = %y",
        f"""  %wq = weight {{key="q"}} : {W4}[128, 128]+bias
  %wk = weight {{key="k"}} : {W4}[64, 128]
  %q = qlinear %y, %wq : f16[M, 128]
  %k = qlinear %y, %wk : f16[M, 64]
  output q = %q
  output k = %k""",
    )
    g, records = run_pipeline(parse(text), "default", options=PassOptions())
    fired = {r.name: r.matches for r in records if r.name != "select_kernels" and r.matches}
    assert fired == {"merge_parallel": 2, "silu_epilogue": 1, "residual_epilogue": 1}
    after = print_graph(g)
    assert f'%w_up = weight {{key="up"}} : {W4}[256, 128]+bias' in after
    assert '%h = qlinear %x, %w_gate, %w_up {epilogue="silu_mul"' in after
    assert '%y = qlinear %h, %w_down, %x {epilogue="residual"' in after
    assert "%q_k = qlinear %y, %wq, %wk {" in after
    assert_same_numbers(text, after, rng)
    # The biases move the numbers: zeroed, every output but k (no bias) changes.
    w = weights_for(text, rng)
    x = {"x": rng.standard_normal((3, 128)).astype(np.float16)}
    with_biases = interpret(g, x, w)
    for key in ("up", "down", "q"):
        w[key]["bias"][:] = 0
    zeroed = interpret(g, x, w)
    assert not np.array_equal(with_biases["q"], zeroed["q"])
    assert not np.array_equal(with_biases["k"], zeroed["k"])  # through y


def test_merge_parallel_merges_three_with_different_widths(rng):
    text = f"""
    graph qkv {{
      %x = input : bf16[M, 128]
      %wq = weight {{key="q"}} : {W4}[128, 128]
      %wk = weight {{key="k"}} : {W4}[64, 128]
      %wv = weight {{key="v"}} : {W4}[64, 128]
      %q = qlinear %x, %wq : bf16[M, 128]
      %k = qlinear %x, %wk : bf16[M, 64]
      %v = qlinear %x, %wv : bf16[M, 64]
      output q = %q
      output k = %k
      output v = %v
    }}
    """
    after, fired = run_pass(text, "merge_parallel")
    assert fired == 1
    assert "%q_k_v = qlinear %x, %wq, %wk, %wv" in after
    assert ": (bf16[M, 128], bf16[M, 64], bf16[M, 64])" in after
    assert_same_numbers(text, after, rng)


SHARED_EXPERT = MLP.replace(
    "  output y = %y",
    f"""  %w_router = weight {{key="router"}} : {W4}[6, 128]
  %w_sg = weight {{key="shared_gate"}} : {W4}[1, 128]
  %router = qlinear %x, %w_router : f16[M, 6]
  %sg = qlinear %x, %w_sg : f16[M, 1]
  output y = %y
  output router = %router
  output sg = %sg""",
)


def test_merge_parallel_keeps_a_gate_up_pair_apart_from_other_projections(rng):
    """Qwen2-MoE's router, shared expert gate and shared gate/up read one input in one format:
    the pair merges on its own (silu_epilogue then folds it) and the other two together; the
    whole pipeline gives gate/up their epilogue, not down a silu prologue."""
    after, fired = run_pass(SHARED_EXPERT, "merge_parallel")
    assert fired == 2
    assert '%gate_up = qlinear %x, %w_gate, %w_up {fused=["gate", "up"]}' in after
    assert '%router_sg = qlinear %x, %w_router, %w_sg {fused=["router", "sg"]}' in after
    assert_same_numbers(SHARED_EXPERT, after, rng)
    g, records = run_pipeline(parse(SHARED_EXPERT), "default", options=PassOptions())
    fired_all = {r.name: r.matches for r in records if r.name != "select_kernels" and r.matches}
    assert fired_all == {"merge_parallel": 2, "silu_epilogue": 1, "residual_epilogue": 1}
    assert '%h = qlinear %x, %w_gate, %w_up {epilogue="silu_mul"' in print_graph(g)
    # A pair whose silu has another reader is no pair: all four merge, as before.
    text = SHARED_EXPERT.replace("  output sg = %sg", "  output sg = %sg\n  output act = %act")
    after, fired = run_pass(text, "merge_parallel")
    assert (
        fired == 1 and "%gate_up_router_sg = qlinear %x, %w_gate, %w_up, %w_router, %w_sg" in after
    )


@pytest.mark.parametrize(
    ("second_weight", "why"),
    [
        ("qweight<nvfp4<scale_mode=div,act_bits=4>>[256, 128]", "a W4A4 format beside another"),
        (f"{W4}[256, 192]", "different in_features (other input)"),
    ],
)
def test_merge_parallel_does_not_fire(second_weight, why):
    x2 = "%x2 = input : f16[M, 192]\n" if "192" in second_weight else ""
    src = "%x2" if x2 else "%x"
    text = f"""
    graph t {{
      %x = input : f16[M, 128]
      {x2}
      %wa = weight {{key="a"}} : {W4}[256, 128]
      %wb = weight {{key="b"}} : {second_weight}
      %a = qlinear %x, %wa : f16[M, 256]
      %b = qlinear {src}, %wb : f16[M, 256]
      output a = %a
      output b = %b
    }}
    """
    after, fired = run_pass(text, "merge_parallel")
    assert fired == 0, why
    assert after == print_graph(parse(text))


def test_silu_prologue_fires_and_removes_the_intermediates(rng):
    merged, _ = run_pass(MLP, "merge_parallel")
    after, fired = run_pass(merged, "silu_prologue")
    assert fired == 1
    assert (
        '%down = qlinear %gate, %up, %w_down {fused=["act", "h"], prologue="silu_mul"} : f16[M, 128]'
        in after
    )
    assert "%act" not in after and "%h" not in after
    assert_same_numbers(MLP, after, rng)


def test_silu_prologue_matches_swapped_mul(rng):
    text = MLP.replace("%h = mul %act, %up", "%h = mul %up, %act")
    after, fired = run_pass(text, "silu_prologue")
    assert fired == 1 and "%down = qlinear %gate, %up, %w_down" in after
    assert_same_numbers(text, after, rng)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (("output y = %y", "output y = %y\n  output a = %act"), "silu output used twice"),
        (("output y = %y", "output y = %y\n  output h = %h"), "product used twice"),
        (("%act = silu %gate", "%act = add %gate, %gate"), "not a silu"),
    ],
)
def test_silu_prologue_does_not_fire(edit, why):
    text = MLP.replace(*edit)
    _, fired = run_pass(text, "silu_prologue")
    assert fired == 0, why


def test_residual_epilogue_fires_after_the_prologue(rng):
    text, _ = run_pass(MLP, "silu_prologue")
    after, fired = run_pass(text, "residual_epilogue")
    assert fired == 1
    assert (
        '%y = qlinear %gate, %up, %w_down, %x {epilogue="residual", fused=["act", "h", "down"], '
        'prologue="silu_mul"} : f16[M, 128]' in after
    )
    assert_same_numbers(MLP, after, rng)


def test_residual_epilogue_either_operand_order(rng):
    text = MLP.replace("%y = add %x, %down", "%y = add %down, %x")
    after, fired = run_pass(text, "residual_epilogue")
    assert fired == 1 and '%y = qlinear %h, %w_down, %x {epilogue="residual"' in after
    assert_same_numbers(text, after, rng)


def test_residual_epilogue_does_not_fire_when_projection_is_used_twice():
    text = MLP.replace("output y = %y", "output y = %y\n  output d = %down")
    _, fired = run_pass(text, "residual_epilogue")
    assert fired == 0


MERGED = f"""
graph mlp {{
  %x = input : f16[M, 128]
  %w_gate = weight {{key="gate"}} : {W4}[256, 128]
  %w_up = weight {{key="up"}} : {W4}[256, 128]
  %w_down = weight {{key="down"}} : {W4}[128, 256]
  %gate_up = qlinear %x, %w_gate, %w_up {{fused=["gate", "up"]}} : (f16[M, 256], f16[M, 256])
  %gate = get %gate_up {{index=0}} : f16[M, 256]
  %up = get %gate_up {{index=1}} : f16[M, 256]
  %act = silu %gate : f16[M, 256]
  %h = mul %act, %up : f16[M, 256]
  %down = qlinear %h, %w_down : f16[M, 128]
  %y = add %x, %down : f16[M, 128]
  output y = %y
}}
"""


# silu_epilogue's rewrite of MERGED: the pair's gets, silu and mul become one launch.
PAIRED = (
    """  %gate_up = qlinear %x, %w_gate, %w_up {fused=["gate", "up"]} : (f16[M, 256], f16[M, 256])
  %gate = get %gate_up {index=0} : f16[M, 256]
  %up = get %gate_up {index=1} : f16[M, 256]
  %act = silu %gate : f16[M, 256]
  %h = mul %act, %up : f16[M, 256]
""",
    """  %h = qlinear %x, %w_gate, %w_up {epilogue="silu_mul", """
    """fused=["gate", "up", "gate_up", "act"]} : f16[M, 256]
""",
)


def test_silu_epilogue_pairs_gate_and_up(rng):
    assert run_pass(MLP, "merge_parallel")[0].strip() == MERGED.strip()
    after, fired = run_pass(MERGED, "silu_epilogue")
    assert fired == 1
    assert after.strip() == MERGED.strip().replace(*PAIRED)
    assert_same_numbers(MERGED, after, rng)


def test_silu_epilogue_swapped_operands_and_indices(rng):
    # up is result 0 here: the pair is ordered (silu'd weight, other weight) whatever the index.
    text = MERGED.replace("%act = silu %gate", "%act = silu %up").replace(
        "%h = mul %act, %up", "%h = mul %gate, %act"
    )
    after, fired = run_pass(text, "silu_epilogue")
    assert fired == 1 and "%h = qlinear %x, %w_up, %w_gate {epilogue=" in after
    assert_same_numbers(text, after, rng)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (("output y = %y", "output y = %y\n  output g = %gate"), "gate used twice"),
        (("output y = %y", "output y = %y\n  output a = %act"), "silu used twice"),
        (("%h = mul %act, %up", "%h = mul %act, %gate"), "both factors from one weight"),
        (("%act = silu %gate", "%act = add %gate, %gate"), "not a silu"),
        (("%h = mul %act, %up", "%h = mul %act, %act"), "no get of the pair"),
    ],
)
def test_silu_epilogue_does_not_fire(edit, why):
    text = MERGED.replace(*edit)
    _, fired = run_pass(text, "silu_epilogue")
    assert fired == 0, why


def test_silu_epilogue_under_w4a4_quantizes_the_product_once():
    """W4A4: the pair reads quantize_act(x) and down_proj reads quantize_act(h), one launch of
    the stored product, rather than a prologue quantizing it again in each of its warps."""
    text = MERGED.replace(W4, "qweight<nvfp4<scale_mode=div,act_bits=4>>")
    g, records = run_pipeline(parse(text))
    fired = {r.name: r.matches for r in records}
    assert (fired["silu_epilogue"], fired["silu_prologue"], fired["route_w4a4"]) == (1, 0, 2)
    after = print_graph(g)
    assert "%x_q = quantize_act %x" in after and "%h_q = quantize_act %h" in after
    assert '%h = qlinear %x_q, %w_gate, %w_up {epilogue="silu_mul"' in after


UP_W8 = (f'%w_up = weight {{key="up"}} : {W4}', f'%w_up = weight {{key="up"}} : {W8}')


def test_silu_epilogue_pairs_gate_and_up_of_different_formats(rng):
    """Gate and up of two formats (a GGUF whose ffn_up is Q6_K beside a Q4_K ffn_gate) merge
    and pair: one launch, the gate's format's code then the up's over each block's rows."""
    mixed = MERGED.replace(*UP_W8)
    after, fired = run_pass(mixed, "silu_epilogue")
    assert fired == 1
    assert after.strip() == mixed.strip().replace(*PAIRED)
    assert_same_numbers(mixed, after, rng)
    # the whole pipeline: the pair is the epilogue, down_proj takes no prologue
    _, records = run_pipeline(parse(MLP.replace(*UP_W8)))
    fired_all = {r.name: r.matches for r in records}
    assert (fired_all["silu_epilogue"], fired_all["silu_prologue"]) == (1, 0)


def test_silu_prologue_takes_gate_and_up_that_were_not_paired():
    """Gate and up that cannot pair (two formats of two inputs: not merged) leave silu(g) * u
    to down_proj's prologue."""
    text = (
        MLP.replace(
            f'%w_up = weight {{key="up"}} : {W4}[256, 128]',
            f'%w_up = weight {{key="up"}} : {W8}[256, 64]',
        )
        .replace("%up = qlinear %x, %w_up", "%up = qlinear %x2, %w_up")
        .replace("%x = input : f16[M, 128]", "%x = input : f16[M, 128]\n  %x2 = input : f16[M, 64]")
    )
    _, records = run_pipeline(parse(text))
    fired = {r.name: r.matches for r in records}
    assert (fired["merge_parallel"], fired["silu_epilogue"], fired["silu_prologue"]) == (0, 0, 1)


def test_merge_parallel_merges_weights_of_different_formats(rng):
    """A GGUF's q/k in one format and v in another: one launch."""
    text = f"""
    graph t {{
      %x = input : f16[M, 128]
      %wa = weight {{key="a"}} : {W4}[256, 128]
      %wb = weight {{key="b"}} : {W8}[64, 128]
      %a = qlinear %x, %wa : f16[M, 256]
      %b = qlinear %x, %wb : f16[M, 64]
      output a = %a
      output b = %b
    }}
    """
    after, fired = run_pass(text, "merge_parallel")
    assert fired == 1 and "%a_b = qlinear %x, %wa, %wb" in after
    assert_same_numbers(text, after, rng)


def test_default_pipeline_counts_and_ir():
    g, records = run_pipeline(parse(MLP))
    assert {r.name: r.matches for r in records} == {
        "merge_parallel": 1,
        "silu_epilogue": 1,
        "silu_prologue": 0,
        "residual_epilogue": 1,
        "norm_residual": 0,
        "softcap_epilogue": 0,
        "fold_rope": 0,
        "fold_head_norm": 0,
        "route_w4a4": 0,
        "share_act_quant": 0,
        "norm_act_quant": 0,
        "norm_prologue": 0,
        "norm_residual_prologue": 0,
        "dce": 0,
        "select_kernels": 2,
    }
    assert [n for n, node in g.items() if node.op == "qlinear"] == ["h", "y"]


def test_patterns_capture_and_require_one_use():
    g = parse(MLP)
    pat = Pat("mul", (Pat("silu", (Pat(name="g"),), one_use=True), Pat(name="u")), name="h")
    m = match(g, pat, "h")
    assert m is not None and (m["g"], m["u"], m["h"]) == ("gate", "up", "h")
    g.outputs.append(("a", "act"))
    assert match(g, pat, "h") is None
    # one name bound to two different values does not match
    assert match(g, Pat("mul", (Pat(name="a"), Pat(name="a"))), "h") is None


@st.composite
def random_graphs(draw):
    """Random blocks of qlinear/silu/gelu_tanh/mul/add over random formats and act dtypes."""
    act = draw(st.sampled_from([F16, BF16, F32]))
    width = draw(st.sampled_from([64, 128]))
    b = Builder("rand")
    values: list[Value] = [b.input("x", ("M", width), act)]
    n_w = 0
    for _ in range(draw(st.integers(1, 7))):
        op = draw(st.sampled_from(["qlinear", "qlinear", "silu", "gelu_tanh", "mul", "add"]))
        a = values[draw(st.integers(0, len(values) - 1))]
        if op == "qlinear":
            fmt = MlxAffine(draw(st.sampled_from([3, 4, 8])), 64, BF16)
            w = b.weight(f"w{n_w}", QWeight(fmt, width, width))
            n_w += 1
            values.append(b.qlinear(a, w))
        elif op == "silu":
            values.append(b.silu(a))
        elif op == "gelu_tanh":
            values.append(b.gelu_tanh(a))
        else:
            c = values[draw(st.integers(0, len(values) - 1))]
            values.append(b.mul(a, c) if op == "mul" else b.add(a, c))
    b.output("out", values[-1])
    if len(values) > 2:
        b.output("extra", values[draw(st.integers(1, len(values) - 2))])
    return b.graph


@settings(max_examples=60, deadline=None)
@given(graph=random_graphs(), seed=st.integers(0, 2**16), m=st.integers(1, 5))
def test_pipeline_preserves_the_interpreter_on_random_graphs(graph, seed, m):
    rng = np.random.default_rng(seed)
    text = print_graph(graph)
    after, _ = run_pipeline(graph)
    assert print_graph(graph) == text, "the caller's graph is untouched"
    assert_same_numbers(text, print_graph(after), rng, m)


def test_gelu_tanh_fuses_where_silu_does_with_the_nodes_act(rng):
    """Gemma's gelu_tanh in the silu's place: the gate/up epilogue and down_proj's prologue
    take it, the qlinear's `act` naming it; the interpreter's numbers are unchanged (and are
    not silu's)."""
    merged = MERGED.replace("%act = silu %gate", "%act = gelu_tanh %gate")
    after, fired = run_pass(merged, "silu_epilogue")
    assert fired == 1
    assert (
        '%h = qlinear %x, %w_gate, %w_up {act="gelu_tanh", epilogue="silu_mul", '
        'fused=["gate", "up", "gate_up", "act"]} : f16[M, 256]' in after
    )
    assert_same_numbers(merged, after, rng)
    unmerged = MLP.replace("%act = silu %gate", "%act = gelu_tanh %gate")
    after, fired = run_pass(unmerged, "silu_prologue")
    assert fired == 1
    assert (
        '%down = qlinear %gate, %up, %w_down {act="gelu_tanh", fused=["act", "h"], '
        'prologue="silu_mul"} : f16[M, 128]' in after
    )
    assert_same_numbers(unmerged, after, rng)
    # The act is what the kernel applies: silu's numbers differ.
    w = weights_for(unmerged, rng)
    x = {"x": rng.standard_normal((3, 128)).astype(np.float16)}
    silu = interpret(parse(after.replace('act="gelu_tanh", ', "")), x, w)["y"]
    assert not np.array_equal(silu, interpret(parse(after), x, w)["y"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('act="gelu_tanh", ', 'act="relu", '), r"qlinear: unknown act 'relu'"),
        (('act="gelu_tanh", fused=["act", "h"], prologue="silu_mul"', 'act="gelu_tanh"'), None),
    ],
)
def test_a_qlinears_act_is_checked(edit, message):
    unmerged = MLP.replace("%act = silu %gate", "%act = gelu_tanh %gate")
    after, _ = run_pass(unmerged, "silu_prologue")
    text = after.replace(*edit)
    if message is None:  # an act without a gate to apply it to
        text = text.replace("%down = qlinear %gate, %up, %w_down", "%down = qlinear %h0, %w_down")
        text = text.replace("  %down =", "  %h0 = mul %gate, %up : f16[M, 256]\n  %down =")
        message = r"qlinear: act 'gelu_tanh' needs a silu_mul prologue or epilogue"
    with pytest.raises(VerifyError, match=message):
        parse(text)


POST_NORM = f"""
graph post_norm {{
  %x = input : bf16[M, 128]
  %a = input : bf16[M, 128]
  %w_o = weight {{key="o"}} : {W4}[128, 128]
  %nw = weight {{key="post"}} : f32[128]
  %o = qlinear %a, %w_o : bf16[M, 128]
  %n = rms_norm %o, %nw {{eps=1e-06}} : bf16[M, 128]
  %y = add %x, %n : bf16[M, 128]
  output y = %y
}}
"""


def test_norm_residual_takes_a_norm_before_a_residual_add(rng):
    """Gemma's post-norms: add(r, rms_norm(x, w)) in either order is one norm_residual; the
    qlinear keeps no residual epilogue (its result is normed first)."""
    for text in (POST_NORM, POST_NORM.replace("add %x, %n", "add %n, %x")):
        after, fired = run_pass(text, "norm_residual")
        assert fired == 1
        assert '%y = norm_residual %o, %nw, %x {eps=1e-06, fused=["n"]} : bf16[M, 128]' in after
        assert "%n =" not in after
        _same_post_norm_numbers(text, after, rng)
        _, records = run_pipeline(parse(text))
        fired_all = {r.name: r.matches for r in records}
        assert (fired_all["residual_epilogue"], fired_all["norm_residual"]) == (0, 1)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (("output y = %y", "output y = %y\n  output n = %n"), "norm used twice"),
        (("%y = add %x, %n", "%y = mul %x, %n"), "not an add"),
    ],
)
def test_norm_residual_does_not_fire(edit, why):
    _, fired = run_pass(POST_NORM.replace(*edit), "norm_residual")
    assert fired == 0, why


def _same_post_norm_numbers(before: str, after: str, rng: np.random.Generator) -> None:
    _, bufs = random_weight(rng, 128, 128, MlxAffine(4, 64, BF16))
    w = {"o": bufs, "post": {"weight": (1 + 0.2 * rng.standard_normal(128)).astype(np.float32)}}
    x = {k: rng.standard_normal((5, 128)).astype(BF16.np) for k in ("x", "a")}
    want = interpret(parse(before), x, w)["y"]
    np.testing.assert_array_equal(interpret(parse(after), x, w)["y"], want)
    # not the add without the norm's rounding, nor the norm without the add
    assert not np.array_equal(want, x["x"])


LOGITS = f"""
graph logits {{
  %h = input : f32[M, 128]
  %w_head = weight {{key="head"}} : {W4}[96, 128]
  %logits = qlinear %h, %w_head : f32[M, 96]
  %capped = softcap %logits {{cap=2.0}} : f32[M, 96]
  output logits = %capped
}}
"""


def test_softcap_epilogue_is_the_lm_heads_store(rng):
    after, fired = run_pass(LOGITS, "softcap_epilogue")
    assert fired == 1
    assert (
        '%capped = qlinear %h, %w_head {cap=2.0, epilogue="softcap", fused=["logits"]} : '
        "f32[M, 96]" in after
    )
    assert "softcap %" not in after
    assert_same_numbers(LOGITS, after, rng)
    g = parse(after)
    x = {"h": (4 * rng.standard_normal((3, 128))).astype(np.float32)}
    y = interpret(g, x, weights_for(LOGITS, rng))["logits"]
    assert 1.9 < np.abs(y).max() <= 2.0  # capped (the projection alone reaches past 2)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (
            ("output logits = %capped", "output logits = %capped\n  output raw = %logits"),
            "used twice",
        ),
        (("softcap %logits {cap=2.0}", "silu %logits"), "not a softcap"),
    ],
)
def test_softcap_epilogue_does_not_fire(edit, why):
    _, fired = run_pass(LOGITS.replace(*edit), "softcap_epilogue")
    assert fired == 0, why


# Gemma's post-attention norm and residual add, then the pre-feedforward norm read by gate/up
# (already in the forms norm_residual and norm_prologue make); the down projection's residual
# add reads h.
POST_NORM_READ = f"""
graph post_norm_read {{
  %x = input : bf16[M, 128]
  %o = input : bf16[M, 128]
  %pw = weight {{key="post"}} : f32[128]
  %nw = weight {{key="pre"}} : f32[128]
  %w_a = weight {{key="a"}} : {W4}[64, 128]
  %w_b = weight {{key="b"}} : {W4}[64, 128]
  %w_d = weight {{key="d"}} : {W4}[128, 64]
  %h = norm_residual %o, %pw, %x {{eps=1e-05, fused=["n"]}} : bf16[M, 128]
  %ab = qlinear %h, %nw, %w_a, %w_b {{eps=1e-06, prologue="rms_norm"}} : (bf16[M, 64], bf16[M, 64])
  %a = get %ab {{index=0}} : bf16[M, 64]
  %b = get %ab {{index=1}} : bf16[M, 64]
  %s = add %a, %b : bf16[M, 64]
  %d = qlinear %s, %w_d : bf16[M, 128]
  %y = add %h, %d : bf16[M, 128]
  output y = %y
}}
"""


def test_norm_residual_prologue_takes_a_post_norm_into_the_next_projections(rng):
    """The norm_residual rides in the qlinear's prologue, which stores h as its last result for
    the residual add that also reads it; a single-result qlinear becomes get 0 of the tuple."""
    after, fired = run_pass(POST_NORM_READ, "norm_residual_prologue")
    assert fired == 1
    assert (
        '%ab = qlinear %o, %pw, %x, %nw, %w_a, %w_b {eps=1e-06, fused=["n", "h"], '
        'prologue="norm_residual", res_eps=1e-05} : (bf16[M, 64], bf16[M, 64], bf16[M, 128])'
    ) in after
    assert "%h = get %ab {index=2} : bf16[M, 128]" in after
    assert "norm_residual %o" not in after
    same_numbers(POST_NORM_READ, after, rng, m=5)
    single = POST_NORM_READ.replace(
        '%ab = qlinear %h, %nw, %w_a, %w_b {eps=1e-06, prologue="rms_norm"} : (bf16[M, 64], '
        "bf16[M, 64])",
        '%ab = qlinear %h, %nw, %w_a, %w_b {eps=1e-06, epilogue="silu_mul", prologue="rms_norm"}'
        " : bf16[M, 64]",
    )
    single = single.replace("%a = get %ab {index=0} : bf16[M, 64]\n", "")
    single = single.replace("%b = get %ab {index=1} : bf16[M, 64]\n", "")
    single = single.replace("%s = add %a, %b", "%s = add %ab, %ab")
    after, fired = run_pass(single, "norm_residual_prologue")
    assert fired == 1
    assert "%ab = get %ab.1 {index=0} : bf16[M, 64]" in after
    assert "%h = get %ab.1 {index=1} : bf16[M, 128]" in after
    same_numbers(single, after, rng, m=5)
    # in the default pipeline, from the unfused ops
    unfused = POST_NORM_READ.replace(
        '  %h = norm_residual %o, %pw, %x {eps=1e-05, fused=["n"]} : bf16[M, 128]\n',
        "  %n = rms_norm %o, %pw {eps=1e-05} : bf16[M, 128]\n  %h = add %x, %n : bf16[M, 128]\n",
    ).replace(
        '%ab = qlinear %h, %nw, %w_a, %w_b {eps=1e-06, prologue="rms_norm"}',
        "%hn = rms_norm %h, %nw {eps=1e-06} : bf16[M, 128]\n  %ab = qlinear %hn, %w_a, %w_b",
    )
    _, records = run_pipeline(parse(unfused))
    fired_all = {r.name: r.matches for r in records}
    counts = ("norm_residual", "norm_prologue", "norm_residual_prologue")
    assert tuple(fired_all[k] for k in counts) == (1, 1, 1)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (("%ab = qlinear %h, %nw", "%ab = qlinear %x, %nw"), "the prologue reads no norm_residual"),
        (
            ("%d = qlinear %s, %w_d", "%d = qlinear %h, %nw, %w_d"),
            "two prologues read h (each would store it)",
        ),
    ],
)
def test_norm_residual_prologue_does_not_fire(edit, why):
    text = POST_NORM_READ.replace(*edit)
    if "%h, %nw, %w_d" in text:
        text = text.replace(
            '%w_d = weight {key="d"} : ' + W4 + "[128, 64]",
            '%w_d = weight {key="d"} : ' + W4 + "[128, 128]",
        )
        text = text.replace(
            "%d = qlinear %h, %nw, %w_d : bf16[M, 128]",
            '%d = qlinear %h, %nw, %w_d {eps=1e-06, prologue="rms_norm"} : bf16[M, 128]',
        )
    _, fired = run_pass(text, "norm_residual_prologue")
    assert fired == 0, why


def test_a_norm_residual_prologue_is_checked():
    after, _ = run_pass(POST_NORM_READ, "norm_residual_prologue")
    with pytest.raises(VerifyError, match=r"qlinear: res_eps is the norm_residual prologue's"):
        parse(after.replace('prologue="norm_residual"', 'prologue="rms_norm"'))
    with pytest.raises(VerifyError, match=r"norm_residual: .*%x.* and .*%o.* differ"):
        parse(after.replace("%x = input : bf16[M, 128]", "%x = input : f16[M, 128]"))
