"""GPTQ v1/v2, 2/3/4/8-bit, with and without act-order: checkpoints written by our own packer
(from docs/formats.md's GPTQ row, independent of the unpacker), repack, quantizer, refusals, and the kernels
on the host backend (no fixture exists for GPTQ)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import qir
from qir.dtypes import BF16, F16, F32, I32, U8, U32
from qir.formats.base import FormatError
from qir.formats.gptq import BITS, Gptq, repack
from qir.models import load
from qir.models.blocks import build
from qir.types import QWeight
from tests.conftest import max_rel
from tests.formats.int_common import (
    HOST_TOL_F16,
    check_qlinear_host,
    check_spell,
    needs_host,
)

OFFSET = {"gptq": 1, "gptq_v2": 0}


# ---- our own packer, straight from formats.md ----------------------------------------------


def pack_columns(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes [N, C] along axis 0 into int32 [N*bits/32, C].

    2/4/8-bit: element i at bits bits*(i % (32/bits)) of row i // (32/bits). 3-bit: 32 values per
    3 words: values 0-9 at 3j in word 0, value 10 split (2 low bits at 30-31 of word 0, 1 bit at
    bit 0 of word 1), values 11-20 at 3j+1 of word 1, value 21 split (bit 31 of word 1, 2 bits at
    bits 0-1 of word 2), values 22-31 at 3j+2 of word 2."""
    n, cols = codes.shape
    c = codes.astype(np.uint64)
    out = np.zeros((n * bits // 32, cols), np.uint64)
    if bits != 3:
        per = 32 // bits
        for i in range(n):
            out[i // per] |= c[i] << np.uint64(bits * (i % per))
    else:
        for b in range(n // 32):
            v, w = c[32 * b : 32 * b + 32], 3 * b
            for j in range(10):
                out[w] |= v[j] << np.uint64(3 * j)
                out[w + 1] |= v[11 + j] << np.uint64(3 * j + 1)
                out[w + 2] |= v[22 + j] << np.uint64(3 * j + 2)
            out[w] |= (v[10] & np.uint64(3)) << np.uint64(30)
            out[w + 1] |= v[10] >> np.uint64(2)
            out[w + 1] |= (v[21] & np.uint64(1)) << np.uint64(31)
            out[w + 2] |= v[21] >> np.uint64(1)
    return (out & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def checkpoint(
    rng: np.random.Generator, bits: int, out_f: int, in_f: int, g: int, ckfmt: str, shuffle: bool
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Checkpoint tensors (qweight, qzeros, scales, g_idx) and the float32 W [O, I] they mean."""
    n = -(-in_f // g)
    g_idx = (np.arange(in_f) // g).astype(np.int32)
    if shuffle:
        g_idx = rng.permutation(g_idx).astype(np.int32)
    q = rng.integers(0, 1 << bits, (in_f, out_f))
    stored = rng.integers(0, 1 << bits, (n, out_f))
    s = (rng.random((n, out_f)) * 0.02 + 1e-3).astype(np.float16)
    z = stored + OFFSET[ckfmt]
    w = (q - z[g_idx]).astype(np.float32) * s[g_idx].astype(np.float32)
    tensors = {
        "qweight": pack_columns(q, bits),
        "qzeros": np.ascontiguousarray(pack_columns(stored.T, bits).T),
        "scales": s,
        "g_idx": g_idx,
    }
    return tensors, np.ascontiguousarray(w.T)


def test_three_bit_packer_is_a_bitstream() -> None:
    """Value i of a 3-bit column sits at stream bits [3i, 3i+3) of its 3-word block."""
    codes = np.arange(32)[:, None] % 8
    words = pack_columns(codes, 3).view(np.uint32)[:, 0]
    stream = sum(int(x) << (32 * k) for k, x in enumerate(words))
    assert [(stream >> (3 * i)) & 7 for i in range(32)] == list(codes[:, 0])


# ---- repack ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    ckfmt=st.sampled_from(["gptq", "gptq_v2"]),
    group=st.sampled_from([32, 64, 128, -1]),
    out_units=st.integers(1, 3),
    in_units=st.integers(1, 6),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_repack_round_trip(bits, ckfmt, group, out_units, in_units, shuffle, seed) -> None:
    rng = np.random.default_rng(seed)
    out_f, in_f = 32 * out_units, 32 * in_units
    g = in_f if group == -1 else group
    tensors, w = checkpoint(rng, bits, out_f, in_f, g, ckfmt, shuffle)
    fmt, o, i, bufs = repack(*tensors.values(), bits, group, ckfmt, "m")
    assert (o, i) == (out_f, in_f)
    trivial = np.array_equal(tensors["g_idx"], np.arange(in_f) // g)
    assert fmt == Gptq(bits, g, ckfmt, int(not trivial), F16)
    check_spell(fmt)
    np.testing.assert_array_equal(fmt.dequantize(bufs, o, i), w)


def test_missing_g_idx_is_the_trivial_map() -> None:
    tensors, w = checkpoint(np.random.default_rng(0), 4, 64, 256, 64, "gptq", False)
    del tensors["g_idx"]
    fmt, o, i, bufs = repack(*tensors.values(), None, 4, 64, "gptq", "m")
    assert fmt.act_order == 0 and "g_idx" not in bufs
    np.testing.assert_array_equal(fmt.dequantize(bufs, o, i), w)


def test_v1_stored_all_ones_zero_means_two_to_the_bits() -> None:
    """v1 decoders add 1 to the masked field, so 0xF means zero 16 (the '+1 quirk')."""
    fmt = Gptq(4, 32, "gptq", 0, F32)
    bufs = {
        "weight": np.zeros((1, 4), np.uint32),
        "zeros": np.full((1, 1), 15, np.uint8),
        "scales": np.ones((1, 1), np.float32),
    }
    np.testing.assert_array_equal(fmt.dequantize(bufs, 1, 32), np.full((1, 32), -16.0))


# ---- quantizer -----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    ckfmt=st.sampled_from(["gptq", "gptq_v2"]),
    out_f=st.integers(1, 5),
    n_groups=st.integers(1, 4),
    shuffle=st.booleans(),
    shift=st.sampled_from([0.0, 3.0, -3.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_quantize_error_bound(bits, ckfmt, out_f, n_groups, shuffle, shift, seed) -> None:
    """|dequant - w| <= s/2 plus the f32 scale's rounding: GPTQ's range always includes 0 and v1
    groups without negatives spend one level on zero 1, so every weight lies on the grid."""
    rng = np.random.default_rng(seed)
    fmt = Gptq(bits, 32, ckfmt, int(shuffle), F32)
    in_f = 32 * n_groups
    w = (rng.standard_normal((out_f, in_f)) + shift).astype(np.float32)
    g_idx = np.arange(in_f, dtype=np.int32) // 32
    if shuffle:
        g_idx = rng.permutation(g_idx).astype(np.int32)
    bufs = fmt.quantize_grouped(w, g_idx)
    fmt.check_buffers(bufs, out_f, in_f, where="q")
    got = fmt.dequantize(bufs, out_f, in_f)
    s = bufs["scales"][:, g_idx]
    assert np.all(np.abs(got - w) <= s * (0.5 + 1e-4) + 1e-6)


def test_quantize_needs_act_order_for_a_shuffled_map() -> None:
    fmt = Gptq(4, 32, "gptq", 0, F16)
    g_idx = np.arange(64, dtype=np.int32)[::-1] // 32
    with pytest.raises(FormatError, match="non-trivial g_idx needs act_order=1"):
        fmt.quantize_grouped(np.zeros((2, 64), np.float32), g_idx)


# ---- format facts and refusals ---------------------------------------------------------------


def test_spell_tag_sizes_and_buffers() -> None:
    fmt = Gptq(4, 128, "gptq", 1, F16)
    assert fmt.spell() == (
        "gptq<bits=4,group_size=128,checkpoint_format=gptq,act_order=1,scale_dtype=f16>"
    )
    check_spell(fmt)
    assert fmt.tag() == "gptq4g128actf16"
    assert Gptq(3, 64, "gptq_v2", 0, BF16).tag() == "gptqv23g64bf16"
    assert fmt.fragment == "gptq"
    assert fmt.bytes_per_weight() == 0.5 + 3 / 128
    assert {k: (t.shape, t.dtype) for k, t in fmt.buffers(512, 320).items()} == {
        "weight": ((512, 40), U32),
        "zeros": ((512, 3), U8),
        "scales": ((512, 3), F16),
        "g_idx": ((320,), I32),
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 5}, "bits=5 not supported"),
        ({"checkpoint_format": "marlin"}, "not supported: GPTQ checkpoint_format marlin"),
        ({"act_order": 2}, "act_order=2"),
        ({"scale_dtype": U8}, "scale_dtype=u8"),
        ({"group_size": 0}, "group_size=0"),
    ],
)
def test_invalid_parameters(kwargs: dict[str, Any], message: str) -> None:
    args = {"bits": 4, "group_size": 128, "checkpoint_format": "gptq", "act_order": 0}
    with pytest.raises(FormatError, match=message):
        Gptq(**{**args, "scale_dtype": F16, **kwargs})


HIDDEN, INTER = 128, 256
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "torch_dtype": "float16",
}
MLP = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}


def _write_mlp(
    tmp: Path, bits: int, ckfmt: str, shuffle: bool, seed: int = 0, **qcfg: Any
) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    tensors, ws = {}, {}
    for p, (o, i) in MLP.items():
        t, w = checkpoint(rng, bits, o, i, 64, ckfmt, shuffle)
        module = f"model.layers.0.mlp.{p}_proj"
        tensors |= {f"{module}.{k}": v for k, v in t.items()}
        ws[module] = w
    q = {"quant_method": "gptq", "bits": bits, "group_size": 64, "desc_act": shuffle, "sym": True}
    q |= {"checkpoint_format": ckfmt, **qcfg}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": q}))
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp, tensors, ws


UP = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("ckfmt", ["gptq", "gptq_v2"])
def test_checkpoint_loads_and_decodes(tmp_path: Path, bits: int, ckfmt: str) -> None:
    path, _, ws = _write_mlp(tmp_path / "ck", bits, ckfmt, shuffle=True)
    ck = load(path)
    for module, w in ws.items():
        lin = ck.linear(module)
        assert lin.weight.format == Gptq(bits, 64, ckfmt, 1, F16)
        np.testing.assert_array_equal(lin.weight.format.dequantize(lin.buffers, *w.shape), w)


def _edit(tensors: dict[str, np.ndarray], name: str, value: np.ndarray) -> None:
    tensors[f"{UP}.{name}"] = value


@pytest.mark.parametrize(
    ("edit", "qcfg", "message"),
    [
        (lambda t: t.pop(f"{UP}.qzeros"), {}, rf"{UP}\.qzeros: missing"),
        (
            lambda t: _edit(t, "qweight", t[f"{UP}.qweight"].view(np.float32)),
            {},
            rf"{UP}\.qweight: dtype float32, expected int32",
        ),
        (
            lambda t: _edit(t, "scales", t[f"{UP}.scales"].astype(np.int32)),
            {},
            rf"{UP}\.scales: dtype int32",
        ),
        (
            lambda t: t[f"{UP}.scales"].__setitem__((0, 0), np.nan),
            {},
            rf"{UP}\.scales: contains NaN or Inf",
        ),
        (lambda t: None, {"group_size": 32}, rf"{UP}\.qzeros: shape \[2, 32\], expected \[4, 32\]"),
        (
            lambda t: t[f"{UP}.g_idx"].__setitem__(0, 7),
            {},
            rf"{UP}\.g_idx: values in \[0, 7\], expected \[0, 2\)",
        ),
        (
            lambda t: _edit(t, "g_idx", t[f"{UP}.g_idx"][:-1]),
            {},
            rf"{UP}\.g_idx: int32 \[127\], expected int32 \[128\]",
        ),
        (lambda t: None, {"checkpoint_format": "marlin"}, "not supported: GPTQ checkpoint_format"),
        (lambda t: None, {"bits": 5}, "not supported: GPTQ 5-bit"),
        (
            lambda t: None,
            {"modules_to_not_convert": ["up_proj"]},
            rf"{UP}\.weight: missing from .*\(expected an unquantized linear\)",
        ),
        (
            lambda t: _edit(t, "weight", t[f"{UP}.qweight"]),
            {"modules_to_not_convert": ["up_proj"]},
            rf"{UP}\.weight: int32 \[16, 256\], expected an unquantized f16/bf16/f32",
        ),
    ],
)
def test_refusals_name_the_tensor(tmp_path: Path, edit: Any, qcfg: dict[str, Any], message: str):
    path, tensors, _ = _write_mlp(tmp_path / "ck", 4, "gptq", shuffle=True)
    tensors = {k: v.copy() for k, v in tensors.items()}
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(qcfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=message) as info:
        load(path).linear(UP)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("skipped", [["up_proj"], ["mlp"], None])
def test_unquantized_modules_read_dense(tmp_path: Path, skipped: list[str] | None) -> None:
    """modules_to_not_convert (a substring test), or no list at all: a module stored as a 16-bit
    `.weight` without `.qweight` (GPTQ quantizes only the decoder blocks' linears)."""
    path, tensors, _ = _write_mlp(tmp_path / "ck", 4, "gptq", shuffle=False)
    w = np.random.default_rng(1).standard_normal(MLP["up"]).astype(BF16.np)
    tensors = {k: v for k, v in tensors.items() if not k.startswith(UP + ".")}
    save_file({**tensors, f"{UP}.weight": w}, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = skipped
    (path / "config.json").write_text(json.dumps(cfg))
    lin = load(path).linear(UP)
    assert lin.weight.format.spell() == "dense<dtype=bf16>"
    np.testing.assert_array_equal(lin.buffers["weight"], w)


# ---- end to end and kernels ------------------------------------------------------------------


@needs_host
@pytest.mark.parametrize(("bits", "ckfmt", "shuffle"), [(4, "gptq", True), (3, "gptq_v2", False)])
def test_mlp_block_host_matches_reference(tmp_path: Path, bits: int, ckfmt: str, shuffle: bool):
    path, _, _ = _write_mlp(tmp_path / "ck", bits, ckfmt, shuffle)
    b = build(load(path), "mlp", 0, F16)
    host = qir.compile(b.graph, b.weights, backend="host")
    ref = qir.compile(b.graph, b.weights, backend="reference")
    rng = np.random.default_rng(1)
    for m in (1, 5, 11):
        x = rng.standard_normal((m, HIDDEN), dtype=np.float32).astype(np.float16)
        ours, theirs = host({"x": x})["y"], ref({"x": x})["y"]
        assert max_rel(ours, theirs) <= HOST_TOL_F16, m


@needs_host
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bits=st.sampled_from(BITS),
    ckfmt=st.sampled_from(["gptq", "gptq_v2"]),
    group=st.sampled_from([32, 64, 128]),
    act_order=st.sampled_from([0, 1]),
    n=st.integers(1, 37),
    k_units=st.integers(1, 4),
    m=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_host_qlinear_equals_reference(bits, ckfmt, group, act_order, n, k_units, m, seed):
    rng = np.random.default_rng(seed)
    k = 32 * k_units
    fmt = Gptq(bits, group, ckfmt, act_order, F16)
    g_idx = np.arange(k, dtype=np.int32) // group
    if act_order:
        g_idx = rng.permutation(g_idx).astype(np.int32)
    bufs = fmt.quantize_grouped(rng.standard_normal((n, k), dtype=np.float32) * 0.05, g_idx)
    check_qlinear_host(QWeight(fmt, n, k), bufs, m, rng, F32)
