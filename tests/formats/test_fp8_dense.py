"""FP8 E4M3 and dense (unquantized) weights: fixture decode, quantizer bounds, the
compressed-tensors / ModelOpt / unquantized checkpoint families, exclusion lists, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from qir.dtypes import BF16, F16, F32, U8
from qir.formats import parse_format
from qir.formats.base import FormatError
from qir.formats.dense import Dense
from qir.formats.fp8 import Fp8
from qir.models import load
from qir.models.quant_conventions.dense import is_excluded

DATA = Path(__file__).resolve().parents[1] / "data"
PROJ = ["q", "k", "v", "o", "gate", "up", "down"]
Q = "model.layers.0.self_attn.q_proj"
E4M3 = ml_dtypes.float8_e4m3fn


def test_ct_fixture_dequantize_matches_golden_bit_exactly() -> None:
    ck = load(DATA / "ct_fp8_dynamic_S")
    golden = np.load(DATA / "ct_fp8_dynamic_S" / "golden.npz")
    for p in PROJ:
        lin = ck.linear(ck.layer_module(0, p))
        assert lin.weight.format == Fp8("channel")
        assert all(not a.flags.writeable for a in lin.buffers.values())
        w = lin.weight.format.dequantize(
            lin.buffers, lin.weight.out_features, lin.weight.in_features
        )
        np.testing.assert_array_equal(w, golden[f"W.0.{p}"], err_msg=p)


@pytest.mark.parametrize("case", ["ct_fp8_dynamic_S", "ct_mxfp4a16_S"])
def test_ct_ignored_lm_head_and_embeddings_read_dense(case: str) -> None:
    ck = load(DATA / case)
    for module in ("lm_head", "model.embed_tokens"):
        lin = ck.linear(module)
        assert lin.weight.format == Dense(BF16)
        np.testing.assert_array_equal(lin.buffers["weight"], ck.tensor(f"{module}.weight"))


def test_spellings() -> None:
    for fmt in (Fp8("channel"), Fp8("tensor"), Dense(F16), Dense(BF16), Dense(F32)):
        assert parse_format(fmt.spell()) == fmt
    assert Fp8("tensor").spell() == "fp8<granularity=tensor>"
    assert Dense(BF16).describe() == {"bits": 16, "group": None, "w4a4": False}
    assert Fp8("channel").describe() == {"bits": 8, "group": None, "w4a4": False}
    with pytest.raises(FormatError, match="granularity='block'"):
        Fp8("block")
    with pytest.raises(FormatError, match="dtype=u8"):
        Dense(U8)


@settings(max_examples=40, deadline=None)
@given(
    out_f=st.integers(1, 6),
    in_f=st.sampled_from([8, 24, 64]),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([1e-4, 1.0, 1e3]),
    granularity=st.sampled_from(["channel", "tensor"]),
)
def test_fp8_quantize_error_bound(
    out_f: int, in_f: int, seed: int, spread: float, granularity: str
) -> None:
    fmt = Fp8(granularity)
    w = (np.random.default_rng(seed).standard_normal((out_f, in_f)) * spread).astype(np.float32)
    bufs = fmt.quantize(w)
    got = fmt.dequantize(bufs, out_f, in_f)
    scale = bufs["scale"][:, None]
    # amax/448 scales put every |w|/s within E4M3's range: at most half a step (3 mantissa bits,
    # subnormal step 2^-9) per element.
    v = np.abs(w) / scale
    half_step = np.exp2(np.floor(np.log2(np.maximum(v, 2.0**-6))) - 4) * scale
    assert np.all(np.abs(got - w) <= half_step * (1 + 1e-6))


def test_fp8_nan_weight_refused() -> None:
    bufs = Fp8("tensor").quantize(np.ones((2, 8), np.float32))
    bufs["weight"] = bufs["weight"].copy()
    bufs["weight"].view(np.uint8)[1, 3] = 0x7F
    with pytest.raises(FormatError, match=r"w\.weight: contains NaN"):
        Fp8("tensor").check_buffers(bufs, 2, 8, where="w")


def test_dense_round_trip_and_refusals() -> None:
    w = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_array_equal(Dense(F32).dequantize(Dense(F32).quantize(w), 3, 16), w)
    with pytest.raises(FormatError, match="not finite in f16"):
        Dense(F16).quantize(np.full((1, 8), 1e6, np.float32))
    with pytest.raises(FormatError, match="in_features 12 is not a multiple of 8"):
        Dense(F16).check_shape(1, 12)


@pytest.mark.parametrize(
    ("module", "patterns", "excluded"),
    [
        ("lm_head", ["lm_head"], True),
        ("model.layers.0.mlp.gate_proj", ["re:.*gate_proj$"], True),
        ("model.layers.0.mlp.up_proj", ["re:.*gate_proj$"], False),
        ("model.layers.3.self_attn.q_proj", ["model.layers.*.self_attn"], True),
        ("model.layers.3.mlp.up_proj", ["model.layers.*.self_attn"], False),
        ("model.layers.1.self_attn.o_proj", ["self_attn.o_proj"], True),
        ("model.layers.1.self_attn.o_proj_x", ["o_proj"], False),  # whole names only
        ("model.embed_tokens", None, False),
    ],
)
def test_is_excluded(module: str, patterns: list[str] | None, excluded: bool) -> None:
    assert is_excluded(module, patterns) is excluded


# ---- small synthetic checkpoints -------------------------------------------------------------

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "torch_dtype": "bfloat16",
}


def _write(path: Path, tensors: dict[str, np.ndarray], **config: Any) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**CONFIG, **config}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _ct_config(strategy: str = "tensor", fmt: str = "float-quantized", **weights: Any) -> dict:
    w = {"type": "float", "num_bits": 8, "symmetric": True, "strategy": strategy, **weights}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "format": fmt}},
        "ignore": ["lm_head"],
    }


def _fp8_tensors(scale: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    codes = np.random.default_rng(0).integers(0, 0x7E, (64, 64)).astype(np.uint8)
    tensors = {f"{Q}.weight": codes.view(E4M3), f"{Q}.weight_scale": scale}
    want = codes.view(E4M3).astype(np.float32) * scale.astype(np.float32).reshape(-1, 1)
    return tensors, want


@pytest.mark.parametrize(
    ("config", "scale"),
    [
        ({"quantization_config": _ct_config("tensor")}, np.array([0.0125], np.float32)),
        (
            {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
            np.array(0.0125, np.float32),
        ),
        (
            {"hf_quant_config": {"quantization": {"quant_algo": "FP8", "exclude_modules": []}}},
            np.array(0.0125, np.float32),
        ),
    ],
    ids=["ct", "modelopt", "modelopt-hf-quant-config"],
)
def test_per_tensor_fp8_checkpoints(tmp_path: Path, config: dict, scale: np.ndarray) -> None:
    tensors, want = _fp8_tensors(scale)
    if "hf_quant_config" in config:
        path = _write(tmp_path / "ck", tensors)
        (path / "hf_quant_config.json").write_text(json.dumps(config["hf_quant_config"]))
    else:
        path = _write(tmp_path / "ck", tensors, **config)
    lin = load(path).linear(Q)
    assert lin.weight.format == Fp8("tensor")
    np.testing.assert_array_equal(lin.weight.format.dequantize(lin.buffers, 64, 64), want)


def test_fp8_scale_of_the_wrong_shape(tmp_path: Path) -> None:
    tensors, _ = _fp8_tensors(np.ones((64, 1), ml_dtypes.bfloat16))
    ck = load(_write(tmp_path / "ck", tensors, quantization_config=_ct_config("tensor")))
    with pytest.raises(FormatError, match=rf"{Q}\.weight_scale: bfloat16 \[64, 1\], expected"):
        ck.linear(Q)


@pytest.mark.parametrize(
    ("qcfg", "message"),
    [
        (
            _ct_config("block", block_structure=[64, 64]),
            r"not supported: FP8 block size \[64, 64\] \(quantization_config\.config_groups\.gr",
        ),
        (_ct_config("group", group_size=128), "not supported: float-quantized .* strategy 'group'"),
        (_ct_config(symmetric=False), "not supported: float-quantized"),
        ({**_ct_config(), "sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
        ({**_ct_config(), "quantization_status": "frozen"}, "quantization_status 'frozen'"),
        (_ct_config(fmt="mxfp4-pack-quantized", num_bits=4, group_size=16), "group_size 16"),
        (_ct_config(fmt="marlin-24"), "not supported: compressed-tensors format marlin-24"),
    ],
)
def test_ct_detected_but_not_supported(tmp_path: Path, qcfg: dict, message: str) -> None:
    tensors, _ = _fp8_tensors(np.array([1.0], np.float32))
    path = _write(tmp_path / "ck", tensors, quantization_config=qcfg)
    with pytest.raises(FormatError, match=message):
        load(path)


def test_modelopt_fp8_block_is_not_supported(tmp_path: Path) -> None:
    tensors, _ = _fp8_tensors(np.array([1.0], np.float32))
    qcfg = {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}
    with pytest.raises(FormatError, match="not supported: ModelOpt quant_algo FP8_PB_WO"):
        load(_write(tmp_path / "ck", tensors, quantization_config=qcfg))


def test_unquantized_checkpoint_family(tmp_path: Path) -> None:
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    ck = load(_write(tmp_path / "ck", {f"{Q}.weight": w}))
    assert ck.convention.name == "dense"
    lin = ck.linear(Q)
    assert lin.weight.format == Dense(BF16)
    np.testing.assert_array_equal(lin.weight.format.dequantize(lin.buffers, 64, 64), w)
    with pytest.raises(FormatError, match=r"self_attn\.k_proj\.weight: missing"):
        ck.linear("model.layers.0.self_attn.k_proj")


def test_dense_refuses_a_quantized_tensor(tmp_path: Path) -> None:
    ck = load(_write(tmp_path / "ck", {f"{Q}.weight": np.zeros((64, 8), np.uint32)}))
    with pytest.raises(FormatError, match=rf"{Q}\.weight: uint32 \[64, 8\], expected an unquant"):
        ck.linear(Q)
