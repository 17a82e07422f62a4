"""tensor_parallel: IR before/after, must-not-fire, refusals, the counter, and the interpreter on
every rank (threads, real collectives) against the unsplit block on real checkpoints."""

from __future__ import annotations

import re

import numpy as np
import pytest

from qir import interpret, parse, print_graph
from qir.collectives import run_threads
from qir.dtypes import F32
from qir.models import load
from qir.models.blocks import build
from qir.models.shard_read import load_rank
from qir.models.shards import shard_weights
from qir.passes.manager import run_pipeline
from qir.passes.tensor_parallel import TensorParallel, TensorParallelError
from qir.types import QWeight
from tests.conftest import DATA
from tests.passes.test_layer_passes import weights_for

FMT = "qweight<mlx_affine<bits=4,group_size=32,scale_dtype=f16>>"
MLP = f"""
graph mlp {{
  %x = input : f32[M, 64]
  %w_gate = weight {{key="gate"}} : {FMT}[128, 64]
  %gate = qlinear %x, %w_gate : f32[M, 128]
  %w_up = weight {{key="up"}} : {FMT}[128, 64]
  %up = qlinear %x, %w_up : f32[M, 128]
  %act = silu %gate : f32[M, 128]
  %h = mul %act, %up : f32[M, 128]
  %w_down = weight {{key="down"}} : {FMT}[64, 128]
  %down = qlinear %h, %w_down : f32[M, 64]
  %y = add %x, %down : f32[M, 64]
  output y = %y
}}
"""
MLP_RANK1 = f"""graph mlp.rank1of2 {{
  %x = input : f32[M, 64]
  %w_gate.out64 = weight {{key="gate:out64-128", shard=["gate", "out", 64, 128, 128]}} : {FMT}[64, 64]
  %gate = qlinear %x, %w_gate.out64 : f32[M, 64]
  %w_up.out64 = weight {{key="up:out64-128", shard=["up", "out", 64, 128, 128]}} : {FMT}[64, 64]
  %up = qlinear %x, %w_up.out64 : f32[M, 64]
  %act = silu %gate : f32[M, 64]
  %h = mul %act, %up : f32[M, 64]
  %w_down.in64 = weight {{key="down:in64-128", shard=["down", "in", 64, 128, 128]}} : {FMT}[64, 64]
  %down = qlinear %h, %w_down.in64 : f32[M, 64]
  %down.all_reduce = all_reduce %down {{ranks=2}} : f32[M, 64]
  output y = %down.all_reduce
}}
"""
# rank 0 adds the residual to its partial sum, before the all_reduce (the others add none)
MLP_RANK0_TAIL = """  %down = qlinear %h, %w_down.in0 : f32[M, 64]
  %y = add %x, %down : f32[M, 64]
  %down.all_reduce = all_reduce %y {ranks=2} : f32[M, 64]
  output y = %down.all_reduce
}
"""


def _ranks(graph, weights, n):
    """Each rank's (graph, weights) and the pass's count."""
    parts = []
    for r in range(n):
        g = graph.copy()
        fired = TensorParallel(n, r).run(g)
        parts.append((g, shard_weights(g, weights)))
    return parts, fired


def _interpret(parts, inputs, states=None):
    """Every rank's outputs, the ranks on threads of one group (states: each rank's caches)."""
    states = states or [{} for _ in parts]

    def rank(c):
        graph, weights = parts[c.rank]
        return interpret(graph, inputs, weights, states[c.rank], c)

    return run_threads(len(parts), rank, timeout=60)


def test_mlp_ir_before_after_and_numbers():
    g = parse(MLP)
    assert TensorParallel(2, 1).run(g) == 3
    assert print_graph(g) == MLP_RANK1
    g0 = parse(MLP)
    assert TensorParallel(2, 0).run(g0) == 3
    assert print_graph(g0).endswith(MLP_RANK0_TAIL)
    rng = np.random.default_rng(0)
    weights = weights_for(MLP, rng)
    x = {"x": rng.standard_normal((5, 64)).astype(np.float32)}
    want = interpret(parse(MLP), x, weights)["y"]
    parts, _ = _ranks(parse(MLP), weights, 2)
    outs = [o["y"] for o in _interpret(parts, x)]
    for o in outs:
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs[0], outs[1])


# 160 intermediate features are 5 groups of 32: 3 + 2 on 2 ranks, 2 + 2 + 1 on 3
UNEVEN_MLP = MLP.replace("[128, 64]", "[160, 64]").replace("[64, 128]", "[64, 160]")
UNEVEN_MLP = UNEVEN_MLP.replace("f32[M, 128]", "f32[M, 160]")


def test_an_uneven_mlp_split_takes_whole_groups_per_rank():
    shards = []
    for r in range(2):
        g = parse(UNEVEN_MLP)
        assert TensorParallel(2, r).run(g) == 3
        shards.append([g.node(w).attr("shard") for w in g.weights])
    lo, hi = (0, 96), (96, 160)
    assert shards == [
        [(k, a, *lo, 160) for k, a in (("gate", "out"), ("up", "out"), ("down", "in"))],
        [(k, a, *hi, 160) for k, a in (("gate", "out"), ("up", "out"), ("down", "in"))],
    ]
    g1 = parse(UNEVEN_MLP)
    TensorParallel(2, 1).run(g1)
    assert "%h = mul %act, %up : f32[M, 64]" in print_graph(g1)
    rng = np.random.default_rng(0)
    weights = weights_for(UNEVEN_MLP, rng)
    x = {"x": rng.standard_normal((5, 64)).astype(np.float32)}
    want = interpret(parse(UNEVEN_MLP), x, weights)["y"]
    for n in (2, 3):
        parts, _ = _ranks(parse(UNEVEN_MLP), weights, n)
        widths = [g.node(g.operands("down")[1]).type.in_features for g, _ in parts]
        assert widths == ([96, 64] if n == 2 else [64, 64, 32])
        outs = [o["y"] for o in _interpret(parts, x)]
        for o in outs:
            np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(o, outs[0])
    with pytest.raises(
        TensorParallelError,
        match=r"^tensor_parallel: down has 160 inputs in 5 group\(s\) of 32 that no rank may "
        r"cut \(mlx_affine<bits=4,group_size=32,scale_dtype=f16>\), fewer than 6 ranks$",
    ):
        TensorParallel(6, 0).run(parse(UNEVEN_MLP))


def test_does_not_fire_on_one_rank_or_without_splittable_layers():
    g = parse(MLP)
    assert TensorParallel(1, 0).run(g) == 0
    assert print_graph(g) == print_graph(parse(MLP))
    lone = parse(
        f'graph q {{\n  %x = input : f32[M, 64]\n  %w = weight {{key="w"}} : {FMT}[64, 64]\n'
        "  %y = qlinear %x, %w : f32[M, 64]\n  output y = %y\n}\n"
    )
    assert TensorParallel(2, 0).run(lone) == 0
    assert "all_reduce" not in print_graph(lone)


def test_refusals_name_what_cannot_be_split():
    ck = load(DATA / "autogptq_g64_llama")  # 4 heads, 2 KV heads
    b = build(ck, "model", 0, act=F32, max_seq=32)
    with pytest.raises(
        TensorParallelError,
        match=r"^tensor_parallel: %l0.attn has 4 heads and 2 KV heads; 3 ranks must be at most "
        "the KV heads or a multiple of them$",
    ):
        TensorParallel(3, 0).run(b.graph.copy())
    # 4 heads of 64, one KV head each, in groups of 128: whole pairs of heads, 2 parts
    mha = build(load(DATA / "ct_w4a16_int4_S"), "model", 0, act=F32, max_seq=32)
    with pytest.raises(
        TensorParallelError,
        match=r"^tensor_parallel: %l0.attn's 4 heads over 4 KV heads make 2 part\(s\) of whole "
        r"heads on the groups of 128 inputs of model.layers.0.self_attn.o_proj \(ct_int<bits=4,"
        r"group_size=128,scale_dtype=bf16>\), fewer than 4 ranks$",
    ):
        TensorParallel(4, 3).run(mha.graph.copy())
    with pytest.raises(TensorParallelError, match="rank 2 of 2 ranks is out of range"):
        TensorParallel(2, 2).run(b.graph.copy())
    fused, _ = run_pipeline(b.graph)
    with pytest.raises(TensorParallelError, match="run the pass on the unfused block"):
        TensorParallel(2, 0).run(fused)


UNEVEN_CASES = [
    # (checkpoint (tests/tp_checkpoints.py), ranks): intermediate features whose groups do not
    # divide by the ranks, each rank ceil or floor of them
    ("gptq@320", (2, 4)),  # 5 groups of 64; 2 KV heads: 4 ranks replicate them
    ("gptq_desc_act@320", (2, 4)),  # desc_act: each part keeps every group
    ("awq_gemm@320", (2, 4)),
    ("mlx@320", (2, 4)),
    ("nvfp4_w4a4@336", (2, 4)),  # 21 blocks of 16
    ("mxfp4@352", (4,)),  # 11 blocks of 32
    ("ct_int4_channel", (4,)),  # one scale per row: every K part's
    ("gptq_per_row", (4,)),  # group_size -1
    ("ct_fp8block_qwen3", (2,)),  # K 416: 3 blocks of 128 and a ragged one
    # 10 heads of 32 in groups of 64: 5 KV heads 3 + 2, 2 + 2 + 1, 2 + 1 + 1 + 1; one KV head
    # replicated, its heads 4 + 2 + 2 + 2
    ("heads10_kv5", (2, 3, 4)),
    ("heads10_kv1", (4,)),
]


@pytest.mark.parametrize(("fixture", "ranks"), UNEVEN_CASES, ids=[c[0] for c in UNEVEN_CASES])
def test_every_rank_equals_the_unsplit_model(tmp_path, fixture, ranks):
    from tests.tp_checkpoints import uneven

    b = build(load(uneven(tmp_path, fixture)), "model", 0, act=F32, max_seq=32)
    inputs = b.token_inputs(np.array([3, 10, 17, 24, 31], np.int32))
    want = interpret(b.graph, inputs, b.weights)
    layers = sum(1 for _ in b.graph.of_op("attention"))
    for n in ranks:
        parts, fired = _ranks(b.graph, b.weights, n)
        assert fired == 8 * layers + 1  # q k v o gate up down per layer, and the lm_head
        # down_proj's inputs: consecutive whole units, ceil or floor of them per rank
        cuts = [g.node(g.operands("l0.down")[1]).attr("shard")[2:4] for g, _ in parts]
        size = b.graph.node(b.graph.operands("l0.down")[1]).type.in_features
        fmt = b.graph.node(b.graph.operands("l0.down")[1]).type.format
        assert [c[0] for c in cuts[1:]] == [c[1] for c in cuts[:-1]] and cuts[-1][1] == size
        unit = fmt.column_unit(size)
        units = [-(-(hi - lo) // unit) for lo, hi in cuts]
        assert max(units) - min(units) <= 1 and all(lo % unit == 0 for lo, _ in cuts)
        states = [{} for _ in range(n)]
        outs = _interpret(parts, inputs, states)
        for o in outs:
            err = np.abs(o["logits"] - want["logits"]).max() / np.abs(want["logits"]).max()
            assert err <= 1e-5
            np.testing.assert_array_equal(o["logits"], outs[0]["logits"])
        # o_proj's inputs are the rank's query heads, in whole groups; the KV cache each rank
        # wrote holds the KV heads its k_proj rows are, of the unsplit cache
        whole = {}
        interpret(b.graph, inputs, b.weights, whole)
        cache = "model.layers.0.self_attn.k_cache"
        head_dim = whole[cache].shape[2]
        for r, (g, _) in enumerate(parts):
            q_rows = g.node(g.operands("l0.q")[1]).attr("shard")[2:4]
            o = g.node(g.operands("l0.o")[1])
            assert o.attr("shard")[2:4] == q_rows
            assert q_rows[0] % o.type.format.column_unit(o.attr("shard")[4]) == 0
            lo, hi = g.node(g.operands("l0.k")[1]).attr("shard")[2:4]
            assert g.node("l0.k_cache").type.shape[1] == (hi - lo) // head_dim
            np.testing.assert_allclose(
                states[r][cache],
                whole[cache][:, lo // head_dim : hi // head_dim],
                rtol=1e-5,
                atol=1e-5,
            )


def test_row_parallel_bias_stays_on_rank_0_and_fusions_fire_per_rank():
    b = build(load(DATA / "autogptq_g64_llama"), "model", 0, act=F32, max_seq=32)
    parts, _ = _ranks(b.graph, b.weights, 2)
    for r, (g, weights) in enumerate(parts):
        o = g.node(g.operands("l0.o")[1]).type
        q = g.node(g.operands("l0.q")[1]).type
        assert isinstance(o, QWeight) and isinstance(q, QWeight)
        assert o.bias == (r == 0) and q.bias  # column-parallel biases are sliced, kept
        assert ("bias" in weights[g.node(g.operands("l0.o")[1]).attr("key")]) == (r == 0)
    _, whole_records = run_pipeline(b.graph)
    fired_whole = {p.name: p.matches for p in whole_records}
    for r in (0, 1):
        rank, records = run_pipeline(parts[r][0])
        fired = {p.name: p.matches for p in records}
        for p in (
            "merge_parallel",
            "silu_epilogue",
            "fold_rope",
            "norm_prologue",
            "select_kernels",
        ):
            assert fired[p] == fired_whole[p] > 0, p
        # the residual is added once: in rank 0's o/down epilogues, nowhere on rank 1
        assert fired["residual_epilogue"] == (fired_whole["residual_epilogue"] if r == 0 else 0)
        text = print_graph(rank)
        assert text.count("= all_reduce") == 4 and text.count("= all_gather") == 1
        assert " = add " not in text  # no rank launches an add of its own


@pytest.mark.parametrize(
    "fixture",
    [
        "mlx_affine4_qwen3",  # per-head q/k norms
        "ct_w4a16_qwen2",  # q/k/v biases
        "mlx_affine4_mistral",  # sliding window
        "mlx_affine4_phi3",  # fused qkv / gate_up read as rows
        "mlx_affine4_gemma3",  # post-norms after o/down, soft-capped logits, gelu
    ],
)
def test_families_split_on_two_ranks_read_from_their_shards(fixture):
    b = build(load(DATA / fixture), "model", 0, act=F32, max_seq=32)
    inputs = b.token_inputs(np.array([3, 10, 17, 24, 31], np.int32))
    want = interpret(b.graph, inputs, b.weights)["logits"]
    parts = [load_rank(load(DATA / fixture), 2, r, act=F32, max_seq=32)[0] for r in range(2)]
    outs = _interpret([(p.graph, p.weights) for p in parts], inputs)
    for o in outs:
        assert np.abs(o["logits"] - want).max() / np.abs(want).max() <= 1e-5


def test_heads_that_cannot_end_on_o_projs_groups_are_refused_naming_the_tensor():
    # group size 128, heads of 64 under 2 KV heads: 4 ranks would give each KV head's 2 heads
    # to 2 ranks, 64 inputs of o_proj each; every rank says so
    for fixture, fmt in (
        ("ct_w4a16_qwen2", r"ct_int<bits=4,group_size=128,scale_dtype=bf16>"),
        ("fp8block_qwen3", r"fp8_block<block_out=128,block_in=128>"),
    ):
        b = build(load(DATA / fixture), "model", 0, act=F32, max_seq=32)
        for r in range(4):
            with pytest.raises(
                TensorParallelError,
                match=r"^tensor_parallel: %l0.attn's 2 heads per KV head make 1 part\(s\) of "
                r"whole heads on the groups of 128 inputs of model.layers.0.self_attn.o_proj "
                rf"\({re.escape(fmt)}\) where 2 ranks share each of its 2 KV heads$",
            ):
                TensorParallel(4, r).run(b.graph.copy())


@pytest.mark.parametrize("fixture", ["mixtral_mlx4_g64", "mixtral_awq_gemm_g64"])
def test_moe_experts_split_by_rows_equal_the_unsplit_model(fixture):
    b = build(load(DATA / fixture), "model", 0, act=F32, max_seq=32)
    inputs = b.token_inputs(np.array([3, 10, 17, 24, 31], np.int32))
    want = interpret(b.graph, inputs, b.weights)["logits"]
    parts, fired = _ranks(b.graph, b.weights, 2)
    layers = len(b.graph.of_op("attention"))
    assert fired == 8 * layers + 1  # q k v o, the experts' gate up down, the router replicated
    for r, (g, _) in enumerate(parts):
        text = print_graph(g)
        # every expert's intermediate features halved; the residual in rank 0's combine only
        assert "experts<6, qweight<" in text and "[64, 256]>" in text and "[256, 64]>" in text
        combine = "combine_residual" if r == 0 else "combine"
        assert text.count(f'epilogue="{combine}"') == layers
        assert text.count("= all_reduce") == 2 * layers and text.count("= route") == layers
    for o in _interpret(parts, inputs):
        assert np.abs(o["logits"] - want).max() / np.abs(want).max() <= 1e-5


def test_a_shared_expert_is_split_like_the_dense_mlp_and_added_once(tmp_path):
    from tests.moe_common import qwen2moe_g32

    b = build(load(qwen2moe_g32(tmp_path / "qwen2moe")), "model", 0, act=F32, max_seq=32)
    inputs = b.token_inputs(np.array([3, 10, 17, 24, 31], np.int32))
    want = interpret(b.graph, inputs, b.weights)["logits"]
    parts, fired = _ranks(b.graph, b.weights, 2)
    layers = len(b.graph.of_op("attention"))
    assert fired == 11 * layers + 1  # as Mixtral's, and the shared expert's gate up down
    for r, (g, _) in enumerate(parts):
        text = print_graph(g)
        # the shared expert's 128 features halved, its gate replicated; its part joins the
        # routed combine, the residual in rank 0's only, one all_reduce after both
        assert "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>[64, 128]" in text
        assert text.count("experts<1, qweight<") == layers and "[128, 64]>" in text
        assert text.count("= all_reduce") == 2 * layers
        shared = re.findall(r"%l\d\.shared_y = expert_qlinear .*", text)
        routed = re.findall(r"%l\d\.y = expert_qlinear .*", text)
        assert len(shared) == len(routed) == layers
        for s, y in zip(shared, routed, strict=True):
            assert ('epilogue="combine_residual"' in s) == (r == 0)
            assert '.shared_y {epilogue="combine_residual"}' in y  # on every rank
    outs = _interpret(parts, inputs)
    for o in outs:
        assert np.abs(o["logits"] - want).max() / np.abs(want).max() <= 1e-5
    np.testing.assert_array_equal(outs[0]["logits"], outs[1]["logits"])


def test_moe_experts_narrower_than_a_group_per_rank_are_refused():
    # Qwen3-MoE's experts (layer 1) have 64 intermediate features in one group of 64: 2 ranks
    # cannot share it (a rank with no features would have no weights)
    with pytest.raises(
        TensorParallelError,
        match=r"^tensor_parallel: model.layers.1.mlp.switch_mlp.down_proj has 64 inputs in 1 "
        r"group\(s\) of 64 that no rank may cut \(mlx_affine<bits=4,group_size=64,"
        r"scale_dtype=bf16>\), fewer than 2 ranks$",
    ):
        load_rank(load(DATA / "qwen3moe_mlx4_g64"), 2, 0, act=F32, max_seq=32)


DENSE = "qweight<dense<dtype=bf16>>"
# gpt-oss's attention: 4 heads of 16 over 2 KV heads, q/k/v/o biases, a window, sinks
SINKS = f"""
graph attn {{
  %x = input : f32[M, 64]
  %pos = input : i32[M]
  %w_q = weight {{key="q"}} : {DENSE}[64, 64]+bias
  %q = qlinear %x, %w_q : f32[M, 64]
  %w_k = weight {{key="k"}} : {DENSE}[32, 64]+bias
  %k = qlinear %x, %w_k : f32[M, 32]
  %w_v = weight {{key="v"}} : {DENSE}[32, 64]+bias
  %v = qlinear %x, %w_v : f32[M, 32]
  %kc = state {{key="kc"}} : f32[16, 2, 16]
  %vc = state {{key="vc"}} : f32[16, 2, 16]
  %kv = kv_append %kc, %vc, %k, %v, %pos {{window=4}} : (f32[16, 2, 16], f32[16, 2, 16])
  %kv.k = get %kv {{index=0}} : f32[16, 2, 16]
  %kv.v = get %kv {{index=1}} : f32[16, 2, 16]
  %sinks = weight {{key="sinks"}} : f32[4]
  %attn = attention %q, %kv.k, %kv.v, %pos, %sinks {{scale=0.25, sinks=true, window=4}} : f32[M, 64]
  %w_o = weight {{key="o"}} : {DENSE}[64, 64]+bias
  %o = qlinear %attn, %w_o : f32[M, 64]
  %y = add %x, %o : f32[M, 64]
  output y = %y
}}
"""


def test_attention_sinks_are_split_with_their_ranks_heads():
    """Rank r of 4 keeps query head r, its sink and q's bias rows, the KV head it reads
    (replicated: 2 KV heads) with k/v's bias rows, o's inputs of its head; o's bias is added
    on rank 0 only. Every rank equals the unsplit block past the window."""
    g = parse(SINKS)
    assert TensorParallel(4, 1).run(g) == 6  # q, k, v, the caches, o and the sinks
    text = print_graph(g)
    assert (
        '%sinks.out1 = weight {key="sinks:out1-2", shard=["sinks", "out", 1, 2, 4]} : f32[1]'
        in text
    )
    assert "attention %q, %kv.k, %kv.v, %pos, %sinks.out1 {" in text
    assert (
        f'%w_q.out16 = weight {{key="q:out16-32", shard=["q", "out", 16, 32, 64]}} : {DENSE}[16, 64]+bias'
        in text
    )
    assert (
        f'%w_k.out0 = weight {{key="k:out0-16", shard=["k", "out", 0, 16, 32]}} : {DENSE}[16, 64]+bias'
        in text
    )
    assert f"{DENSE}[64, 16] =" not in text and f"{DENSE}[64, 16]\n" in text  # o: no bias
    assert '%kc = state {key="kc"} : f32[16, 1, 16]' in text
    g0 = parse(SINKS)
    TensorParallel(4, 0).run(g0)
    assert f"{DENSE}[64, 16]+bias" in print_graph(g0)  # o's bias is rank 0's to add
    rng = np.random.default_rng(0)
    weights = weights_for(SINKS, rng)
    for key in ("q", "k", "v", "o"):
        weights[key]["bias"] = rng.standard_normal(weights[key]["weight"].shape[0]).astype(
            np.float32
        )
    weights["sinks"]["weight"] = rng.standard_normal(4).astype(np.float32)
    m = 9  # positions 0..8 over a window of 4
    inputs = {
        "x": rng.standard_normal((m, 64)).astype(np.float32),
        "pos": np.arange(m, dtype=np.int32),
    }
    want = interpret(parse(SINKS), inputs, weights)["y"]
    for n in (2, 4):
        parts, fired = _ranks(parse(SINKS), weights, n)
        assert fired == 6
        for o in _interpret(parts, inputs):
            np.testing.assert_allclose(o["y"], want, rtol=1e-5, atol=1e-6)
    # the sinks matter: without them the outputs differ
    plain = SINKS.replace(", %sinks {scale=0.25, sinks=true,", " {scale=0.25,")
    assert np.abs(interpret(parse(plain), inputs, weights)["y"] - want).max() > 1e-3


def test_gptoss_splits_on_two_ranks_and_refuses_four_in_one_line():
    """gpt-oss (sinks, q/k/v/o and expert biases, sliding-window layers, MXFP4 experts) read
    from each rank's shards equals the unsplit model; at 4 ranks each expert's down_proj would
    be cut inside a 32-input MX block."""
    b = build(load(DATA / "gptoss_mxfp4"), "model", 0, act=F32, max_seq=32)
    inputs = b.token_inputs(np.arange(3, 15, dtype=np.int32))  # 12 positions, a window of 8
    want = interpret(b.graph, inputs, b.weights)["logits"]
    parts = [load_rank(load(DATA / "gptoss_mxfp4"), 2, r, act=F32, max_seq=32)[0] for r in range(2)]
    for r, p in enumerate(parts):
        text = print_graph(p.graph)
        assert text.count(": f32[2]") == 3  # each layer's sinks: the rank's 2 heads
        assert f'key="model.layers.0.self_attn.sinks:out{2 * r}-{2 * r + 2}"' in text
        assert (
            text.count("experts<4, qweight<mxfp4<>>[128, 32]" + ("+bias" if r == 0 else ">")) == 3
        )
        assert text.count("experts<4, qweight<mxfp4<>>[32, 128]+bias>") == 6  # gate and up
    outs = _interpret([(p.graph, p.weights) for p in parts], inputs)
    for o in outs:
        assert np.abs(o["logits"] - want).max() / np.abs(want).max() <= 1e-5
    with pytest.raises(
        TensorParallelError,
        match=r"^tensor_parallel: model.layers.0.mlp.experts.down_proj has 64 inputs in 2 "
        r"group\(s\) of 32 that no rank may cut \(mxfp4<>\), fewer than 4 ranks$",
    ):
        load_rank(load(DATA / "gptoss_mxfp4"), 4, 0, act=F32, max_seq=32)
