"""Whole layers and models in the numpy reference: against transformers' float32 forward of
every fixture (golden_model.npz), against an independent numpy forward of a synthetic
grouped-query Llama, and the config checks a layer needs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qir import interpret
from qir.dtypes import F32
from qir.errors import UsageError
from qir.formats.base import FormatError
from qir.models import Model, load
from qir.models.blocks import build
from tests.conftest import DATA, greedy_prefix, max_rel
from tests.models.synthetic_llama import LLAMA3, Forward, write_llama

FIXTURES = sorted(p.name for p in DATA.iterdir() if (p / "golden_model.npz").is_file())
# float32 reference vs transformers' float32 forward (accumulation order only).
TOL = 1e-4


def test_every_fixture_has_a_model_golden():
    assert len(FIXTURES) == 31


@pytest.mark.parametrize("fixture", FIXTURES)
def test_layer_hidden_and_logits_match_transformers(fixture):
    golden = np.load(DATA / fixture / "golden_model.npz")
    inputs = np.load(DATA / fixture / "golden.npz")
    ck = load(DATA / fixture)
    layer = build(ck, "layer", 0, F32)
    for m in (1, 5, 40):
        x = inputs[f"x.M{m}"].astype(np.float32)
        y = interpret(layer.graph, layer.inputs(x), layer.weights)["y"]
        assert max_rel(y, golden[f"layer.0.M{m}"]) <= TOL, m
    model = build(ck, "model", 0, F32)
    model.graph.outputs.append(("hidden", "l0.y"))
    tokens = golden["tokens"].astype(np.int32)
    out = interpret(model.graph, model.token_inputs(tokens), model.weights)
    assert max_rel(out["hidden"], golden["hidden.0"]) <= TOL
    assert max_rel(out["logits"], golden["logits"]) <= TOL


@pytest.mark.parametrize("fixture", ["mlx_affine4_g64_S", "awq_gemm_g64_S", "ct_nvfp4_w4a4_S"])
def test_greedy_generation_with_the_kv_cache_matches_transformers(fixture):
    golden = np.load(DATA / fixture / "golden_model.npz")
    # The goldens are 16-bit-activation numbers: W4A4 checkpoints run as W4A16 to compare.
    model = Model.load(DATA / fixture, act=F32, weight_quantization="w4a16")
    gen = model.generate(golden["tokens"], 8, do_sample=False)
    assert gen.tokens.dtype == np.int64 and gen.logits.shape == (8, 256)
    assert max_rel(gen.logits, golden["step_logits"]) <= TOL
    # Margins on these fixtures are far above float32 error: every step is decided.
    assert greedy_prefix(golden["step_logits"], gen.logits) == 8
    np.testing.assert_array_equal(gen.tokens, golden["greedy"])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, 4 query heads on 2 kv heads, head_dim 32, Llama 3 RoPE scaling."""
    return write_llama(tmp_path_factory.mktemp("gqa") / "ck")


TOKENS = np.array([5, 17, 3, 90, 44, 2, 61])


def test_grouped_query_model_matches_an_independent_forward(synthetic):
    ours = Model.load(synthetic, act=F32)
    ref = Forward(synthetic)
    assert max_rel(ours.logits(TOKENS), ref.logits(TOKENS)) <= TOL
    # Prefill 4 tokens, then the rest one at a time through the cache: each step's logits are
    # the whole sequence's last row.
    ours.forward(TOKENS[:4], 0)
    for t in range(4, len(TOKENS)):
        step = ours.forward(TOKENS[t : t + 1], t)[0]
        assert max_rel(step, ref.logits(TOKENS[: t + 1])[-1]) <= TOL, t


def test_grouped_query_greedy_matches_an_independent_forward(synthetic):
    gen = Model.load(synthetic, act=F32).generate(TOKENS, 5)
    ref, seq = Forward(synthetic), list(TOKENS)
    for step in range(5):
        logits = ref.logits(np.array(seq))[-1]
        assert max_rel(gen.logits[step], logits) <= TOL
        seq.append(int(np.argmax(logits)))
    np.testing.assert_array_equal(gen.tokens, seq[len(TOKENS) :])


def test_biases_on_every_linear_match_an_independent_forward(tmp_path):
    """attention_bias and mlp_bias: all seven linears of each layer carry a (random) bias."""
    path = write_llama(tmp_path / "ck", attention_bias=True, mlp_bias=True)
    ck = load(path)
    assert ck.features.biases == ("q", "k", "v", "o", "gate", "up", "down")
    logits = Model.load(path, act=F32).logits(TOKENS)
    assert max_rel(logits, Forward(path).logits(TOKENS)) <= TOL
    # without them the logits would be others
    plain = Forward(path)
    plain.t = {k: v for k, v in plain.t.items() if not k.endswith(".bias")}
    assert max_rel(logits, plain.logits(TOKENS)) > 0.05


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_families_match_an_independent_forward(tmp_path, family):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms (2 layers, grouped-query)."""
    path = write_llama(tmp_path / "ck", model_type=family)
    ours = Model.load(path, act=F32)
    assert max_rel(ours.logits(TOKENS), Forward(path).logits(TOKENS)) <= TOL
    ours.forward(TOKENS[:4], 0)
    step = ours.forward(TOKENS[4:5], 4)[0]
    assert max_rel(step, Forward(path).logits(TOKENS[:5])[-1]) <= TOL


def test_a_bias_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    path = write_llama(tmp_path / "ck", model_type="qwen2")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.bias"] = np.zeros(7, np.float16)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        FormatError, match=r"model.layers.1.self_attn.k_proj.bias: shape \[7\], expected \[64\]"
    ):
        build(load(path), "layer", 1)


def test_tied_embeddings_and_linear_rope(tmp_path):
    path = write_llama(
        tmp_path / "ck",
        tie_word_embeddings=True,
        rope_scaling=None,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0},
    )
    assert not (set(load(path).store.keys()) & {"lm_head.weight"})
    logits = Model.load(path, act=F32).logits(TOKENS)
    # The independent forward reads rope_theta/rope_scaling: the same rotation, older spelling.
    cfg = {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    ref = Forward(write_llama(tmp_path / "old", tie_word_embeddings=True, **cfg))
    ref.cfg["rope_scaling"] = None  # the reference knows no linear scaling: halve theta's freqs
    inv = ref.inv_freq() / 2.0
    ref.inv_freq = lambda: inv  # type: ignore[method-assign]
    assert max_rel(logits, ref.logits(TOKENS)) <= TOL
    # Both spellings build the same rotation.
    assert load(path).rope == load(tmp_path / "old").rope


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rms_norm_eps": None}, r"lacks rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"rope_type 'dynamic' is not"),
        ({"rope_scaling": {**LLAMA3, "low_freq_factor": None}}, r"llama3 lacks low_freq_factor"),
        (
            {"attn_logit_softcapping": 50.0},
            r"attn_logit_softcapping 50.0 \(attention logit soft-capping, which this family's "
            r"transformers code does not apply\) is not supported",
        ),
        ({"model_type": "qwen3"}, r"no tensor 'model.layers.0.self_attn.q_norm.weight'"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5"),
    ],
)
def test_a_layer_refuses_configs_it_cannot_run(tmp_path, overrides, message):
    path = write_llama(tmp_path / "ck", **overrides)
    if overrides.get("model_type") == "qwen3":  # a Qwen3 checkpoint without its q/k norms
        tensors = load_file(str(path / "model.safetensors"))
        save_file(
            {k: v for k, v in tensors.items() if "_norm." not in k}, str(path / "model.safetensors")
        )
    ck = load(path)
    build(ck, "mlp", 0)  # blocks without attention do not need these
    with pytest.raises(FormatError, match=message):
        build(ck, "layer", 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' \(MLP activation\) is not supported"),
        ({"model_type": "deepseek_v3"}, r"multi-head latent attention \(MLA\) is not supported"),
        (
            {"model_type": "bert"},
            r"model_type 'bert' is not supported \(supported: gemma2, gemma3_text",
        ),
        ({"model_type": None, "architectures": None}, r"names no model_type or architectures"),
        ({"num_local_experts": 8}, r"num_local_experts 8: mixture-of-experts layers"),
        ({"attention_bias": True}, r"q_proj.bias: missing \(attention_bias True implies it\)"),
    ],
)
def test_every_block_refuses_a_family_or_mlp_it_cannot_run(tmp_path, overrides, message):
    path = write_llama(tmp_path / "ck")  # Llama's tensors, whatever the config says after
    cfg = {**json.loads((path / "config.json").read_text()), **overrides}
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    ck = load(path)
    with pytest.raises(FormatError, match=message):
        build(ck, "mlp", 0)


def test_token_ids_and_sequence_length_are_checked(synthetic):
    model = Model.load(synthetic, act=F32, max_seq=8)
    with pytest.raises(UsageError, match=r"token id 96 is outside the vocabulary \(0\.\.95\)"):
        model.logits([1, 96])
    with pytest.raises(UsageError, match=r"token id -1"):
        model.logits(np.array([-1]))
    with pytest.raises(
        UsageError, match=r"10 positions \(7 prompt \+ 3 generated\) is past --max-seq 8"
    ):
        model.generate(TOKENS, 4)
    with pytest.raises(
        UsageError, match="max-seq 65 is past the model's max_position_embeddings 64"
    ):
        Model.load(synthetic, max_seq=65)
    assert model.generate(TOKENS, 2).tokens.shape == (2,)  # 7 + 1 fed back = 8 rows: fits
