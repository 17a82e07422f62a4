"""Layer fusion passes (fold_rope, norm_act_quant, norm_prologue): IR before/after, must-not-fire, counters,
and the interpreter before == after, bit for bit, caches included."""

from __future__ import annotations

import numpy as np

from qir import interpret, parse, print_graph
from qir.dtypes import BF16
from qir.interpret import empty_state
from qir.models import load
from qir.models.blocks import build
from qir.passes.manager import PASSES, PIPELINES, PassOptions, run_pipeline
from qir.types import QExperts, TensorType
from tests.conftest import DATA, random_weight
from tests.moe_common import random_experts

ROPE = 'head_dim=32, rope_type="default", theta=10000.0'
CACHE = "f16[16, 2, 32]"
ATTN = f"""
graph attn {{
  %q = input : f16[M, 128]
  %k = input : f16[M, 64]
  %v = input : f16[M, 64]
  %pos = input : i32[M]
  %pos2 = input : i32[M]
  %kc = state {{key="k"}} : {CACHE}
  %vc = state {{key="v"}} : {CACHE}
  %q_rot = rope %q, %pos {{{ROPE}}} : f16[M, 128]
  %k_rot = rope %k, %pos {{{ROPE}}} : f16[M, 64]
  %kv = kv_append %kc, %vc, %k_rot, %v, %pos : ({CACHE}, {CACHE})
  %kv.k = get %kv {{index=0}} : {CACHE}
  %kv.v = get %kv {{index=1}} : {CACHE}
  %attn = attention %q_rot, %kv.k, %kv.v, %@POS {{scale=0.2}} : f16[M, 128]
  output y = %attn
}}
"""


def weights_for(text: str, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    g = parse(text)
    out = {}
    for w in g.weights:
        t = g.node(w).type
        if isinstance(t, TensorType):  # a norm's weight
            out[g.node(w).attr("key")] = {
                "weight": (1 + rng.standard_normal(t.shape) / 8).astype(t.dtype.np)
            }
        elif isinstance(t, QExperts):
            e = t.expert
            out[g.node(w).attr("key")] = random_experts(
                rng, t.count, e.out_features, e.in_features, e.format
            )[1]
        else:
            out[g.node(w).attr("key")] = random_weight(
                rng, t.out_features, t.in_features, t.format
            )[1]
    return out


def run_pass(text: str, name: str) -> tuple[str, int]:
    g = parse(text)
    fired = PASSES[name](PassOptions()).run(g)
    return print_graph(g), fired


def assert_same_numbers(before: str, after: str, rng: np.random.Generator, m: int = 5) -> None:
    """Interpret both with the same inputs (positions 3..3+m-1 over caches holding random rows
    before them): outputs and written caches identical."""
    gb, ga = parse(before), parse(after)
    weights = weights_for(before, rng)
    inputs = {}
    for name in gb.inputs:
        t = gb.node(name).type
        if t.dtype.name == "i32":
            inputs[name] = np.arange(3, 3 + m, dtype=np.int32)
        else:
            inputs[name] = rng.standard_normal((m, t.shape[1])).astype(t.dtype.np)
    start = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in empty_state(gb).items()}
    sb, sa = dict(start), dict(start)
    ob, oa = interpret(gb, inputs, weights, sb), interpret(ga, inputs, weights, sa)
    assert ob.keys() == oa.keys()
    for k in ob:
        np.testing.assert_array_equal(ob[k], oa[k])
    for k in sb:
        np.testing.assert_array_equal(sb[k], sa[k])


def test_fold_rope_moves_both_rotations_into_their_readers(rng):
    before = ATTN.replace("@POS", "pos")
    after, fired = run_pass(before, "fold_rope")
    assert fired == 2
    assert "rope " not in after
    assert f"%kv = kv_append %kc, %vc, %k, %v, %pos {{{ROPE}}}" in after
    attn = '{head_dim=32, rope_type="default", scale=0.2, theta=10000.0}'
    assert f"%attn = attention %q, %kv.k, %kv.v, %pos {attn}" in after
    assert_same_numbers(before, after, rng)


def test_fold_rope_does_not_fire_on_other_positions_or_shared_rotations(rng):
    # q rotated by other positions than attention reads: only k folds.
    before = ATTN.replace("@POS", "pos2")
    after, fired = run_pass(before, "fold_rope")
    assert fired == 1 and "%q_rot = rope %q, %pos" in after
    assert_same_numbers(before, after, rng)
    # A rotation that is also an output stays.
    shared = ATTN.replace("@POS", "pos").replace("  output y", "  output q = %q_rot\n  output y")
    after, fired = run_pass(shared, "fold_rope")
    assert fired == 1 and "%q_rot = rope" in after and "attention %q_rot" in after
    # Already folded: nothing left to do.
    folded, _ = run_pass(ATTN.replace("@POS", "pos"), "fold_rope")
    assert run_pass(folded, "fold_rope") == (folded, 0)


# Qwen3: q and k normed per head (weights [head_dim]) before the rotations.
HEAD_NORMS = (
    ATTN.replace(
        "  %q_rot = rope %q, %pos",
        """  %wqn = weight {key="q_norm"} : bf16[32]
  %wkn = weight {key="k_norm"} : bf16[32]
  %qn = rms_norm %q, %wqn {eps=1e-06} : f16[M, 128]
  %kn = rms_norm %k, %wkn {eps=1e-06} : f16[M, 64]
  %q_rot = rope %q, %pos""",
    )
    .replace("rope %q, %pos", "rope %qn, %pos")
    .replace("rope %k, %pos", "rope %kn, %pos")
)


def test_fold_head_norm_puts_q_and_k_norms_before_the_folded_rotations(rng):
    before = HEAD_NORMS.replace("@POS", "pos")
    rotated, _ = run_pass(before, "fold_rope")
    after, fired = run_pass(rotated, "fold_head_norm")
    assert fired == 2
    assert "rms_norm" not in after
    kv = '{head_dim=32, norm_eps=1e-06, rope_type="default", theta=10000.0}'
    assert f"%kv = kv_append %kc, %vc, %k, %v, %pos, %wkn {kv}" in after
    attn = '{head_dim=32, norm_eps=1e-06, rope_type="default", scale=0.2, theta=10000.0}'
    assert f"%attn = attention %q, %kv.k, %kv.v, %pos, %wqn {attn}" in after
    assert_same_numbers(before, after, rng)
    # the default pipeline does the same
    g, records = run_pipeline(parse(before))
    assert {r.name: r.matches for r in records}["fold_head_norm"] == 2
    assert print_graph(g).count("norm_eps=1e-06") == 2


def test_fold_head_norm_does_not_fire_on_row_norms_shared_norms_or_twice(rng):
    rotated, _ = run_pass(HEAD_NORMS.replace("@POS", "pos"), "fold_rope")
    # A norm of whole rows of q is no per-head prologue.
    rows = rotated.replace("bf16[32]\n  %wkn", "bf16[128]\n  %wkn")
    assert run_pass(rows, "fold_head_norm")[1] == 1  # k only
    # A normed q that is also an output stays.
    shared = rotated.replace("  output y", "  output qn = %qn\n  output y")
    after, fired = run_pass(shared, "fold_head_norm")
    assert fired == 1 and "%qn = rms_norm" in after and "attention %qn" in after
    folded, _ = run_pass(rotated, "fold_head_norm")
    assert run_pass(folded, "fold_head_norm") == (folded, 0)


def test_fold_head_norm_keeps_attention_sinks_last(rng):
    """Head norms and sinks together (no family has both yet): the folded q norm goes before
    the sinks, which stay attention's last operand; the numbers are the unfolded graph's."""
    before = (
        HEAD_NORMS.replace("@POS", "pos")
        .replace("  %kc = state", '  %sinks = weight {key="sinks"} : f32[4]\n  %kc = state')
        .replace("%pos {scale=0.2}", "%pos, %sinks {scale=0.2, sinks=true}")
    )
    rotated, _ = run_pass(before, "fold_rope")
    after, fired = run_pass(rotated, "fold_head_norm")
    assert fired == 2
    assert "%attn = attention %q, %kv.k, %kv.v, %pos, %wqn, %sinks {" in after
    assert_same_numbers(before, after, rng)


A4 = "qweight<nvfp4<scale_mode=div,act_bits=4>>"
NORM = f"""
graph norm {{
  %x = input : f16[M, 128]
  %nw = weight {{key="norm"}} : bf16[128]
  %xn = rms_norm %x, %nw {{eps=1e-05}} : f16[M, 128]
  %xq = quantize_act %xn {{input_global_scale=588.0, scheme="nvfp4"}} : qact<nvfp4, f16[M, 128]>
  %wq = weight {{input_global_scale=588.0, key="q"}} : {A4}[128, 128]
  %q = qlinear %xq, %wq : f16[M, 128]
  output q = %q
}}
"""


def test_norm_act_quant_computes_the_norm_in_the_quantization(rng):
    after, fired = run_pass(NORM, "norm_act_quant")
    assert fired == 1
    assert (
        '%xq = quantize_act %xn, %x, %nw {eps=1e-05, input_global_scale=588.0, scheme="nvfp4"}'
        in after
    )
    assert "%xn = rms_norm %x, %nw" in after  # the 16-bit value batches above 64 rows read
    assert_same_numbers(NORM, after, rng, m=5)
    assert_same_numbers(NORM, after, rng, m=70)
    assert run_pass(after, "norm_act_quant") == (after, 0)


def test_norm_act_quant_does_not_fire_when_the_norm_is_read_unquantized():
    # A second, 16-bit reader needs the rms_norm launch anyway: fusing saves nothing.
    text = NORM.replace("  output q", "  output xn = %xn\n  output q")
    assert run_pass(text, "norm_act_quant")[1] == 0
    w16 = "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>"
    text = NORM.replace(
        "  output q",
        f'  %w2 = weight {{key="o"}} : {w16}[64, 128]\n  %o = qlinear %xn, %w2 : f16[M, 64]\n'
        "  output o = %o\n  output q",
    )
    assert run_pass(text, "norm_act_quant")[1] == 0


def test_a_w4a4_layer_keeps_its_numbers_through_the_layer_passes():
    """The default pipeline on a whole W4A4 layer against the same pipeline without the two
    layer passes: outputs and written caches identical."""
    b = build(load(DATA / "ct_nvfp4_w4a4_S"), "layer", 0, BF16)
    fused, records = run_pipeline(b.graph, "default")
    fired = {r.name: r.matches for r in records}
    assert fired["fold_rope"] == 2 and fired["norm_act_quant"] == 2
    without = [p for p in PIPELINES["default"] if p not in ("fold_rope", "norm_act_quant")]
    plain, _ = run_pipeline(b.graph, without)
    x = np.load(DATA / "ct_nvfp4_w4a4_S" / "golden.npz")["x.M5"].astype(BF16.np)
    states = empty_state(b.graph), empty_state(b.graph)
    want = interpret(plain, b.inputs(x), b.weights, states[0])
    got = interpret(fused, b.inputs(x), b.weights, states[1])
    np.testing.assert_array_equal(got["y"], want["y"])
    for k in states[0]:
        np.testing.assert_array_equal(states[0][k], states[1][k])


W16 = "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>"
NORM16 = f"""
graph norm16 {{
  %x = input : f16[M, 128]
  %nw = weight {{key="norm"}} : bf16[128]
  %xn = rms_norm %x, %nw {{eps=1e-05}} : f16[M, 128]
  %wq = weight {{key="q"}} : {W16}[128, 128]
  %wk = weight {{key="k"}} : {W16}[64, 128]
  %qk = qlinear %xn, %wq, %wk : (f16[M, 128], f16[M, 64])
  %q = get %qk {{index=0}} : f16[M, 128]
  %k = get %qk {{index=1}} : f16[M, 64]
  output q = %q
  output k = %k
}}
"""


def test_norm_prologue_normalises_inside_the_projection(rng):
    after, fired = run_pass(NORM16, "norm_prologue")
    assert fired == 1
    want = '%qk = qlinear %x, %nw, %wq, %wk {eps=1e-05, fused=["xn"], prologue="rms_norm"}'
    assert want in after and "rms_norm %x" not in after
    assert_same_numbers(NORM16, after, rng, m=5)
    assert_same_numbers(NORM16, after, rng, m=70)
    assert run_pass(after, "norm_prologue") == (after, 0)


def test_norm_prologue_reaches_every_projection_of_one_norm(rng):
    # q and k unmerged (say, different formats): both normalise; the norm's launch goes.
    text = NORM16.replace(
        "  %qk = qlinear %xn, %wq, %wk : (f16[M, 128], f16[M, 64])\n"
        "  %q = get %qk {index=0} : f16[M, 128]\n  %k = get %qk {index=1} : f16[M, 64]\n",
        "  %q = qlinear %xn, %wq : f16[M, 128]\n  %k = qlinear %xn, %wk : f16[M, 64]\n",
    )
    assert "%q = qlinear %xn, %wq" in text
    after, fired = run_pass(text, "norm_prologue")
    assert fired == 2 and "rms_norm %x" not in after
    assert_same_numbers(text, after, rng, m=3)


def test_norm_prologue_does_not_fire_when_the_norm_is_needed_anyway():
    # A block output, a residual operand, a quantize_act (W4A4 owns that norm), another op.
    outputs = NORM16.replace("  output q", "  output xn = %xn\n  output q")
    assert run_pass(outputs, "norm_prologue")[1] == 0
    residual = NORM16.replace(
        "  output q",
        f'  %wo = weight {{key="o"}} : {W16}[128, 128]\n'
        '  %o = qlinear %q, %wo, %xn {epilogue="residual"} : f16[M, 128]\n'
        "  output o = %o\n  output q",
    )
    assert run_pass(residual, "norm_prologue")[1] == 0
    assert run_pass(NORM, "norm_prologue")[1] == 0
    silu = NORM16.replace(
        "  output q", "  %s = silu %xn : f16[M, 128]\n  output s = %s\n  output q"
    )
    assert run_pass(silu, "norm_prologue")[1] == 0


MOE16 = f"""
graph moe16 {{
  %x = input : f16[M, 128]
  %nw = weight {{key="norm"}} : bf16[128]
  %xn = rms_norm %x, %nw {{eps=1e-05}} : f16[M, 128]
  %wr = weight {{key="router"}} : {W16}[6, 128]
  %logits = qlinear %xn, %wr : f16[M, 6]
  %route = route %logits {{k=2, rule="softmax_topk_norm"}} : (i32[M, 2], f32[M, 2])
  %ids = get %route {{index=0}} : i32[M, 2]
  %rw = get %route {{index=1}} : f32[M, 2]
  %wg = weight {{key="gate"}} : experts<6, {W16}[64, 128]>
  %wu = weight {{key="up"}} : experts<6, {W16}[64, 128]>
  %wd = weight {{key="down"}} : experts<6, {W16}[128, 64]>
  %h = expert_qlinear %xn, %wg, %wu, %ids {{epilogue="silu_mul"}} : f16[M, 2, 64]
  %y = expert_qlinear %h, %wd, %ids, %rw, %x {{epilogue="combine_residual"}} : f16[M, 128]
  output y = %y
  output ids = %ids
}}
"""


def test_norm_prologue_reaches_the_router_and_the_experts(rng):
    # A MoE layer's post-attention norm: read by the router and the experts' gate/up, both fold
    # it, so no launch computes it alone; the down (a row per slot) reads no norm.
    after, fired = run_pass(MOE16, "norm_prologue")
    assert fired == 2 and "rms_norm %x" not in after
    assert '%logits = qlinear %x, %nw, %wr {eps=1e-05, fused=["xn"], prologue="rms_norm"}' in after
    assert (
        "%h = expert_qlinear %x, %nw, %wg, %wu, %ids "
        '{epilogue="silu_mul", eps=1e-05, fused=["xn"], prologue="rms_norm"} : f16[M, 2, 64]'
    ) in after
    assert "%y = expert_qlinear %h, %wd, %ids, %rw, %x {" in after
    for m in (1, 5, 40):
        assert_same_numbers(MOE16, after, rng, m=m)
    assert run_pass(after, "norm_prologue") == (after, 0)
    # the whole pipeline: the same fold, the grouped GEMM chosen from its M on
    passed = print_graph(run_pipeline(parse(MOE16), "default")[0])
    assert "rms_norm" not in passed.replace('prologue="rms_norm"', "")


def test_norm_prologue_does_not_fire_where_an_expert_reader_cannot_take_it():
    # The norm read as a combine's residual (it must exist), or as the input of an expert
    # qlinear with a combine (its kernel reads rows as they are): the norm stays, for every
    # reader.
    residual = MOE16.replace("%rw, %x {", "%rw, %xn {")
    assert run_pass(residual, "norm_prologue")[1] == 0
    combine = MOE16.replace(
        "  output y = %y\n",
        f'  %wp = weight {{key="proj"}} : experts<6, {W16}[128, 128]>\n'
        '  %p = expert_qlinear %xn, %wp, %ids, %rw {epilogue="combine"} : f16[M, 128]\n'
        "  output y = %y\n  output p = %p\n",
    )
    assert "%p = expert_qlinear %xn" in combine
    assert run_pass(combine, "norm_prologue")[1] == 0
