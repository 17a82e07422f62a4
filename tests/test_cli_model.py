"""The qir command on whole layers and models: run, generate, compile's launches and memory,
and one-line errors (exit 2) for what a layer cannot take."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qir.cli import main
from tests.conftest import DATA, max_rel
from tests.models.synthetic_llama import write_llama

W4A16, W4A4 = DATA / "mlx_affine4_g64_S", DATA / "ct_nvfp4_w4a4_S"
PROMPT = "3,10,17,24,31,38,45,52,59,66,73,80"  # golden_model.npz "tokens"


def test_run_layer_writes_y_matching_transformers(tmp_path):
    golden = np.load(W4A16 / "golden_model.npz")
    np.save(tmp_path / "x.npy", np.load(W4A16 / "golden.npz")["x.M5"])
    out = tmp_path / "y.npz"
    argv = ["-q", "run", str(W4A16), "--block", "layer", "--layer", "0", "--act-dtype", "f32"]
    assert main([*argv, "--input", str(tmp_path / "x.npy"), "--out", str(out)]) == 0
    y = np.load(out)["y"]
    assert y.dtype == np.float32 and y.shape == (5, 256)
    assert max_rel(y, golden["layer.0.M5"]) <= 1e-4


def test_run_model_takes_ids_inline_or_from_npy(tmp_path):
    golden = np.load(W4A16 / "golden_model.npz")
    np.save(tmp_path / "ids.npy", golden["tokens"])
    for tokens in (PROMPT, str(tmp_path / "ids.npy")):
        out = tmp_path / "logits.npz"
        argv = ["-q", "run", str(W4A16), "--block", "model", "--tokens", tokens]
        assert main([*argv, "--act-dtype", "f32", "--out", str(out)]) == 0
        logits = np.load(out)["logits"]
        assert logits.dtype == np.float32 and logits.shape == (12, 256)
        assert max_rel(logits, golden["logits"]) <= 1e-4


def test_generate_prints_ids_as_they_come_and_writes_them(tmp_path, capsys):
    golden = np.load(W4A16 / "golden_model.npz")
    out = tmp_path / "g.npz"
    argv = ["-q", "generate", str(W4A16), "--tokens", PROMPT, "--max-new-tokens", "8"]
    assert main([*argv, "--backend", "reference", "--act-dtype", "f32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()[0].split()
    np.testing.assert_array_equal([int(t) for t in printed], golden["greedy"])
    gen = np.load(out)
    assert gen["tokens"].dtype == np.int64 and gen["logits"].dtype == np.float32
    np.testing.assert_array_equal(gen["tokens"], golden["greedy"])
    assert max_rel(gen["logits"], golden["step_logits"]) <= 1e-4


def _plan(tmp_path: Path, ckpt: Path, block: str, *extra: str) -> dict[str, object]:
    path = tmp_path / f"{block}.json"
    assert main(["-q", "compile", str(ckpt), "--block", block, "--json", str(path), *extra]) == 0
    plan: dict[str, object] = json.loads(path.read_text())
    return plan


@pytest.mark.parametrize(
    ("ckpt", "decode", "prefill", "every"),
    [
        # q/k/v (+its norm), append (+rope k), split + combine (+rope q) or prefill,
        # o + residual, gate/up (+its norm) + silu*up, down + residual
        # (every M: the 4 projections' GEMMs, two tile buckets each, and attention's launches
        # for both)
        (W4A16, 7, 6, 16),
        # the norms computed inside the activation quantizations, one more quantization ahead
        # of o_proj and of down_proj; W4A4 kernels have 16-bit twins above 64 rows
        (W4A4, 11, 10, 22),
    ],
)
def test_compile_lists_a_layers_launches(tmp_path, ckpt, decode, prefill, every):
    def names(*extra: str) -> list[str]:
        return [k["name"] for k in _plan(tmp_path, ckpt, "layer", *extra)["kernels"]]

    assert len(names("--m", "1")) == decode
    assert len(names("--m", "5")) == prefill
    assert len(names()) == every
    assert len(names("--m", "1", "--passes", "none")) > decode + 6
    one = names("--m", "1")
    assert any(n.startswith("attn_split_") for n in one)
    assert not any(n.startswith("rope_") for n in one)  # folded into append and attention


def test_compile_reports_weights_cache_and_arena_bytes(tmp_path):
    mem = _plan(tmp_path, W4A16, "model", "--m", "1", "--max-seq", "16")["memory"]
    assert isinstance(mem, dict)
    # 7 quantized linears + quantized embed_tokens and lm_head, 3 bf16 norms
    assert mem["weights_bytes"] == 443904
    assert mem["kv_cache_bytes"] == 2 * 16 * 4 * 64 * 2  # k and v, 16 rows, bf16
    assert 0 < mem["arena_bytes"] < mem["intermediates_without_reuse_bytes"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["-q", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qir: error: "), err
    return err[0]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"rms_norm_eps": None}, "lacks rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic' is not"),
        (
            {"attn_logit_softcapping": 50.0},
            "attn_logit_softcapping 50.0 (attention logit soft-capping, which this family's "
            "transformers code does not apply) is not supported",
        ),
        # Gemma 3's config on a Llama's tensors: the first norm Llama lacks, by name
        (
            {"model_type": "gemma3_text"},
            "no tensor 'model.layers.0.self_attn.q_norm.weight'",
        ),
        (
            {"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            "rope_scaling.short_factor must be a list of 16 numbers (head_dim / 2), got nothing",
        ),
    ],
)
def test_a_checkpoint_a_layer_cannot_run_is_one_line(tmp_path, capsys, config, message):
    ckpt = str(write_llama(tmp_path / "ck", **config))
    assert message in _error(
        capsys, ["run", ckpt, "--block", "model", "--tokens", "1", "--out", str(tmp_path / "o.npz")]
    )
    assert message in _error(capsys, ["generate", ckpt, "--tokens", "1", "--max-new-tokens", "1"])


def test_bad_tokens_and_lengths_are_one_line(tmp_path, capsys):
    ck, out = str(W4A16), str(tmp_path / "o.npz")
    run = ["run", ck, "--block", "model", "--out", out]
    assert "token id 256 is outside the vocabulary (0..255)" in _error(
        capsys, [*run, "--tokens", "1,256"]
    )
    assert "expected comma-separated token ids" in _error(capsys, [*run, "--tokens", "1,a"])
    np.save(tmp_path / "f.npy", np.zeros(3, np.float32))
    assert "float32 [3], expected a 1-D int array" in _error(
        capsys, [*run, "--tokens", str(tmp_path / "f.npy")]
    )
    assert "--block model takes --tokens" in _error(capsys, run)
    gen = ["generate", ck, "--tokens", "1,2,3", "--backend", "reference"]
    assert "a sequence of 10 positions (3 prompt + 7 generated) is past --max-seq 9" in _error(
        capsys, [*gen, "--max-new-tokens", "8", "--max-seq", "9"]
    )
    assert "--max-seq 129 is past the model's max_position_embeddings 128" in _error(
        capsys, [*gen, "--max-new-tokens", "1", "--max-seq", "129"]
    )
    np.save(tmp_path / "x.npy", np.zeros((5, 256), np.float16))
    layer = ["run", ck, "--block", "layer", "--input", str(tmp_path / "x.npy"), "--out", out]
    assert "5 rows are 5 positions: past --max-seq 4" in _error(capsys, [*layer, "--max-seq", "4"])
