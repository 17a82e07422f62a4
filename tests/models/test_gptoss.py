"""gpt-oss end to end (tests/data/gptoss_mxfp4/ORACLE.md): the Hub's stacked MXFP4 experts
(interleaved gate/up rows, expert biases), the router's top-k-then-softmax, the clamped SwiGLU,
attention sinks, sliding layers from layer_types and YaRN RoPE (truncate false), against
transformers' own GptOssForCausalLM in float32 on its Mxfp4Config(dequantize=True) weights; bad
checkpoints refused in one line (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from qir.cli import main
from qir.dtypes import F32
from qir.interpret import evaluate
from qir.models import Model, load
from qir.models.blocks import build
from qir.models.experts import gate_act, moe_of, read_experts
from tests.conftest import DATA, max_rel
from tests.moe_common import copy_fixture, edit_config, edit_tensors, refused

GPTOSS = "gptoss_mxfp4"


def test_stacked_mxfp4_experts_decode_as_transformers() -> None:
    """gate = rows 0::2 and up = rows 1::2 of gate_up_proj (transformers' _apply_gate), each
    with its rows of the bias; every expert's decode equals transformers' dequantized weights
    bit for bit."""
    ck, golden = load(DATA / GPTOSS), np.load(DATA / GPTOSS / "golden.npz")
    spec = moe_of(ck)
    assert spec is not None
    assert (spec.experts, spec.top_k, spec.rule, spec.intermediate) == (4, 2, "topk_softmax", 64)
    for layer in (0,):  # the golden holds layer 0's decode (the others: the layer tests)
        gate_up = golden[f"W.{layer}.gate_up"]
        stored = ck.tensor(f"model.layers.{layer}.mlp.experts.gate_up_proj_bias")
        for proj, want in (
            ("gate", gate_up[:, 0::2]),
            ("up", gate_up[:, 1::2]),
            ("down", golden[f"W.{layer}.down"]),
        ):
            _, experts, bufs = read_experts(ck, spec, layer, proj)
            assert experts.expert.bias and experts.format.kind == "mxfp4"
            for e in range(4):
                w = experts.format.dequantize(
                    {b: bufs[b][e] for b in ("weight", "scales")},
                    experts.out_features,
                    experts.in_features,
                )
                np.testing.assert_array_equal(w, want[e])
            if proj != "down":
                row = 0 if proj == "gate" else 1
                np.testing.assert_array_equal(bufs["bias"], stored[:, row::2].astype(np.float32))


def test_interpreter_layers_and_routing_match_transformers() -> None:
    """Each layer alone (sliding, full, sliding: sinks, biases, yarn inside) and its MoE block:
    torch's ids, its top-k-then-softmax weights and the block's output."""
    ck, golden = load(DATA / GPTOSS), np.load(DATA / GPTOSS / "golden.npz")
    model_golden = np.load(DATA / GPTOSS / "golden_model.npz")
    assert ck.features.windows == (8, None, 8)
    for layer in range(3):
        b = build(ck, "layer", layer, F32)
        for m in (1, 5, 40):
            x = golden[f"x.M{m}"].astype(np.float32)
            env = evaluate(b.graph, b.inputs(x), b.weights)
            assert max_rel(env["y"], model_golden[f"layer.{layer}.M{m}"]) <= 1e-5, (layer, m)
        mlp = build(ck, "mlp", layer, F32)
        for m in (5, 40):
            x = golden[f"x.M{m}"].astype(np.float32)
            env = evaluate(mlp.graph, {"x": x}, mlp.weights)
            assert max_rel(env["router"], golden[f"router.{layer}.M{m}"]) <= 1e-5
            np.testing.assert_array_equal(env["route.ids"], golden[f"route_ids.{layer}.M{m}"])
            np.testing.assert_allclose(
                env["route.weights"], golden[f"route_weights.{layer}.M{m}"], rtol=1e-5
            )
            assert max_rel(env["y"] - x, golden[f"moe.{layer}.M{m}"]) <= 1e-5


def test_each_feature_moves_the_logits() -> None:
    """The fixture exercises what it claims: without the sinks, the swiglu clamp, the expert
    biases or yarn's scaling the interpreter's layer 1 (full attention) leaves transformers'."""
    ck, golden = load(DATA / GPTOSS), np.load(DATA / GPTOSS / "golden_model.npz")
    x = np.load(DATA / GPTOSS / "golden.npz")["x.M40"].astype(np.float32)
    b = build(ck, "layer", 1, F32)
    want = golden["layer.1.M40"]
    assert max_rel(evaluate(b.graph, b.inputs(x), b.weights)["y"], want) <= 1e-5
    changes = {
        "sinks": lambda w: w["model.layers.1.self_attn.sinks"].update(
            weight=np.full(4, -1e30, np.float32)
        ),
        "biases": lambda w: [
            w[k].update(bias=np.zeros_like(w[k]["bias"])) for k in w if ".experts." in k
        ],
    }
    for what, change in changes.items():
        weights = {k: dict(v) for k, v in b.weights.items()}
        change(weights)
        assert max_rel(evaluate(b.graph, b.inputs(x), weights)["y"], want) > 1e-3, what
    graph = b.graph.copy()
    (h,) = [n for n in graph.of_op("expert_qlinear") if graph.node(n).attr("act")]
    graph.set_node(h, graph.node(h).with_attrs(limit=1e6))
    assert max_rel(evaluate(graph, b.inputs(x), b.weights)["y"], want) > 1e-3, "limit"


def test_host_f32_logits_and_greedy_ids_match_transformers() -> None:
    """20 prompt tokens and 8 greedy steps: the sliding layers' window of 8 (a ring cache) and
    the sinks in both the prefill and the decode attention kernels."""
    golden = np.load(DATA / GPTOSS / "golden_model.npz")
    model = Model.load(DATA / GPTOSS, act=F32, backend="host")
    assert max_rel(model.logits(golden["tokens"]), golden["logits"]) <= 1e-3
    gen = model.generate(golden["tokens"], 8, do_sample=False)
    assert max_rel(gen.logits, golden["step_logits"]) <= 1e-3
    np.testing.assert_array_equal(gen.tokens, golden["greedy"])


def test_a_decode_layer_is_10_launches(tmp_path: Path) -> None:
    """The 6 of attention (q/k/v with the input norm, q's YaRN rotation, kv append, split
    attention, its combine with the sinks, o + residual), then the biased router and the MXFP4
    gate/up (each with the post-attention norm as its prologue), route, down + combine +
    residual: the norm has no launch of its own."""
    out = tmp_path / "plan.json"
    argv = ["-q", "compile", str(DATA / GPTOSS), "--block", "model", "--max-seq", "16"]
    assert main([*argv, "--m", "1", "--json", str(out)]) == 0
    kernels = [k for k in json.loads(out.read_text())["kernels"] if k["nodes"][0].startswith("l0.")]
    assert len(kernels) == 10, [k["name"] for k in kernels]
    normed = [k["name"] for k in kernels if "l0.mlp_norm" in k["nodes"]]
    assert [n.split("_")[0] for n in normed] == ["qgemv", "moe"], normed
    assert all(n.endswith("_rmsnorm_wbf16") for n in normed), normed


def test_inspect_names_the_family_and_its_features(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["-q", "inspect", str(DATA / GPTOSS)]) == 0
    out = capsys.readouterr().out
    assert "architecture: gpt_oss (GptOssForCausalLM)" in out
    assert "attention sinks (model.layers.0.self_attn.sinks '[4]')" in out
    assert "sliding-window attention (layer_types '8 on 2 of 3 layers')" in out
    assert "rope_type yarn" in out and "truncate False" in out
    assert (
        "mixture of experts: 4 experts (num_local_experts), 2 per token (topk_softmax), gate/up "
        "swiglu_clamp (swiglu_limit 7.0, swiglu_alpha 1.702)" in out
    )
    # the stacked experts list as E x [out, in] (gate_up_proj's rows interleaved as stored)
    assert re.search(
        r"model.layers.2.mlp.experts.gate_up_proj +mxfp4<> +4 +32 +4 x \[128, 128\]", out
    )
    assert "23 linears" in out
    npy = tmp_path / "gu.npy"
    assert (
        main(
            [
                "-q",
                "dequant",
                str(DATA / GPTOSS),
                "model.layers.0.mlp.experts.gate_up_proj",
                "-o",
                str(npy),
            ]
        )
        == 0
    )
    np.testing.assert_array_equal(
        np.load(npy), np.load(DATA / GPTOSS / "golden.npz")["W.0.gate_up"]
    )


def test_bad_gpt_oss_checkpoints_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = copy_fixture(tmp_path, GPTOSS)
    # absent, the limit and alpha are transformers' GptOssConfig defaults, as it reads them
    cfg = json.loads((path / "config.json").read_text())
    del cfg["swiglu_limit"], cfg["swiglu_alpha"]
    (path / "config.json").write_text(json.dumps(cfg))
    ck = load(path)
    spec = moe_of(ck)
    assert spec is not None
    assert gate_act(ck, spec) == {"act": "swiglu_clamp", "limit": 7.0, "alpha": 1.702}
    edit_config(path, swiglu_limit=3.0)
    ck = load(path)
    assert gate_act(ck, spec)["limit"] == 3.0
    edit_config(path, swiglu_limit="7")
    assert "swiglu_limit is '7', expected" in refused(path, capsys)
    edit_config(path, swiglu_limit=-1.0)
    assert "swiglu_limit is -1.0, expected" in refused(path, capsys)
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    edit_config(path, swiglu_limit=7.0, rope_parameters={**rope, "truncate": "no"})
    assert "rope_parameters.truncate is 'no', expected" in refused(path, capsys)
    edit_config(path, rope_parameters=rope)

    def sinks(t: dict) -> None:
        t["model.layers.1.self_attn.sinks"] = t["model.layers.1.self_attn.sinks"][:3]

    edit_tensors(path, sinks)
    err = refused(path, capsys)
    assert "model.layers.1.self_attn.sinks: shape [3], expected [4] (num_attention_heads)" in err

    def no_bias(t: dict) -> None:
        t["model.layers.1.self_attn.sinks"] = np.zeros(4, np.float32)
        del t["model.layers.0.mlp.experts.down_proj_bias"]

    edit_tensors(path, no_bias)
    err = refused(path, capsys)
    assert "model.layers.0.mlp.experts.down_proj_bias: missing" in err

    def scales(t: dict) -> None:
        t["model.layers.0.mlp.experts.down_proj_bias"] = np.zeros((4, 128), np.float32)
        t["model.layers.2.mlp.experts.gate_up_proj_scales"] = t[
            "model.layers.2.mlp.experts.gate_up_proj_scales"
        ][:, :, :3]

    edit_tensors(path, scales)
    err = refused(path, capsys)
    assert "model.layers.2.mlp.experts.gate_up_proj_scales: uint8 [4, 128, 3], expected" in err
    edit_config(path, intermediate_size=32)
    err = refused(path, capsys)
    assert "gate_up_proj_blocks: holds [64, 128] experts (gate rows" in err


def test_yarn_reads_transformers_defaults(tmp_path: Path) -> None:
    """What transformers fills into a yarn config: beta_fast 32, beta_slow 1, truncate true,
    attention_factor 0.1 ln(factor) + 1 (or mscale / mscale_all_dim's ratio), and
    original_max_position_embeddings from the top level first, else max_position_embeddings."""
    path = copy_fixture(tmp_path, GPTOSS)
    assert load(path).rope == {
        "head_dim": 32,
        "theta": 150000.0,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "attention_factor": pytest.approx(0.1 * np.log(4.0) + 1.0),
    }
    bare = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0}
    edit_config(path, rope_parameters=bare)
    rope = load(path).rope
    assert (rope["truncate"], rope["beta_fast"], rope["beta_slow"]) == (True, 32.0, 1.0)
    assert rope["original_max_position_embeddings"] == 256  # max_position_embeddings
    edit_config(path, original_max_position_embeddings=128)
    assert load(path).rope["original_max_position_embeddings"] == 128
    edit_config(path, rope_parameters={**bare, "mscale": 2.0, "mscale_all_dim": 1.0})
    want = (0.2 * np.log(4.0) + 1.0) / (0.1 * np.log(4.0) + 1.0)
    assert load(path).rope["attention_factor"] == pytest.approx(want)
