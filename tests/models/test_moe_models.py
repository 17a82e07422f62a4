"""Mixtral checkpoints end to end: mlx-lm's stacked experts (switch_mlp) and AutoAWQ's one
module per expert, against transformers' own MixtralForCausalLM in float32 on the tool-decoded
weights (tests/data/mixtral_*/ORACLE.md): the routing, each expert's decode, layers, logits and
greedy ids in the interpreter and on the host backend (f32 within 1e-3, 16-bit within the layer
bound); the plan's bytes per token; bad checkpoints refused in one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import qir
from qir import moe
from qir.cli import main
from qir.dtypes import F32
from qir.formats.base import FormatError
from qir.interpret import evaluate
from qir.models import Model, load
from qir.models.blocks import build
from qir.models.experts import Moe, is_moe_layer, moe_of, read_experts
from tests.conftest import DATA, greedy_prefix, max_rel
from tests.moe_common import copy_fixture, edit_config, edit_tensors, mixtral_nvfp4, refused

MLX, AWQ = "mixtral_mlx4_g64", "mixtral_awq_gemm_g64"
GOLDEN_TOL = 2e-2  # 16-bit activations against transformers' float32 (the layer tests' bound)


@pytest.mark.parametrize("fixture", [MLX, AWQ])
def test_each_expert_decodes_as_the_tool_does(fixture: str) -> None:
    ck, golden = load(DATA / fixture), np.load(DATA / fixture / "golden.npz")
    spec = moe_of(ck)
    assert spec is not None and (spec.experts, spec.top_k, spec.architecture.rule) == (
        6,
        2,
        "softmax_topk_norm",
    )
    for proj, name in zip(("gate", "up", "down"), ("w1", "w3", "w2"), strict=True):
        key, experts, bufs = read_experts(ck, spec, 0, proj)
        assert key.endswith(
            "switch_mlp." + proj + "_proj" if fixture == MLX else f"experts.*.{name}"
        )
        for e in range(6):
            w = experts.format.dequantize(
                {b: a[e] for b, a in bufs.items()}, experts.out_features, experts.in_features
            )
            np.testing.assert_array_equal(w, golden[f"W.0.experts.{e}.{name}"])


@pytest.mark.parametrize("fixture", [MLX, AWQ])
def test_interpreter_routes_and_runs_layers_as_transformers(fixture: str) -> None:
    """Both layers alone (the routing, the experts and the combine inside), and the router's
    choices against torch's own topk."""
    ck, golden = load(DATA / fixture), np.load(DATA / fixture / "golden.npz")
    model_golden = np.load(DATA / fixture / "golden_model.npz")
    for layer in (0, 1):
        b = build(ck, "layer", layer, F32)
        for m in (1, 5, 40):
            x = golden[f"x.M{m}"].astype(np.float32)
            env = evaluate(b.graph, b.inputs(x), b.weights)
            assert max_rel(env["y"], model_golden[f"layer.{layer}.M{m}"]) <= 1e-4, (layer, m)
        mlp = build(ck, "mlp", layer, F32)  # the MoE block on x itself (no norm) + x
        for m in (5, 40):
            x = golden[f"x.M{m}"].astype(np.float32)
            env = evaluate(mlp.graph, {"x": x}, mlp.weights)
            np.testing.assert_array_equal(env["route.ids"], golden[f"route_ids.{layer}.M{m}"])
            np.testing.assert_allclose(
                env["route.weights"], golden[f"route_weights.{layer}.M{m}"], rtol=1e-5
            )
            assert max_rel(env["router"], golden[f"router.{layer}.M{m}"]) <= 1e-5
            assert max_rel(env["y"] - x, golden[f"moe.{layer}.M{m}"]) <= 1e-5


@pytest.mark.parametrize("fixture", [MLX, AWQ])
def test_host_f32_logits_and_greedy_ids_match_transformers(fixture: str) -> None:
    golden = np.load(DATA / fixture / "golden_model.npz")
    model = Model.load(DATA / fixture, act=F32, backend="host")
    assert max_rel(model.logits(golden["tokens"]), golden["logits"]) <= 1e-3
    gen = model.generate(golden["tokens"], 8, do_sample=False)
    assert max_rel(gen.logits, golden["step_logits"]) <= 1e-3
    np.testing.assert_array_equal(gen.tokens, golden["greedy"])


@pytest.mark.parametrize("fixture", [MLX, AWQ])
def test_host_16_bit_model_within_the_layer_bound(fixture: str) -> None:
    """The checkpoint's own dtype (MLX bf16, AutoAWQ f16): the prefill logits within the
    layer bound of transformers' float32; greedy ids equal up to the first step whose margin
    16-bit arithmetic may break (2 of 8 in bf16: at step 2 the margin is 0.047)."""
    golden = np.load(DATA / fixture / "golden_model.npz")
    model = Model.load(DATA / fixture, backend="host")
    assert max_rel(model.logits(golden["tokens"]), golden["logits"]) <= GOLDEN_TOL
    gen = model.generate(golden["tokens"], 8, do_sample=False)
    n = greedy_prefix(golden["step_logits"], gen.logits)
    assert n >= 2
    np.testing.assert_array_equal(gen.tokens[:n], golden["greedy"][:n])


def _plan(tmp_path: Path, fixture: str, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    argv = ["-q", "compile", str(DATA / fixture), "--block", "model", "--max-seq", "16"]
    assert main([*argv, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_compile_reports_total_and_active_weight_bytes_and_launches(tmp_path: Path) -> None:
    plan = _plan(tmp_path, MLX, "--m", "1")
    mem = plan["memory"]
    ck = load(DATA / MLX)
    experts = sum(
        a.nbytes
        for layer in (0, 1)
        for proj in ("gate", "up", "down")
        for a in read_experts(ck, moe_of(ck), layer, proj)[2].values()
    )
    assert mem["weights_bytes"] - mem["active_weights_bytes"] == experts * 4 // 6  # 2 of 6 read
    kernels = [k for k in plan["kernels"] if k["nodes"][0].startswith("l0.")]
    per_layer = [k["name"] for k in kernels]
    # attention: q/k/v (norm prologue), kv append, split attention, its combine, o + residual;
    # MoE: the router and the gate/up of the chosen experts (both with the post-attention norm
    # as their prologue), route, down + combine + residual
    assert len(per_layer) == 9, per_layer
    assert [n.split("_")[1] for n in per_layer[-3:]] == ["route", "gemv", "gemv"]
    normed = [k["name"] for k in kernels if "l0.mlp_norm" in k["nodes"]]
    assert normed == [per_layer[5], per_layer[7]] and all("_rmsnorm_" in n for n in normed)


def test_bad_moe_checkpoints_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy_fixture(tmp_path, AWQ)
    edit_config(path, num_experts_per_tok=7)
    assert "num_experts_per_tok 7 is above num_local_experts 6" in refused(path, capsys)
    edit_config(path, num_experts_per_tok=2, num_local_experts=7)
    assert "block_sparse_moe.gate.weight: holds a [6, 256] router" in refused(path, capsys)
    edit_config(path, num_local_experts=6)

    def missing(t: dict) -> None:
        del t["model.layers.0.block_sparse_moe.experts.4.w3.scales"]

    edit_tensors(path, missing)
    assert "model.layers.0.block_sparse_moe.experts.4.w3.scales: missing" in refused(path, capsys)

    def swapped(t: dict) -> None:  # expert 3's gate holds its down projection (and 4's up is back)
        pre = "model.layers.0.block_sparse_moe.experts"
        for part in ("qweight", "qzeros", "scales"):
            t[f"{pre}.3.w1.{part}"] = t[f"{pre}.3.w2.{part}"]
        t[f"{pre}.4.w3.scales"] = t[f"{pre}.4.w1.scales"]

    edit_tensors(path, swapped)
    err = refused(path, capsys)
    assert (
        "experts.3.w1.weight: holds a [256, 128] expert, but config.json implies [128, 256]" in err
    )

    def dense(t: dict) -> None:  # layer 1's expert 2 up unquantized (and layer 0 whole again)
        pre = "model.layers.1.block_sparse_moe.experts.2.w3"
        for part in ("qweight", "qzeros", "scales"):
            del t[f"{pre}.{part}"]
        t[f"{pre}.weight"] = np.zeros((128, 256), np.float16)
        pre0 = "model.layers.0.block_sparse_moe.experts"
        for part in ("qweight", "qzeros", "scales"):
            t[f"{pre0}.3.w1.{part}"] = t[f"{pre0}.2.w1.{part}"]

    edit_tensors(path, dense)
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    edit_config(
        path,
        quantization_config={
            **q,
            "modules_to_not_convert": ["gate", "layers.1.block_sparse_moe.experts.2.w3"],
        },
    )
    err = refused(path, capsys)
    assert (
        "experts.2.w3: dense<dtype=f16> differs from" in err and "awq<bits=4,group_size=64>" in err
    )


def test_expert_biases_join_the_chosen_experts_sums(tmp_path: Path) -> None:
    """A bias on one expert's down projection (one module per expert, AutoAWQ's): the MoE block
    moves by that bias times the router's weight, on the tokens that chose the expert, and
    nowhere else (the interpreter and the host backend's expert GEMVs)."""
    path = copy_fixture(tmp_path, AWQ)
    bias = np.linspace(-1, 1, 256, dtype=np.float32).astype(np.float16)

    def biased(t: dict) -> None:
        t["model.layers.0.block_sparse_moe.experts.1.w2.bias"] = bias
        for e in (0, *range(2, 6)):  # one projection's experts share one type: zeros for the rest
            t[f"model.layers.0.block_sparse_moe.experts.{e}.w2.bias"] = np.zeros(256, np.float16)

    edit_tensors(path, biased)
    golden = np.load(DATA / AWQ / "golden.npz")
    block = build(load(path), "mlp", 0, F32)
    host = qir.compile(block.graph, block.weights, backend="host")
    for m in (5, 40):
        x = golden[f"x.M{m}"].astype(np.float32)
        ids, rw = golden[f"route_ids.0.M{m}"], golden[f"route_weights.0.M{m}"]
        shift = ((ids == 1) * rw).sum(axis=1)[:, None] * bias.astype(np.float32)[None]
        assert shift.any() and not shift.all()  # some tokens chose expert 1, some did not
        want = golden[f"moe.0.M{m}"] + shift
        assert max_rel(evaluate(block.graph, {"x": x}, block.weights)["y"] - x, want) <= 1e-5
        if m == 5:
            assert max_rel(host({"x": x})["y"] - x, want) <= 1e-3


def test_stacked_experts_of_another_count_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy_fixture(tmp_path, MLX)
    ck = load(path)
    spec = moe_of(ck)
    assert spec is not None
    with pytest.raises(
        FormatError, match=r"switch_mlp.gate_proj.biases: shape \[6, 128, 4\], expected 5"
    ):
        read_experts(ck, Moe(spec.architecture, 5, 2, 128, spec.rule, spec.count_key), 0, "gate")
    edit_config(path, num_local_experts=5)
    assert "block_sparse_moe.gate.weight: holds a [6, 256] router" in refused(path, capsys)


def test_route_rule_matches_torchs_topk_on_the_fixture_router() -> None:
    """The rule on transformers' own router logits gives torch's ids and weights."""
    golden = np.load(DATA / AWQ / "golden.npz")
    for layer in (0, 1):
        for m in (1, 5, 40):
            ids, w = moe.route(golden[f"router.{layer}.M{m}"], 2, "softmax_topk_norm")
            np.testing.assert_array_equal(ids, golden[f"route_ids.{layer}.M{m}"])
            np.testing.assert_allclose(w, golden[f"route_weights.{layer}.M{m}"], rtol=1e-6)


QWEN = "qwen3moe_mlx4_g64"


def test_qwen3_moe_layers_follow_mlp_only_layers_and_norm_topk_prob() -> None:
    """Layer 0 is a dense MLP (mlp_only_layers), layer 1 routes 3 of 8 experts weighted by
    their probabilities over all 8 (norm_topk_prob false) through an 8-bit router; both against
    transformers' Qwen3MoeForCausalLM blocks in float32."""
    ck, golden = load(DATA / QWEN), np.load(DATA / QWEN / "golden.npz")
    spec = moe_of(ck)
    assert spec is not None and (spec.experts, spec.top_k, spec.rule) == (8, 3, "softmax_topk")
    assert spec.count_key == "num_experts"
    dense, routed = build(ck, "mlp", 0, F32), build(ck, "mlp", 1, F32)
    assert not dense.graph.of_op("expert_qlinear") and routed.graph.of_op("route")
    for m in (1, 5, 40):
        x = golden[f"x.M{m}"].astype(np.float32)
        y = evaluate(dense.graph, {"x": x}, dense.weights)["y"]
        assert max_rel(y, golden[f"mlp.0.M{m}"]) <= 1e-5
        env = evaluate(routed.graph, {"x": x}, routed.weights)
        np.testing.assert_array_equal(env["route.ids"], golden[f"route_ids.1.M{m}"])
        np.testing.assert_allclose(env["route.weights"], golden[f"route_weights.1.M{m}"], rtol=1e-5)
        assert max_rel(env["y"] - x, golden[f"moe.1.M{m}"]) <= 1e-5
    key, experts, bufs = read_experts(ck, spec, 1, "down")
    assert key == "model.layers.1.mlp.switch_mlp.down_proj" and experts.count == 8
    for e in range(8):
        w = experts.format.dequantize({b: a[e] for b, a in bufs.items()}, 256, 64)
        np.testing.assert_array_equal(w, golden[f"W.1.experts.{e}.down_proj"])


def test_qwen3_moe_block_on_the_host_backend() -> None:
    """The routed block with its residual on the host backend: f32 within 1e-3 of
    transformers, bf16 within the layer bound."""
    ck, golden = load(DATA / QWEN), np.load(DATA / QWEN / "golden.npz")
    for act, tol in ((F32, 1e-3), (ck.act_dtype, GOLDEN_TOL)):
        b = build(ck, "mlp", 1, act)
        c = qir.compile(b.graph, b.weights, backend="host")
        for m in (1, 5):
            x = golden[f"x.M{m}"].astype(act.np)
            want = x.astype(np.float32) + golden[f"moe.1.M{m}"]  # y = x + the MoE block
            assert max_rel(c({"x": x})["y"], want) <= tol, (act, m)


QWEN2 = "qwen2moe_mlx4_g64"


def test_qwen2_moe_shared_expert_and_routing_match_transformers() -> None:
    """Both layers' MoE blocks (softmax over 6, top 2 not renormalised, plus the shared expert
    scaled by sigmoid(shared_expert_gate x)) against transformers' Qwen2MoeSparseMoeBlock in
    float32: the routing, the shared part on its own, the whole block; the shared expert's
    weights decode as mlx does, and without it the block is far off."""
    ck, golden = load(DATA / QWEN2), np.load(DATA / QWEN2 / "golden.npz")
    spec = moe_of(ck)
    assert spec is not None
    assert (spec.experts, spec.top_k, spec.rule, spec.shared) == (6, 2, "softmax_topk", 128)
    for layer in (0, 1):
        b = build(ck, "mlp", layer, F32)
        for m in (1, 5, 40):
            x = golden[f"x.M{m}"].astype(np.float32)
            env = evaluate(b.graph, {"x": x}, b.weights)
            np.testing.assert_array_equal(env["route.ids"], golden[f"route_ids.{layer}.M{m}"])
            np.testing.assert_allclose(
                env["route.weights"], golden[f"route_weights.{layer}.M{m}"], rtol=1e-5
            )
            np.testing.assert_array_equal(env["shared_route.ids"], 0)
            assert max_rel(env["shared_y"] - x, golden[f"shared.{layer}.M{m}"]) <= 1e-5
            assert max_rel(env["y"] - x, golden[f"moe.{layer}.M{m}"]) <= 1e-5
            assert max_rel(env["y"] - env["shared_y"], golden[f"moe.{layer}.M{m}"]) > 0.1
    # layer 0's shared expert as mlx decodes it, and its gate's sigmoid as route weighs it
    base = "model.layers.0.mlp"
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = ck.linear(f"{base}.shared_expert.{name}")
        w = lin.weight.format.dequantize(lin.buffers, lin.weight.out_features, 128)
        np.testing.assert_array_equal(w, golden[f"W.0.shared.{name}"])
    x, b = golden["x.M40"].astype(np.float32), build(ck, "mlp", 0, F32)
    env = evaluate(b.graph, {"x": x}, b.weights)
    gate = x.astype(np.float64) @ golden["W.0.shared_gate"].T.astype(np.float64)
    np.testing.assert_allclose(env["shared_route.weights"], 1 / (1 + np.exp(-gate)), rtol=1e-5)


def test_qwen2_moe_host_f32_logits_and_greedy_ids_match_transformers() -> None:
    golden = np.load(DATA / QWEN2 / "golden_model.npz")
    model = Model.load(DATA / QWEN2, act=F32, backend="host")
    assert max_rel(model.logits(golden["tokens"]), golden["logits"]) <= 1e-3
    gen = model.generate(golden["tokens"], 8, do_sample=False)
    assert max_rel(gen.logits, golden["step_logits"]) <= 1e-3
    np.testing.assert_array_equal(gen.tokens, golden["greedy"])


def test_qwen2_moe_block_in_bf16_on_both_kernel_families() -> None:
    """The MoE block with its shared expert in the checkpoint's bf16 on the host: the expert
    GEMVs at M = 1 and the grouped path (the shared expert as a group of one) at M = 40, within
    the layer bound of transformers' float32 and of the interpreter. (x.M5's row 0 has two
    router logits 7.6e-5 apart: bf16 sums choose either.)"""
    ck, golden = load(DATA / QWEN2), np.load(DATA / QWEN2 / "golden.npz")
    b = build(ck, "mlp", 1, ck.act_dtype)
    c = qir.compile(b.graph, b.weights, backend="host")
    ref = qir.compile(b.graph, b.weights, backend="reference")
    assert c.plan is not None
    names = {la.kernel.name for la in c.plan.launches}
    assert {"moe_route_bf16_e1_top1_sigmoid_topk", "moe_group_e1_top1"} <= names
    for m in (1, 40):
        x = golden[f"x.M{m}"].astype(ck.act_dtype.np)
        y = c({"x": x})["y"]
        assert max_rel(y, x.astype(np.float32) + golden[f"moe.1.M{m}"]) <= GOLDEN_TOL, m
        assert max_rel(y, ref({"x": x})["y"]) <= GOLDEN_TOL, m


def test_qwen2_moe_decode_layer_is_12_launches(tmp_path: Path) -> None:
    """Mixtral's 9, plus the shared expert's three: its gate/up pair (merged apart from the
    router, silu(g) * u its epilogue), its gate's sigmoid (route), its down (an expert GEMV of
    one expert whose combine adds the residual; the routed down then adds that). The router and
    the shared expert's gate share one launch; it, the shared gate/up and the routed gate/up
    each normalise their input (the post-attention norm has no launch)."""
    plan = _plan(tmp_path, QWEN2, "--m", "1")
    per_layer = [k for k in plan["kernels"] if k["nodes"][0].startswith("l0.")]
    assert len(per_layer) == 12, [k["name"] for k in per_layer]
    normed = [k["nodes"][0] for k in per_layer if "l0.mlp_norm" in k["nodes"]]
    assert normed == ["l0.shared_h", "l0.router_l0.shared_expert_gate", "l0.experts_h"]
    assert all("_rmsnorm_wbf16" in k["name"] for k in per_layer if "l0.mlp_norm" in k["nodes"])
    mlp = {k["name"].split("_k")[0]: k["nodes"][0] for k in per_layer[5:]}
    assert mlp == {
        "qgemv_mlx4g64bf16_bf16_n128_128": "l0.shared_h",
        "qgemv_mlx4g64bf16_bf16_n6_1": "l0.router_l0.shared_expert_gate",
        "moe_route_bf16_e6_top2_softmax_topk": "l0.route",
        "moe_route_bf16_e1_top1_sigmoid_topk": "l0.shared_route",
        "moe_gemv_mlx4g64bf16_bf16_e1top1_n128": "l0.shared_y",
        "moe_gemv_mlx4g64bf16_bf16_e6top2_n64": "l0.experts_h",
        "moe_gemv_mlx4g64bf16_bf16_e6top2_n128": "l0.y",
    }


def test_bad_shared_experts_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy_fixture(tmp_path, QWEN2)
    edit_config(path, shared_expert_intermediate_size=96)
    assert (
        "mlp.shared_expert.gate_proj.weight: holds a [128, 128] linear, but config.json implies "
        "[96, 128] (shared_expert_intermediate_size, hidden_size)"
    ) in refused(path, capsys)
    edit_config(path, shared_expert_intermediate_size=None)
    assert "lacks shared_expert_intermediate_size" in refused(path, capsys)
    edit_config(path, shared_expert_intermediate_size=128)

    def wide_gate(t: dict) -> None:  # a gate of two rows
        for part in ("weight", "scales", "biases"):
            name = f"model.layers.1.mlp.shared_expert_gate.{part}"
            t[name] = np.concatenate([t[name], t[name]])

    edit_tensors(path, wide_gate)
    assert (
        "model.layers.1.mlp.shared_expert_gate.weight: holds a [2, 128] linear, but config.json "
        "implies [1, 128]"
    ) in refused(path, capsys)


def test_qwen2_moe_qkv_biases_follow_qkv_bias(tmp_path: Path) -> None:
    """q/k/v biases are implied (transformers 5's qkv_bias, default true): without them the
    checkpoint is refused naming the tensor, unless qkv_bias is false."""
    path = copy_fixture(tmp_path, QWEN2)
    assert load(path).features.biases == ("q", "k", "v")

    def unbiased(t: dict) -> None:
        for name in [n for n in t if n.endswith("_proj.bias")]:
            del t[name]

    edit_tensors(path, unbiased)
    (path / "model.safetensors.index.json").unlink()  # it lists the biases
    with pytest.raises(FormatError, match=r"q_proj.bias: missing \(model_type 'qwen2_moe'"):
        _ = load(path).features
    edit_config(path, qkv_bias=False)
    assert load(path).features.biases == ()


def test_qwen2_moe_dense_layers_follow_decoder_sparse_step_and_mlp_only_layers(
    tmp_path: Path,
) -> None:
    """As transformers' Qwen2MoeDecoderLayer: a layer routes when it is not in mlp_only_layers
    and its index + 1 is a multiple of decoder_sparse_step; the others are dense MLPs (here
    their mlp.gate_proj is missing, and the refusal names it)."""
    path = copy_fixture(tmp_path, QWEN2)
    for changes, routed in (
        ({}, [True, True]),
        ({"decoder_sparse_step": 2}, [False, True]),
        ({"decoder_sparse_step": 1, "mlp_only_layers": [1]}, [True, False]),
    ):
        edit_config(path, **changes)
        ck = load(path)
        assert [is_moe_layer(ck, layer) for layer in (0, 1)] == routed, changes
    with pytest.raises(FormatError, match=r"model\.layers\.1\.mlp\.gate_proj"):
        build(ck, "mlp", 1, F32)


def test_modelopt_nvfp4_w4a4_experts_run_4_bit_activations_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ModelOpt NVFP4 W4A4 Mixtral (the AWQ fixture's weights re-quantized, every expert its
    own calibrated input scale: tests/moe_common.mixtral_nvfp4): its decode layer runs the
    experts' W4A4 GEMVs (12 launches: W4A16's 9, the post-attention norm's own launch, which
    the experts' quantization reads, and the attention's two quantize_act); host
    f32 logits and greedy ids equal the interpreter's, whose W4A4 numbers differ from W4A16's;
    `qir run --audit` reports the experts' W4A4 error."""
    path = mixtral_nvfp4(tmp_path / "mixtral_nvfp4")
    plan = tmp_path / "plan.json"
    argv = ["-q", "compile", str(path), "--block", "model", "--max-seq", "16", "--m", "1"]
    assert main([*argv, "--json", str(plan)]) == 0
    kernels = json.loads(plan.read_text())["kernels"]
    layer = [k["name"] for k in kernels if k["nodes"][0].startswith("l0.")]
    assert len(layer) == 12 and [n.split("_")[0] for n in layer].count("quantize") == 2, layer
    assert layer[-2].endswith("_silumul_a4mul") and layer[-1].endswith(
        "_combine_res_slots_in_a4mul"
    )
    tokens = np.load(DATA / AWQ / "golden_model.npz")["tokens"]
    ref = Model.load(path, act=F32)
    want = ref.logits(tokens)
    w4a16 = Model.load(path, act=F32, weight_quantization="w4a16").logits(tokens)
    assert max_rel(w4a16, want) > 1e-2
    host = Model.load(path, act=F32, backend="host")
    assert max_rel(host.logits(tokens), want) <= 1e-5
    gen, ref_gen = (m.generate(tokens, 4, do_sample=False) for m in (host, ref))
    np.testing.assert_array_equal(gen.tokens, ref_gen.tokens)
    assert max_rel(gen.logits, ref_gen.logits) <= 1e-5
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32))
    capsys.readouterr()
    run = ["run", str(path), "--block", "mlp", "--input", str(x), "--out", str(tmp_path / "o.npz")]
    assert main([*run, "--audit"]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    rows = {ln.split()[0]: [float(v) for v in ln.split()[1:]] for ln in lines}
    assert sorted(rows) == ["experts_h", "y"]  # gate/up and down + combine: the experts
    for w4a4_vs_w4a16, w4a4_vs_f32, w4a16_vs_f32 in rows.values():
        assert 0.01 < w4a4_vs_w4a16 < 0.5 and w4a16_vs_f32 < 0.01 < w4a4_vs_f32
