"""MLX affine format: golden decode of real mlx-lm checkpoints, MLX's quantizer, config parsing."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from qir.dtypes import BF16, F16, F32, U32, DType
from qir.formats import parse_format
from qir.formats.base import FormatError
from qir.formats.bitstream import pack_codes, unpack_codes
from qir.formats.mlx import BITS, GROUP_SIZES, SCALE_DTYPES, MlxAffine, from_config, matches_config
from qir.models.checkpoint import LAYER_LINEARS
from tests.requires import requires

DATA = Path(__file__).resolve().parents[1] / "data"
CASES = ["mlx_affine4_g64_S", "mlx_affine8_g64_S", "mlx_mixed_3_6_S"]


@pytest.mark.parametrize("case", CASES)
def test_fixture_dequantize_matches_golden_bit_exactly(case: str) -> None:
    tensors = load_file(str(DATA / case / "model.safetensors"))
    golden = np.load(DATA / case / "golden.npz")
    qcfg = json.loads((DATA / case / "config.json").read_text())["quantization"]
    for p, local in LAYER_LINEARS.items():
        module = f"model.layers.0.{local}"
        fmt = from_config(qcfg, module, BF16)
        assert fmt is not None
        want = golden[f"W.0.{p}"]
        bufs = {n: tensors[f"{module}.{n}"] for n in ("weight", "scales", "biases")}
        got = fmt.dequantize(bufs, *want.shape)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want, err_msg=f"{case} {module}")


def test_mixed_overrides_resolved_per_module() -> None:
    qcfg = json.loads((DATA / "mlx_mixed_3_6_S" / "config.json").read_text())["quantization"]
    bits = {}
    for p, local in LAYER_LINEARS.items():
        fmt = from_config(qcfg, f"model.layers.0.{local}", BF16)
        assert fmt is not None and fmt.group_size == 64
        bits[p] = fmt.bits
    assert bits == {"q": 3, "k": 3, "v": 6, "o": 3, "gate": 3, "up": 3, "down": 6}


def test_from_config_override_forms() -> None:
    qcfg = {
        "bits": 4,
        "group_size": 32,
        "mode": "affine",
        "a": False,
        "b": True,
        "c": {"bits": 8, "group_size": None, "mode": "affine"},
        "d": {"bits": 4, "group_size": 64, "mode": "nvfp4"},
    }
    assert from_config(qcfg, "a", BF16) is None
    assert from_config(qcfg, "b", F16) == MlxAffine(4, 32, F16)
    assert from_config(qcfg, "unlisted", F32) == MlxAffine(4, 32, F32)
    # mlx-lm writes null when --q-group-size was not given; MLX then uses the mode default 64.
    assert from_config(qcfg, "c", BF16) == MlxAffine(8, 64, BF16)
    with pytest.raises(FormatError, match=r"not supported: MLX mode nvfp4 .*'d'"):
        from_config(qcfg, "d", BF16)
    with pytest.raises(FormatError, match="not supported: MLX mode mxfp4"):
        from_config({"bits": 4, "group_size": 32, "mode": "mxfp4"}, "x", BF16)


def test_matches_config() -> None:
    assert matches_config({"quantization": {"bits": 4, "group_size": 64}})
    assert matches_config({"quantization_config": {"bits": 4, "group_size": 64, "mode": "affine"}})
    assert not matches_config({"quantization": {"bits": 4, "group_size": 32, "mode": "nvfp4"}})
    assert not matches_config({"quantization_config": {"quant_method": "awq", "bits": 4}})
    assert not matches_config({"hidden_size": 8})


def test_arange_row_gives_negative_scale() -> None:
    # docs/formats.md (MLX's quantizer): the max edge has the larger magnitude, so it becomes the bias (code 0) and
    # the scale is negative: 0..15 -> scale -1, bias 15, code 15 - x.
    row = np.tile(np.arange(16, dtype=np.float32), 2)[None]
    out = MlxAffine(4, 32, F32).quantize(row)
    np.testing.assert_array_equal(out["scales"], [[-1.0]])
    np.testing.assert_array_equal(out["biases"], [[15.0]])
    np.testing.assert_array_equal(unpack_codes(out["weight"], 4, 32), 15 - row)
    # Low nibble first: codes 15, 14, ..., 8 in word 0.
    assert out["weight"][0, 0] == 0x89ABCDEF


def test_negative_edge_gives_positive_scale() -> None:
    row = -np.tile(np.arange(16, dtype=np.float32), 2)[None]
    out = MlxAffine(4, 32, F32).quantize(row)
    np.testing.assert_array_equal(out["scales"], [[1.0]])
    np.testing.assert_array_equal(out["biases"], [[-15.0]])
    np.testing.assert_array_equal(unpack_codes(out["weight"], 4, 32), row + 15)


def test_constant_zero_group() -> None:
    out = MlxAffine(4, 32, BF16).quantize(np.zeros((1, 32), np.float32))
    assert out["biases"][0, 0] == 0
    assert out["scales"][0, 0] == ml_dtypes.bfloat16(-1e-7)
    assert not out["weight"].any()


@pytest.mark.parametrize("bits", BITS)
def test_pack_codes_bit_order(bits: int) -> None:
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, size=(3, 64), dtype=np.uint32)
    words = pack_codes(q, bits)
    assert words.dtype == np.uint32 and words.shape == (3, 64 * bits // 32)
    # Element j at stream bits [j*bits, (j+1)*bits), stream bit k = bit k%32 of word k//32.
    stream = [[(int(w) >> b) & 1 for w in row for b in range(32)] for row in words]
    for r in range(3):
        for j in range(64):
            code = sum(stream[r][j * bits + b] << b for b in range(bits))
            assert code == q[r, j]
    np.testing.assert_array_equal(unpack_codes(words, bits, 64), q)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("width", [1, 11, 40, 100])
def test_codes_of_a_ragged_width_round_trip_bit_by_bit(bits: int, width: int) -> None:
    """Widths that end inside a word or inside a group of words (3-bit codes: 32 a group of 3
    words): the last word is zero-filled, each code at stream bits [j*bits, (j+1)*bits)."""
    rng = np.random.default_rng(width)
    q = rng.integers(0, 1 << bits, size=(2, width), dtype=np.uint32)
    words = pack_codes(q | np.uint32(1 << bits), bits)  # bits above `bits` are dropped
    assert words.shape == (2, -(-width * bits // 32)) and words.flags.c_contiguous
    stream = [[(int(w) >> b) & 1 for w in row for b in range(32)] for row in words]
    for r in range(2):
        codes = [sum(stream[r][j * bits + b] << b for b in range(bits)) for j in range(width)]
        assert codes == q[r].tolist() and not any(stream[r][width * bits :])
    np.testing.assert_array_equal(unpack_codes(words, bits, width), q)
    assert unpack_codes(pack_codes(q[:0], bits), bits, width).shape == (0, width)  # no rows
    with pytest.raises(ValueError, match=f"fewer than {width + 32} codes"):
        unpack_codes(words, bits, width + 32)


def _reference_codes(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """docs/formats.md's MLX quantizer step by step on float32 scalars, one group at a time."""
    f32 = np.float32
    n_bins = f32((1 << bits) - 1)
    out = np.zeros(w.shape, np.uint32)
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], group):
            vals = w[r, g0 : g0 + group]
            lo, hi = f32(vals.min()), f32(vals.max())
            s = max(f32((hi - lo) / n_bins), f32(1e-7))
            edge = lo if abs(lo) > abs(hi) else hi
            s = s if abs(lo) > abs(hi) else -s
            q0 = np.rint(f32(edge / s))
            s, b = (f32(edge / q0), edge) if q0 != 0 else (s, f32(0))
            for j, v in enumerate(vals):
                out[r, g0 + j] = min(max(np.rint(f32(f32(v - b) / s)), f32(0)), n_bins)
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_quantize_codes_match_scalar_reference(bits: int) -> None:
    rng = np.random.default_rng(100 + bits)
    w = rng.standard_normal((4, 128), dtype=np.float32)
    w[0, :32] = np.linspace(-1, 1, 32)  # a symmetric group: the clamped far end
    w[1, :64] = 0.5  # a constant group: q0 == 0 path
    out = MlxAffine(bits, 32, BF16).quantize(w)
    np.testing.assert_array_equal(
        unpack_codes(out["weight"], bits, 128), _reference_codes(w, bits, 32)
    )


def _check_error_bound(fmt: MlxAffine, w: np.ndarray) -> None:
    """|dequant - w| <= |s|/2 inside the representable range, the distance to it outside.

    The far end can lie outside: MLX snaps the scale so the bias edge is exact, which can shrink
    the range by up to one step (clamped codes); with f16/bf16 the stored scale and bias are
    rounded too, which adds at most n_bins*|ds| + |db|.
    """
    out_f, in_f = w.shape
    exact = MlxAffine(fmt.bits, fmt.group_size, F32).quantize(w)
    out = fmt.quantize(w)
    # Codes use the unrounded float32 scale/bias, so they do not depend on the scale dtype.
    np.testing.assert_array_equal(out["weight"], exact["weight"])
    n = (1 << fmt.bits) - 1
    shape = (out_f, in_f // fmt.group_size, 1)
    s, b = exact["scales"].reshape(shape), exact["biases"].reshape(shape)
    s_st = out["scales"].astype(np.float32).reshape(shape)
    b_st = out["biases"].astype(np.float32).reshape(shape)
    wg = w.reshape(out_f, -1, fmt.group_size)
    lo, hi = np.minimum(b, b + n * s), np.maximum(b, b + n * s)
    outside = np.maximum(np.maximum(lo - wg, wg - hi), 0)
    assert np.all(outside <= np.abs(s) * (1 + 1e-5) + 1e-6)
    slack = 1e-6 * (np.abs(wg).max() + 1)
    bound = np.maximum(np.abs(s) / 2, outside) + n * np.abs(s - s_st) + np.abs(b - b_st) + slack
    got = fmt.dequantize(out, out_f, in_f).reshape(wg.shape)
    assert np.all(np.abs(got - wg) <= bound)


@pytest.mark.parametrize("fmt", [MlxAffine(4, 64, BF16), MlxAffine(3, 32, F32)])
def test_round_trip_error_bound(fmt: MlxAffine) -> None:
    w = np.random.default_rng(7).standard_normal((16, 256), dtype=np.float32)
    _check_error_bound(fmt, w)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    group=st.sampled_from(GROUP_SIZES),
    scale_dtype=st.sampled_from(SCALE_DTYPES),
    out_f=st.integers(1, 6),
    n_groups=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([1e-3, 1.0, 100.0]),
)
def test_quantize_round_trip_property(
    bits: int,
    group: int,
    scale_dtype: DType,
    out_f: int,
    n_groups: int,
    seed: int,
    spread: float,
) -> None:
    fmt = MlxAffine(bits, group, scale_dtype)
    assert parse_format(fmt.spell()) == fmt
    in_f = group * n_groups
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_f, in_f)) * spread + rng.normal()).astype(np.float32)
    out = fmt.quantize(w)
    for name, t in fmt.buffers(out_f, in_f).items():
        assert out[name].shape == t.shape and out[name].dtype == t.dtype.np
    fmt.check_buffers(out, out_f, in_f, where="q")
    got = fmt.dequantize(out, out_f, in_f)
    assert got.shape == (out_f, in_f) and got.dtype == np.float32
    _check_error_bound(fmt, w)


def test_spell_tag_and_sizes() -> None:
    fmt = MlxAffine(4, 64, BF16)
    assert fmt.spell() == "mlx_affine<bits=4,group_size=64,scale_dtype=bf16>"
    assert parse_format(fmt.spell()) == fmt
    assert fmt.tag() == "mlx4g64bf16"
    assert fmt.fragment == "mlx_affine"
    assert fmt.bytes_per_weight() == 0.5 + 4 / 64
    assert {k: (t.shape, t.dtype) for k, t in fmt.buffers(512, 256).items()} == {
        "weight": ((512, 32), U32),
        "scales": ((512, 4), BF16),
        "biases": ((512, 4), BF16),
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 7, "group_size": 64, "scale_dtype": BF16}, "bits=7"),
        ({"bits": 4, "group_size": 48, "scale_dtype": BF16}, "group_size=48"),
        ({"bits": 4, "group_size": 64, "scale_dtype": U32}, "scale_dtype=u32"),
    ],
)
def test_invalid_parameters(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        MlxAffine(**kwargs)  # type: ignore[arg-type]


def test_check_shape_messages() -> None:
    with pytest.raises(FormatError, match="in_features 96 is not a multiple of the group size 64"):
        MlxAffine(4, 64, BF16).check_shape(8, 96)
    with pytest.raises(FormatError, match="empty"):
        MlxAffine(4, 64, BF16).check_shape(0, 64)


def test_dequantize_rejects_wrong_buffers() -> None:
    fmt = MlxAffine(4, 64, BF16)
    bufs = fmt.quantize(np.ones((2, 64), np.float32))
    bufs["scales"] = bufs["scales"].astype(np.float16)
    with pytest.raises(FormatError, match="scales: dtype float16"):
        fmt.dequantize(bufs, 2, 64)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("scale_dtype", [F16, BF16, F32])
@requires("mlx")
def test_matches_real_mlx(bits: int, scale_dtype: DType) -> None:
    import mlx.core as mx

    w = np.random.default_rng(bits).standard_normal((8, 128), dtype=np.float32)
    mx_dtype = {F16: mx.float16, BF16: mx.bfloat16, F32: mx.float32}[scale_dtype]
    wq, scales, biases = mx.quantize(mx.array(w).astype(mx_dtype), group_size=64, bits=bits)
    ours = MlxAffine(bits, 64, scale_dtype).quantize(
        np.asarray(mx.array(w).astype(mx_dtype).astype(mx.float32))
    )
    np.testing.assert_array_equal(np.asarray(wq), ours["weight"])
    for name, theirs in (("scales", scales), ("biases", biases)):
        np.testing.assert_array_equal(
            np.asarray(theirs.astype(mx.float32)), ours[name].astype(np.float32)
        )
