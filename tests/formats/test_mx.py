"""MXFP4 / MXFP8: compressed-tensors fixture decode, the OCP quantizer, MLX mxfp4/mxfp8
checkpoints written here with an independent packer, and refusals."""

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

from qir.formats import parse_format
from qir.formats.base import FormatError
from qir.formats.mx import Mxfp4, Mxfp8, e8m0_decode, ocp_scale_exponents
from qir.models import load
from tests.requires import requires

DATA = Path(__file__).resolve().parents[1] / "data"
PROJ = ["q", "k", "v", "o", "gate", "up", "down"]
# docs/formats.md's E2M1 table, written out independently of qir.formats.fp_codes.
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_ct_fixture_dequantize_matches_golden_bit_exactly() -> None:
    ck = load(DATA / "ct_mxfp4a16_S")
    golden = np.load(DATA / "ct_mxfp4a16_S" / "golden.npz")
    for p in PROJ:
        lin = ck.linear(ck.layer_module(0, p))
        assert lin.weight.format == Mxfp4()
        assert all(not a.flags.writeable for a in lin.buffers.values())
        w = lin.weight.format.dequantize(
            lin.buffers, lin.weight.out_features, lin.weight.in_features
        )
        assert w.dtype == np.float32
        np.testing.assert_array_equal(w, golden[f"W.0.{p}"], err_msg=p)


def test_spelling_and_facts() -> None:
    for fmt, bits, nbytes in ((Mxfp4(), 4, 0.5 + 1 / 32), (Mxfp8(), 8, 1 + 1 / 32)):
        assert parse_format(fmt.spell()) == fmt
        assert fmt.spell() == f"mxfp{bits}<>" and fmt.tag() == f"mxfp{bits}"
        assert fmt.describe() == {"bits": bits, "group": 32, "w4a4": False}
        assert fmt.bytes_per_weight() == nbytes


@pytest.mark.parametrize(
    ("amax", "fp4_exp", "fp8_exp"),
    # OCP: floor(log2 amax) - 2 (E2M1) or - 8 (E4M3), biased by 127. docs/formats.md: CT gives
    # 127 for 3.5 and 128 for 7.9, the OCP rule 126 and 127.
    [(3.5, 126, 120), (7.9, 127, 121), (6.0, 127, 121), (4.0, 127, 121), (1.0, 125, 119)],
)
def test_ocp_exponent_rule(amax: float, fp4_exp: int, fp8_exp: int) -> None:
    block = np.zeros((1, 1, 32), np.float32)
    block[0, 0, 5] = -amax
    assert ocp_scale_exponents(block, 2)[0, 0] == fp4_exp
    assert ocp_scale_exponents(block, 8)[0, 0] == fp8_exp


def test_zero_and_extreme_blocks() -> None:
    blocks = np.zeros((1, 3, 32), np.float32)
    blocks[0, 1, 0] = 1e-44  # float32 subnormal: clamps at the smallest scale
    blocks[0, 2, 0] = 3e38
    e = ocp_scale_exponents(blocks, 2)
    assert e.tolist() == [[0, 0, 252]]
    assert e8m0_decode(np.array([0], np.uint8))[0] == np.float32(2.0**-127)
    w = blocks.reshape(1, 96)
    np.testing.assert_array_equal(Mxfp4().dequantize(Mxfp4().quantize(w), 1, 96)[0, :32], 0)


def _error_bound(w: np.ndarray, scale: np.ndarray, elem_max: float, half_step: Any) -> np.ndarray:
    """Per element: half a step of the element grid at |w|/scale, or the clipped excess."""
    v = np.abs(w) / scale
    return np.maximum(half_step(np.minimum(v, elem_max)), v - elem_max) * scale


def _fp4_half_step(v: np.ndarray) -> np.ndarray:
    return np.where(v < 2, 0.25, np.where(v < 4, 0.5, 1.0))


def _fp8_half_step(v: np.ndarray) -> np.ndarray:
    # E4M3: 3 mantissa bits; subnormal spacing 2^-9 below 2^-6.
    return np.exp2(np.floor(np.log2(np.maximum(v, 2.0**-6))) - 4)


@settings(max_examples=40, deadline=None)
@given(
    out_f=st.integers(1, 5),
    blocks=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([1e-6, 1e-2, 1.0, 1e4]),
    fp8=st.booleans(),
)
def test_quantize_round_trip_error_bound(
    out_f: int, blocks: int, seed: int, spread: float, fp8: bool
) -> None:
    fmt = Mxfp8() if fp8 else Mxfp4()
    in_f = 32 * blocks
    w = (np.random.default_rng(seed).standard_normal((out_f, in_f)) * spread).astype(np.float32)
    bufs = fmt.quantize(w)
    for name, t in fmt.buffers(out_f, in_f).items():
        assert bufs[name].shape == t.shape and bufs[name].dtype == t.dtype.np
    got = fmt.dequantize(bufs, out_f, in_f)
    scale = np.repeat(e8m0_decode(bufs["scales"]), 32, axis=1)
    bound = (
        _error_bound(w, scale, 448.0, _fp8_half_step)
        if fp8
        else _error_bound(w, scale, 6.0, _fp4_half_step)
    )
    assert np.all(np.abs(got - w) <= bound * (1 + 1e-6))


def test_nan_scale_is_refused_naming_the_tensor() -> None:
    bufs = Mxfp4().quantize(np.ones((2, 64), np.float32))
    bufs["scales"] = bufs["scales"].copy()
    bufs["scales"][1, 1] = 0xFF
    with pytest.raises(FormatError, match=r"w\.scales: E8M0 NaN code 0xFF at \[1, 1\]"):
        Mxfp4().check_buffers(bufs, 2, 64, where="w")


def test_shape_refusals() -> None:
    with pytest.raises(FormatError, match="in_features 48 is not a multiple of the MX block"):
        Mxfp8().check_shape(4, 48)
    with pytest.raises(FormatError, match="empty"):
        Mxfp4().check_shape(0, 32)


# ---- MLX mxfp4 / mxfp8 checkpoints, packed here from the documented layout ------------------

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "torch_dtype": "bfloat16",
}
Q = "model.layers.0.self_attn.q_proj"


def _mlx_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """docs/formats.md (MLX): each row a little-endian stream, element j at bits [j*bits, (j+1)*bits)."""
    per = 32 // bits
    rows, n = codes.shape
    words = np.zeros((rows, n // per), np.uint64)
    for j in range(per):
        words |= codes[:, j::per].astype(np.uint64) << np.uint64(bits * j)
    return words.astype(np.uint32)


def _mlx_checkpoint(path: Path, mode: str, rng: np.random.Generator, **overrides: Any) -> tuple:
    bits = 4 if mode == "mxfp4" else 8
    codes = rng.integers(0, 16, (64, 64)) if bits == 4 else rng.integers(0, 256, (64, 64))
    if bits == 8:
        codes[(codes & 0x7F) == 0x7F] = 0  # no E4M3 NaN codes
    exps = rng.integers(118, 130, (64, 2))
    if bits == 4:
        elems = np.array(E2M1, np.float32)[codes]
    else:
        elems = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = elems * np.repeat(np.exp2(exps - 127.0).astype(np.float32), 32, axis=1)
    tensors = {f"{Q}.weight": _mlx_words(codes, bits), f"{Q}.scales": exps.astype(np.uint8)}
    path.mkdir()
    qcfg = {"group_size": 32, "bits": bits, "mode": mode, **overrides}
    (path / "config.json").write_text(json.dumps({**CONFIG, "quantization": qcfg}))
    save_file(tensors, str(path / "model.safetensors"))
    return path, want, tensors


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_mlx_checkpoint_decodes_to_the_documented_values(tmp_path: Path, mode: str) -> None:
    path, want, _ = _mlx_checkpoint(tmp_path / "ck", mode, np.random.default_rng(1))
    lin = load(path).linear(Q)
    assert lin.weight.format.kind == mode
    assert (lin.weight.out_features, lin.weight.in_features) == (64, 64)
    got = lin.weight.format.dequantize(lin.buffers, 64, 64)
    np.testing.assert_array_equal(got, want)


def test_mlx_checkpoint_false_override_reads_dense(tmp_path: Path) -> None:
    path, _, tensors = _mlx_checkpoint(tmp_path / "ck", "mxfp4", np.random.default_rng(2))
    w = np.random.default_rng(3).standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization"]["model.layers.0.self_attn.k_proj"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(
        {**tensors, "model.layers.0.self_attn.k_proj.weight": w}, str(path / "model.safetensors")
    )
    lin = load(path).linear("model.layers.0.self_attn.k_proj")
    assert lin.weight.format.spell() == "dense<dtype=bf16>"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({Q: {"mode": "affine", "bits": 4, "group_size": 64}}, "not supported: MLX mode affine"),
        ({"bits": 8}, r"bits 8, group_size 32; MLX mxfp4 needs 4 and 32"),
    ],
)
def test_mlx_checkpoint_refusals(tmp_path: Path, overrides: dict, message: str) -> None:
    path, _, _ = _mlx_checkpoint(tmp_path / "ck", "mxfp4", np.random.default_rng(4), **overrides)
    with pytest.raises(FormatError, match=message):
        load(path).linear(Q)


def test_mlx_checkpoint_nan_scale(tmp_path: Path) -> None:
    path, _, tensors = _mlx_checkpoint(tmp_path / "ck", "mxfp8", np.random.default_rng(5))
    tensors[f"{Q}.scales"][3, 1] = 255
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(FormatError, match=rf"{Q}\.scales: E8M0 NaN code 0xFF at \[3, 1\]"):
        load(path).linear(Q)


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
@requires("mlx")
def test_matches_real_mlx(mode: str) -> None:
    """mx.dequantize of MLX's own quantization equals our decode of the same bytes, and our OCP
    quantizer is as accurate as MLX's."""
    import mlx.core as mx

    w = np.random.default_rng(6).standard_normal((16, 256), dtype=np.float32)
    wq, scales = mx.quantize(mx.array(w), mode=mode)
    theirs = np.asarray(mx.dequantize(wq, scales, mode=mode, dtype=mx.float32))
    raw = np.asarray(wq).view(np.uint8)
    fmt = Mxfp4() if mode == "mxfp4" else Mxfp8()
    bufs = {"weight": raw if mode == "mxfp4" else raw.view(ml_dtypes.float8_e4m3fn)}
    bufs["scales"] = np.asarray(scales)
    np.testing.assert_array_equal(fmt.dequantize(bufs, 16, 256), theirs)
    ours = fmt.dequantize(fmt.quantize(w), 16, 256)
    # Different exponent rules (OCP may clip the block maximum, MLX never does), same accuracy.
    rel = [float(np.linalg.norm(d - w) / np.linalg.norm(w)) for d in (ours, theirs)]
    assert rel[0] <= 1.2 * rel[1], rel
