"""The architecture table: which row a config.json selects, what each family's layers use
(windows per layer, biases, norms), and `qir inspect`'s account of it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from qir.cli import main
from qir.dtypes import F32
from qir.formats.base import FormatError
from qir.models import load
from qir.models.architectures import ARCHITECTURES, architecture_of
from qir.models.blocks import build
from tests.conftest import DATA
from tests.models.synthetic_llama import write_llama


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_a_row_is_found_by_model_type_and_by_class_name(arch):
    for model_type in arch.model_types:
        assert architecture_of({"model_type": model_type}, "c") is arch
    for cls in arch.classes:
        assert architecture_of({"architectures": ["Other", cls]}, "c") is arch


def test_an_unknown_class_is_refused_by_name():
    with pytest.raises(FormatError, match=r"c: architectures \['BertModel'\] are not supported"):
        architecture_of({"architectures": ["BertModel"]}, "c")


@pytest.mark.parametrize(
    ("overrides", "windows", "field"),
    [
        # transformers' Llama ignores sliding_window
        ({"sliding_window": 8}, (None, None), ""),
        ({"model_type": "mistral", "sliding_window": 8}, (8, 8), "sliding_window"),
        ({"model_type": "mistral", "sliding_window": None}, (None, None), ""),
        # transformers 5 writes 0 for none (Qwen2-MoE without use_sliding_window)
        ({"model_type": "mistral", "sliding_window": 0}, (None, None), ""),
        # Qwen2/3: only with use_sliding_window (default false), from max_window_layers on
        ({"model_type": "qwen2", "sliding_window": 8}, (None, None), ""),
        (
            {"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True},
            (None, None),  # max_window_layers defaults to 28
            "",
        ),
        (
            {
                "model_type": "qwen2",
                "sliding_window": 8,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            (None, 8),
            "max_window_layers",
        ),
        (
            {
                "model_type": "qwen2",
                "sliding_window": 8,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            (8, None),
            "layer_types",
        ),
        # Gemma 3: every sliding_window_pattern-th layer is full
        ({"model_type": "gemma3_text", "sliding_window": 8}, (8, 8), "sliding_window_pattern"),
        (
            {"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 2},
            (8, None),
            "sliding_window_pattern",
        ),
        # Gemma 2 without layer_types (its Hub configs): Gemma2Config's, sliding on even layers
        ({"model_type": "gemma2", "sliding_window": 8}, (8, None), "sliding_window_pattern"),
    ],
)
def test_sliding_windows_per_layer_follow_transformers(tmp_path, overrides, windows, field):
    f = load(write_llama(tmp_path / "ck", **overrides)).features
    assert f.windows == windows
    uses = [u for u in f.uses if u.feature == "sliding_window"]
    assert [u.where for u in uses] == ([field] if field else [])


def test_layer_types_must_cover_every_layer(tmp_path):
    ck = load(
        write_llama(
            tmp_path / "ck",
            model_type="qwen3",
            sliding_window=8,
            use_sliding_window=True,
            layer_types=["full_attention"],
        )
    )
    with pytest.raises(FormatError, match=r"layer_types has 1 entries for 2 layers"):
        _ = ck.features


def test_gemma3_uses_its_norm_form_scale_and_activation(tmp_path):
    ck = load(
        write_llama(
            tmp_path / "ck",
            model_type="gemma3_text",
            query_pre_attn_scalar=16,
            final_logit_softcapping=30.0,
        )
    )
    f = ck.features
    assert f.activation.value == "gelu_pytorch_tanh" and f.activation.where == "hidden_activation"
    assert f.attention_scale == 16**-0.5
    used = {u.feature for u in f.uses}
    assert {"norm_plus_one", "post_norms", "qk_norm", "embed_scale", "final_softcap"} <= used


def test_gemma2_takes_its_config_class_defaults_where_config_json_has_no_key(tmp_path):
    """Gemma2Config's: query_pre_attn_scalar 256, both soft-caps (50, 30), a window of 4096 on
    even layers; an explicit null turns a cap or the window off, as in transformers."""
    f = load(write_llama(tmp_path / "bare", model_type="gemma2")).features
    assert f.attention_scale == 256**-0.5
    assert (f.value("attn_softcap"), f.value("final_softcap")) == (50.0, 30.0)
    assert f.windows == (4096, None) and not f.used("local_rope") and not f.used("qk_norm")
    path = write_llama(tmp_path / "off", model_type="gemma2")
    cfg = json.loads((path / "config.json").read_text())
    nulls = dict.fromkeys(("attn_logit_softcapping", "final_logit_softcapping", "sliding_window"))
    (path / "config.json").write_text(json.dumps({**cfg, **nulls}))
    off = load(path).features
    assert (off.value("attn_softcap"), off.value("final_softcap"), off.windows) == (
        None,
        None,
        (None, None),
    )


def test_gemma2_rotates_every_layer_by_one_base(tmp_path):
    ck = load(write_llama(tmp_path / "ck", model_type="gemma2", sliding_window=8, rope_theta=2e4))
    assert ck.rope_of(sliding=True) == ck.rope and ck.rope["theta"] == 2e4


def test_an_attention_soft_cap_the_familys_reference_ignores_is_refused_by_name(tmp_path):
    """transformers' Gemma 3 never applies attn_logit_softcapping: qir refuses it rather than
    pick an answer no reference gives."""
    ck = load(write_llama(tmp_path / "ck", model_type="gemma3_text", attn_logit_softcapping=50.0))
    with pytest.raises(
        FormatError,
        match=r"attn_logit_softcapping 50.0 \(attention logit soft-capping, which this family's "
        r"transformers code does not apply\) is not supported",
    ):
        build(ck, "layer", 0, F32)


@pytest.mark.parametrize("cap", [0, -50.0, "50"])
def test_an_attention_soft_cap_that_is_no_positive_number_is_refused(tmp_path, cap):
    with pytest.raises(FormatError, match=r"attn_logit_softcapping"):
        load(write_llama(tmp_path / "ck", model_type="gemma2", attn_logit_softcapping=cap))


def test_inspect_lists_gemma2s_features(capsys):
    assert main(["-q", "inspect", str(DATA / "mlx_affine4_gemma2")]) == 0
    arch = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert arch[:2] == [
        "architecture: gemma2 (Gemma2ForCausalLM)",
        "  2 layers, 4 heads of 64 (2 kv heads), tied lm_head",
    ]
    for line in (
        "  attention scale (query_pre_attn_scalar 48)",
        "  attention logit soft-capping (attn_logit_softcapping 2.0)",
        "  final logit soft-capping (final_logit_softcapping 3.0)",
        "  sliding-window attention (layer_types '8 on 1 of 2 layers')",
        "  RoPE theta 10000, rope_type default",
    ):
        assert line in arch


def test_inspect_prints_the_architecture_and_what_it_uses(capsys, tmp_path):
    assert main(["-q", "inspect", str(DATA / "awq_gemm_g64_S")]) == 0
    arch = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert arch == [
        "architecture: llama (LlamaForCausalLM)",
        "  1 layers, 4 heads of 64 (4 kv heads), untied lm_head",
        "  RMSNorm x*w, pre-norm",
        "  MLP activation (hidden_act 'silu')",
        "  RoPE theta 10000, rope_type default",
    ]
    ck = write_llama(tmp_path / "ck", model_type="mistral", sliding_window=16)
    assert main(["-q", "inspect", str(ck)]) == 0
    arch = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert arch[0] == "architecture: mistral (MistralForCausalLM)"
    assert "  sliding-window attention (sliding_window '16 on 2 of 2 layers')" in arch
    ck = write_llama(tmp_path / "ds", model_type="deepseek_v3")
    assert main(["-q", "inspect", str(ck)]) == 0  # the linears still list
    arch = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert arch[0].startswith("architecture: not supported: ")
    assert arch[0].endswith("multi-head latent attention (MLA) is not supported (kv_lora_rank)")


def test_gemma3_rope_per_layer_type_in_both_config_spellings(tmp_path):
    """transformers 5 writes rope_parameters per layer type; Hub configs carry rope_theta with
    rope_local_base_freq (or nothing: transformers' 10000): the same rotations either way."""
    sliding = {"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 2}
    new = load(
        write_llama(
            tmp_path / "new",
            **sliding,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
            },
        )
    )
    old = load(write_llama(tmp_path / "old", **sliding, rope_theta=1e6, rope_local_base_freq=2e4))
    for ck in (new, old):
        assert ck.rope_of(sliding=False)["theta"] == 1e6
        assert ck.rope_of(sliding=True)["theta"] == 2e4
        assert ck.features.used("local_rope")
    bare = load(write_llama(tmp_path / "bare", **sliding, rope_theta=1e6))
    assert bare.rope_of(sliding=True) == {"head_dim": 32, "theta": 1e4, "rope_type": "default"}
    # Other families rotate every layer alike.
    mistral = load(write_llama(tmp_path / "m", model_type="mistral", sliding_window=8))
    assert mistral.rope_of(sliding=True) == mistral.rope


def test_inspect_lists_gemma3s_features(capsys):
    assert main(["-q", "inspect", str(DATA / "mlx_affine4_gemma3")]) == 0
    arch = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert arch[:4] == [
        "architecture: gemma3 (Gemma3ForCausalLM)",
        "  2 layers, 4 heads of 64 (2 kv heads), untied lm_head",
        "  RMSNorm x*(1+w), pre- and post-norms",
        "  MLP activation (hidden_activation 'gelu_pytorch_tanh')",
    ]
    for line in (
        "  embedding scale (model_type 'gemma3_text')",
        "  attention scale (query_pre_attn_scalar 48)",
        "  final logit soft-capping (final_logit_softcapping 30.0)",
        "  sliding-window attention (layer_types '8 on 1 of 2 layers')",
        "  a RoPE base of its own for sliding layers "
        "(rope_parameters.sliding_attention.rope_theta 10000.0)",
        "  RoPE theta 1e+06, rope_type default",
    ):
        assert line in arch


def test_gemma3_norm_weights_are_folded_to_one_plus_w_in_float32():
    """transformers' Gemma3RMSNorm scales by (1 + w.float()) in float32: the loader's folded
    float32 weight is that factor bit for bit, so the plain x * w norm computes Gemma's."""
    ck = load(DATA / "mlx_affine4_gemma3")
    block = build(ck, "norm_qkv", 0, F32)
    stored = ck.tensor("model.layers.0.input_layernorm.weight")
    folded = block.weights["model.layers.0.input_layernorm"]["weight"]
    assert stored.dtype != np.float32 and folded.dtype == np.float32
    np.testing.assert_array_equal(folded, np.float32(1) + stored.astype(np.float32))
    assert not np.array_equal(folded, stored.astype(np.float32))
    model = build(ck, "model", 0, F32)
    norms = [n for n in model.weights if n.endswith("norm")]
    assert len(norms) == 2 * 6 + 1  # input, post-attention, pre-/post-feedforward, q, k; final
    assert all(model.weights[n]["weight"].dtype == np.float32 for n in norms)


def test_a_multimodal_gemma3_checkpoint_runs_its_text_model(capsys, tmp_path):
    """mlx-lm's convert of a Gemma3ForConditionalGeneration keeps the text model under
    language_model. with its config in text_config: qir reads it as the text checkpoint it
    holds (the model test is in test_families), says so, and refuses what the tools disagree on
    or a config without its text model, naming the field."""
    case = DATA / "mlx_affine4_gemma3_mm"
    ck = load(case)
    assert ck.config["model_type"] == "gemma3_text" and ck.num_layers == 2
    assert "model.layers.0.self_attn.q_proj.weight" in ck.store
    assert not any(k.startswith(("language_model.", "vision_tower.")) for k in ck.store)
    assert main(["-q", "inspect", str(case)]) == 0
    arch = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert arch[:2] == [
        "architecture: gemma3 (Gemma3ForCausalLM)",
        "  Gemma 3's text model of a gemma3 checkpoint (text_config; other towers not read)",
    ]
    config = json.loads((case / "config.json").read_text())
    for edit, message in (
        ({"text_config": None}, r"model_type 'gemma3' needs a text_config object"),
        (
            {"text_config": {**config["text_config"], "final_logit_softcapping": 30.0}},
            r"text_config.final_logit_softcapping is set, which transformers' gemma3 model "
            r"does not apply",
        ),
    ):
        bad = tmp_path / f"bad{len(message)}"
        shutil.copytree(case, bad)
        (bad / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(FormatError, match=message):
            load(bad)
