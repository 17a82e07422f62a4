"""compressed-tensors pack-quantized int (W4A16): the llmcompressor fixture's golden, our own
packer, CT's symmetric quantizer, config matching (ignore list, other CT formats), refusals and
the kernels on the host backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from qir.dtypes import BF16, F16, F32, U32, DType
from qir.formats.base import FormatError
from qir.formats.ct_int import CtInt
from qir.models import load
from qir.models.quant_conventions.ct_int import matches_config
from qir.types import QWeight
from tests.conftest import DATA
from tests.formats.int_common import (
    PROJ,
    check_fixture_block,
    check_qlinear_host,
    check_spell,
    golden,
    needs_host,
)

CASE = "ct_w4a16_int4_S"
Q = "model.layers.0.self_attn.q_proj"


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """CT's pack_to_int32 as documented: q + 2^(bits-1), element j at bits bits*(j % (32/bits))."""
    per = 32 // bits
    u = (q + (1 << (bits - 1))).astype(np.uint32)
    out = np.zeros((q.shape[0], q.shape[1] // per), np.uint32)
    for j in range(q.shape[1]):
        out[:, j // per] |= u[:, j] << np.uint32(bits * (j % per))
    return out.view(np.int32)


def test_fixture_linears_match_golden_bit_exactly() -> None:
    ck = load(DATA / CASE)
    gold = golden(CASE)
    for p in PROJ:
        lin = ck.linear(ck.layer_module(0, p))
        want = gold[f"W.0.{p}"]
        assert lin.weight.format == CtInt(4, 128, BF16)
        assert all(not a.flags.owndata for a in lin.buffers.values())  # read as stored
        np.testing.assert_array_equal(
            lin.weight.format.dequantize(lin.buffers, *want.shape), want, err_msg=p
        )


def test_fixture_kernel_read_formula_matches_golden() -> None:
    lin = load(DATA / CASE).linear(Q)
    want = golden(CASE)["W.0.q"]
    w, s = lin.buffers["weight"], lin.buffers["scales"].astype(np.float32)
    got = np.zeros_like(want)
    for o in range(0, 256, 17):
        for i in range(256):
            nib = (int(w[o, i // 8]) >> (4 * (i % 8))) & 15
            got[o, i] = np.float32(nib - 8) * s[o, i // 128]
        np.testing.assert_array_equal(got[o], want[o])


def test_our_packer_reproduces_the_fixture_bytes() -> None:
    tensors = load_file(str(DATA / CASE / "model.safetensors"))
    packed = tensors[f"{Q}.weight_packed"]
    w = golden(CASE)["W.0.q"]
    s = np.repeat(tensors[f"{Q}.weight_scale"].astype(np.float32), 128, axis=1)
    q = np.rint(w / s).astype(np.int64)
    np.testing.assert_array_equal(pack(q, 4), packed)


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([32, 64, 128]),
    out_f=st.integers(1, 9),
    n_groups=st.integers(1, 4),
    scale_dtype=st.sampled_from([BF16, F16, F32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_packed_checkpoint_round_trip(
    bits: int, group: int, out_f: int, n_groups: int, scale_dtype: DType, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    in_f = group * n_groups
    half = 1 << (bits - 1)
    q = rng.integers(-half, half, (out_f, in_f))
    s = (rng.random((out_f, n_groups)) + 0.01).astype(scale_dtype.np)
    fmt = CtInt(bits, group, scale_dtype)
    check_spell(fmt)
    bufs = {"weight": pack(q, bits).view(np.uint32), "scales": s}
    fmt.check_buffers(bufs, out_f, in_f, where="m")
    want = q.astype(np.float32) * np.repeat(s.astype(np.float32), group, axis=1)
    np.testing.assert_array_equal(fmt.dequantize(bufs, out_f, in_f), want)


def _scalar_quantize(w: np.ndarray, g: int, bits: int, dt: Any) -> tuple[np.ndarray, np.ndarray]:
    half = 1 << (bits - 1)
    q = np.zeros(w.shape, np.int64)
    s = np.zeros((w.shape[0], w.shape[1] // g), dt)
    for r in range(w.shape[0]):
        for j in range(w.shape[1] // g):
            vals = w[r, j * g : (j + 1) * g]
            amax = max(abs(min(vals.min(), 0)), max(vals.max(), 0))
            sc = np.float32(amax / np.float32((2 * half - 1) / 2))
            s[r, j] = sc if sc != 0 else np.finfo(np.float32).eps
            q[r, j * g : (j + 1) * g] = np.clip(
                np.rint(vals / np.float32(s[r, j])), -half, half - 1
            )
    return q, s


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_matches_scalar_reference(bits: int) -> None:
    w = np.random.default_rng(bits).standard_normal((6, 256), dtype=np.float32)
    w[1, :128] = 0  # a zero group: eps scale
    q, s = _scalar_quantize(w, 128, bits, ml_dtypes.bfloat16)
    got = CtInt(bits, 128, BF16).quantize(w)
    np.testing.assert_array_equal(got["weight"], pack(q, bits).view(np.uint32))
    np.testing.assert_array_equal(got["scales"], s)


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    out_f=st.integers(1, 6),
    n_groups=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([1e-2, 1.0, 30.0]),
)
def test_quantize_error_bound(bits: int, out_f: int, n_groups: int, seed: int, spread: float):
    """|dequant - w| <= s/2 (the positive edge amax = (2^b-1)/2 * s clamps to 2^(b-1)-1 codes,
    also s/2 away); bf16 rounding of the scale adds at most 2^(b-1) * |ds|."""
    fmt = CtInt(bits, 32, BF16)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_f, 32 * n_groups)) * spread).astype(np.float32)
    bufs = fmt.quantize(w)
    got = fmt.dequantize(bufs, *w.shape).reshape(out_f, n_groups, 32)
    s = bufs["scales"].astype(np.float32)[..., None]
    wg = w.reshape(out_f, n_groups, 32)
    amax = np.abs(wg).max(-1, keepdims=True)
    exact = amax / np.float32(((1 << bits) - 1) / 2)
    bound = s / 2 + (1 << (bits - 1)) * np.abs(exact - s) + 1e-6 * amax
    assert np.all(np.abs(got - wg) <= bound)


def test_spell_tag_sizes_and_buffers() -> None:
    fmt = CtInt(4, 128, BF16)
    assert fmt.spell() == "ct_int<bits=4,group_size=128,scale_dtype=bf16>"
    check_spell(fmt)
    assert fmt.tag() == "ct4g128bf16" and fmt.fragment == "ct_int"
    assert fmt.bytes_per_weight() == 0.5 + 2 / 128
    assert {k: (t.shape, t.dtype) for k, t in fmt.buffers(512, 256).items()} == {
        "weight": ((512, 32), U32),
        "scales": ((512, 2), BF16),
    }


# ---- config matching and refusals ------------------------------------------------------------


def _config() -> dict[str, Any]:
    return json.loads((DATA / CASE / "config.json").read_text())


def test_matcher_claims_only_pack_quantized_int() -> None:
    cfg = _config()
    assert matches_config(cfg)
    nvfp4 = _config()
    group = nvfp4["quantization_config"]["config_groups"]["group_0"]
    group.update(format="nvfp4-pack-quantized")
    group["weights"].update(type="float", group_size=16)
    assert not matches_config(nvfp4)
    fp8 = _config()
    fp8["quantization_config"]["config_groups"]["group_0"]["format"] = "float-quantized"
    assert not matches_config(fp8)
    assert not matches_config({"quantization_config": {"quant_method": "awq"}})


def _write(tmp: Path, tensors: dict[str, np.ndarray], weights: dict[str, Any], **qcfg: Any):
    cfg = _config()
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    cfg["quantization_config"].update(qcfg)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp


def _q_tensors() -> dict[str, np.ndarray]:
    tensors = load_file(str(DATA / CASE / "model.safetensors"))
    return {k: v.copy() for k, v in tensors.items() if k.startswith(Q)}


def test_channel_strategy_is_one_group_per_row(tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
    bufs = CtInt(4, 256, BF16).quantize(w)
    tensors = {
        f"{Q}.weight_packed": bufs["weight"].view(np.int32),
        f"{Q}.weight_scale": bufs["scales"],
        f"{Q}.weight_shape": np.array([256, 256], np.int64),
    }
    ck = load(_write(tmp_path / "ck", tensors, {"strategy": "channel", "group_size": None}))
    lin = ck.linear(Q)
    assert lin.weight.format == CtInt(4, 256, BF16)


@pytest.mark.parametrize(
    ("edit", "weights", "qcfg", "message"),
    [
        (lambda t: t.pop(f"{Q}.weight_scale"), {}, {}, rf"{Q}\.weight_scale: missing"),
        (
            lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].astype(np.int32)}),
            {},
            {},
            rf"{Q}\.weight_scale: dtype int32",
        ),
        (
            lambda t: t.update({f"{Q}.weight_packed": t[f"{Q}.weight_packed"].view(np.float32)}),
            {},
            {},
            rf"{Q}\.weight_packed: float32 \[256, 32\], expected int32",
        ),
        (
            lambda t: t[f"{Q}.weight_scale"].__setitem__((0, 1), np.inf),
            {},
            {},
            rf"{Q}\.weight_scale: contains NaN or Inf",
        ),
        (
            lambda t: None,
            {"group_size": 64},
            {},
            rf"{Q}\.weight_scale: shape \[256, 2\], expected \[256, 4\]",
        ),
        (
            lambda t: t.update({f"{Q}.weight_shape": np.array([256, 250], np.int64)}),
            {},
            {},
            rf"{Q}\.weight_shape: \[256, 250\]",
        ),
        (
            lambda t: None,
            {},
            {"ignore": ["lm_head", Q]},
            rf"{Q}\.weight: missing from .*\(expected an unquantized linear\)",
        ),
        (
            lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight_packed"]}),
            {},
            {"ignore": ["re:.*q_proj$"]},
            rf"{Q}\.weight: int32 \[256, 32\], expected an unquantized f16/bf16/f32",
        ),
        (lambda t: None, {"symmetric": False}, {}, "not supported: compressed-tensors asym"),
        (lambda t: None, {"actorder": "group"}, {}, "not supported: .*actorder group"),
        (lambda t: None, {"strategy": "tensor"}, {}, "not supported: .*strategy tensor"),
    ],
)
def test_refusals_name_the_tensor(
    tmp_path: Path, edit: Any, weights: dict[str, Any], qcfg: dict[str, Any], message: str
) -> None:
    tensors = _q_tensors()
    edit(tensors)
    ck = load(_write(tmp_path / "ck", tensors, weights, **qcfg))
    with pytest.raises(FormatError, match=message) as info:
        ck.linear(Q)
    assert "\n" not in str(info.value)


def _dense_q(tmp: Path, **qcfg: Any) -> tuple[Path, np.ndarray]:
    """A checkpoint whose q_proj is stored unquantized: a bf16 `.weight`, no weight_packed."""
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(ml_dtypes.bfloat16)
    return _write(tmp, {f"{Q}.weight": w}, {}, **qcfg), w


@pytest.mark.parametrize(
    "ignore", [["lm_head", Q], ["re:.*q_proj$"], ["self_attn.q_proj"], ["lm_head"]]
)
def test_ignored_modules_read_dense(tmp_path: Path, ignore: list[str]) -> None:
    path, w = _dense_q(tmp_path / "ck", ignore=ignore)
    lin = load(path).linear(Q)
    assert lin.weight.format.spell() == "dense<dtype=bf16>"
    np.testing.assert_array_equal(lin.buffers["weight"], w)


def test_group_targets_select_modules(tmp_path: Path) -> None:
    tensors = _q_tensors()
    ck = load(_write(tmp_path / "ck", tensors, {}))
    cfg = ck.config["quantization_config"]["config_groups"]["group_0"]
    cfg["targets"] = ["re:.*mlp.*"]
    # Targeted by no group: an unquantized linear, so `.weight` (absent here) is what it needs.
    with pytest.raises(FormatError, match=rf"{Q}\.weight: missing .*expected an unquantized"):
        ck.linear(Q)
    cfg["targets"] = ["re:.*self_attn.q_proj"]
    assert ck.linear(Q).weight.format == CtInt(4, 128, BF16)
    path, w = _dense_q(tmp_path / "dense")
    ck = load(path)
    ck.config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    lin = ck.linear(Q)
    assert lin.weight.format.spell() == "dense<dtype=bf16>"
    np.testing.assert_array_equal(lin.buffers["weight"], w)


# ---- end to end and kernels ------------------------------------------------------------------


@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_fixture_block_reference_matches_golden(block: str) -> None:
    check_fixture_block(CASE, block, ("reference",))


@needs_host
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_fixture_block_host_matches_reference_and_golden(block: str) -> None:
    check_fixture_block(CASE, block, ("reference", "host"))


@needs_host
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([32, 64, 128]),
    n=st.integers(1, 37),
    k_groups=st.integers(1, 3),
    m=st.integers(1, 9),
    scale_dtype=st.sampled_from([BF16, F16, F32]),
    seed=st.integers(0, 2**16),
)
def test_host_qlinear_equals_reference(bits, group, n, k_groups, m, scale_dtype, seed) -> None:
    rng = np.random.default_rng(seed)
    fmt = CtInt(bits, group, scale_dtype)
    k = group * k_groups
    bufs = fmt.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.05)
    check_qlinear_host(QWeight(fmt, n, k), bufs, m, rng, F32)
