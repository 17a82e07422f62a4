"""AutoAWQ int4: GEMM repack and GEMV read against the real AutoAWQ fixtures' goldens, our own
independent packers, AutoAWQ's quantizer, refusals, and the kernels on the host backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from qir.dtypes import F16, F32, U32
from qir.formats.awq import GROUP_SIZES, Awq, read_gemv, repack_gemm, unpack_gemm, zeros_width
from qir.formats.base import FormatError
from qir.models import load
from qir.models.checkpoint import LAYER_LINEARS
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

CASES = ("awq_gemm_g64_S", "awq_gemv_g64_S")
LAYER = "model.layers.0"
# docs/formats.md (AutoAWQ GEMM): logical column c of a GEMM word sits at nibble slot SLOT[c].
SLOT = (0, 4, 1, 5, 2, 6, 3, 7)


# ---- independent packers and the documented kernel read formula ----------------------------


def pack_gemm(codes: np.ndarray) -> np.ndarray:
    """int32 [R, C/8] from codes [R, C] in AutoAWQ's interleaved order, one nibble at a time."""
    rows, cols = codes.shape
    out = np.zeros((rows, cols // 8), np.uint32)
    for c in range(cols):
        out[:, c // 8] |= codes[:, c].astype(np.uint32) << np.uint32(4 * SLOT[c % 8])
    return out.view(np.int32)


def pack_plain(codes: np.ndarray) -> np.ndarray:
    """int32 [R, C/8], element c at bits 4*(c%8) of word c//8 (GEMV and the kernel layout)."""
    rows, cols = codes.shape
    out = np.zeros((rows, -(-cols // 8)), np.uint32)
    for c in range(cols):
        out[:, c // 8] |= codes[:, c].astype(np.uint32) << np.uint32(4 * (c % 8))
    return out.view(np.int32)


def kernel_read(bufs: dict[str, np.ndarray], out_f: int, in_f: int, g: int) -> np.ndarray:
    """W[o, i] element by element, exactly as the fragment reads the kernel buffers."""
    w = np.zeros((out_f, in_f), np.float32)
    for o in range(out_f):
        for i in range(in_f):
            q = (int(bufs["weight"][o, i // 8]) >> (4 * (i % 8))) & 15
            z = (int(bufs["zeros"][o, i // g // 8]) >> (4 * (i // g % 8))) & 15
            w[o, i] = np.float32(q - z) * np.float32(bufs["scales"][o, i // g])
    return w


def random_checkpoint(
    rng: np.random.Generator, out_f: int, in_f: int, g: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Codes [O, I], zeros [O, I/g], scales [O, I/g] f16 and the float32 weight they decode to."""
    n = in_f // g
    q = rng.integers(0, 16, (out_f, in_f))
    z = rng.integers(0, 16, (out_f, n))
    s = (rng.random((out_f, n)) * 0.02 + 1e-3).astype(np.float16)
    w = (q - np.repeat(z, g, axis=1)).astype(np.float32) * np.repeat(s, g, axis=1).astype(
        np.float32
    )
    return q, z, s, w


def gemm_tensors(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, ...]:
    return pack_gemm(q.T), pack_gemm(z.T), np.ascontiguousarray(s.T)


def gemv_tensors(q: np.ndarray, z: np.ndarray, s: np.ndarray, g: int) -> tuple[np.ndarray, ...]:
    zw = zeros_width(q.shape[1], g)
    zp = np.zeros((q.shape[0], 8 * zw), np.int64)
    zp[:, : z.shape[1]] = z
    sp = np.zeros((q.shape[0], 8 * zw), np.float16)
    sp[:, : s.shape[1]] = s
    return pack_plain(q), pack_plain(zp), sp


# ---- the real AutoAWQ fixtures --------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_fixture_linears_match_golden_bit_exactly(case: str) -> None:
    ck = load(DATA / case)
    gold = golden(case)
    for p in PROJ:
        lin = ck.linear(ck.layer_module(0, p))
        want = gold[f"W.0.{p}"]
        assert lin.weight.format == Awq(4, 64)
        assert (lin.weight.out_features, lin.weight.in_features) == want.shape
        got = lin.weight.format.dequantize(lin.buffers, *want.shape)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want, err_msg=f"{case} {p}")


def test_gemv_fixture_is_read_without_copies() -> None:
    ck = load(DATA / "awq_gemv_g64_S")
    lin = ck.linear(ck.layer_module(0, "down"))
    for a in lin.buffers.values():
        assert not a.flags.owndata and not a.flags.writeable


@pytest.mark.parametrize("p", ["q", "down"])
def test_fixture_kernel_read_formula_matches_golden(p: str) -> None:
    """The documented per-element read of the kernel layout decodes the golden exactly."""
    ck = load(DATA / "awq_gemm_g64_S")
    lin = ck.linear(ck.layer_module(0, p))
    want = golden("awq_gemm_g64_S")[f"W.0.{p}"]
    np.testing.assert_array_equal(kernel_read(lin.buffers, *want.shape, 64), want)


def test_gemm_and_gemv_fixtures_repack_to_identical_buffers() -> None:
    gemm, gemv = load(DATA / "awq_gemm_g64_S"), load(DATA / "awq_gemv_g64_S")
    for p in PROJ:
        a = gemm.linear(gemm.layer_module(0, p)).buffers
        b = gemv.linear(gemv.layer_module(0, p)).buffers
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{p}.{name}")


def test_sabotage_sequentially_packed_gemm_fails_golden() -> None:
    """A GEMM checkpoint packed in plain nibble order must not decode to the golden: this is the
    test that catches a repack which ignores AutoAWQ's interleaving."""
    tensors = load_file(str(DATA / "awq_gemm_g64_S" / "model.safetensors"))
    module = f"{LAYER}.{LAYER_LINEARS['q']}"
    qw, qz, s = (tensors[f"{module}.{n}"] for n in ("qweight", "qzeros", "scales"))
    want = golden("awq_gemm_g64_S")["W.0.q"]
    # The true codes, repacked sequentially, as a loader that forgot the order would store them.
    bad_qw, bad_qz = pack_plain(unpack_gemm(qw)), pack_plain(unpack_gemm(qz))
    for qw_, qz_ in ((bad_qw, qz), (qw, bad_qz)):
        fmt, o, i, bufs = repack_gemm(qw_, qz_, s, 64, module)
        assert not np.array_equal(fmt.dequantize(bufs, o, i), want)
    # Our own interleaving packer reproduces AutoAWQ's bytes exactly.
    np.testing.assert_array_equal(pack_gemm(unpack_gemm(qw)), qw)


# ---- repack / read over random shapes ------------------------------------------------------


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    group=st.sampled_from(GROUP_SIZES),
    out_words=st.integers(1, 5),
    n_groups=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_repack_and_read_round_trip(group: int, out_words: int, n_groups: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    out_f, in_f = 8 * out_words, group * n_groups
    q, z, s, w = random_checkpoint(rng, out_f, in_f, group)
    fmt, o, i, bufs = repack_gemm(*gemm_tensors(q, z, s), group, "m")
    assert (fmt, o, i) == (Awq(4, group), out_f, in_f)
    fmt.check_buffers(bufs, o, i, where="m")
    np.testing.assert_array_equal(fmt.dequantize(bufs, o, i), w)
    # Padding groups (beyond I/g) are written as zero.
    zw = zeros_width(in_f, group)
    assert bufs["zeros"].shape == (out_f, zw) and bufs["scales"].shape == (out_f, 8 * zw)
    assert not np.any(bufs["scales"][:, n_groups:].astype(np.float32))
    padded_zeros = (bufs["zeros"][..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    assert not padded_zeros.reshape(out_f, -1)[:, n_groups:].any()
    # A GEMV checkpoint of the same weight is byte-identical to the repacked GEMM one.
    _, _, _, direct = read_gemv(*gemv_tensors(q, z, s, group), group, "m")
    for name in bufs:
        np.testing.assert_array_equal(direct[name], bufs[name])


def test_zeros_width_matches_autoawq() -> None:
    # ceil(ceil(I/g)/8) rounded up to 4 words for g32, 2 for g64, 1 for g128.
    assert zeros_width(256, 64) == 2 and zeros_width(512, 64) == 2
    assert zeros_width(4096, 128) == 4 and zeros_width(4096, 64) == 8
    assert zeros_width(256, 32) == 4 and zeros_width(8192, 32) == 32
    assert zeros_width(11008, 128) == 11


# ---- AutoAWQ's quantizer ---------------------------------------------------------------------


def _pseudo_quantize(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """docs/formats.md's AutoAWQ decode step by step, one group at a time, with the fp16-stored scale."""
    out_f, in_f = w.shape
    q = np.zeros(w.shape, np.int64)
    z = np.zeros((out_f, in_f // g), np.int64)
    s = np.zeros((out_f, in_f // g), np.float16)
    for r in range(out_f):
        for j in range(in_f // g):
            vals = w[r, j * g : (j + 1) * g]
            sc = np.float16(max(np.float32(vals.max() - vals.min()), np.float32(1e-5)) / 15)
            s[r, j] = sc
            z[r, j] = min(max(-np.rint(vals.min() / np.float32(sc)), 0), 15)
            q[r, j * g : (j + 1) * g] = np.clip(np.rint(vals / np.float32(sc)) + z[r, j], 0, 15)
    return q, z, s


@pytest.mark.parametrize("group", GROUP_SIZES)
def test_quantize_matches_scalar_reference(group: int) -> None:
    w = np.random.default_rng(group).standard_normal((8, 256), dtype=np.float32) * 0.1
    w[0, :group] = 0.25  # constant group: the 1e-5 clamp
    q, z, s = _pseudo_quantize(w, group)
    fmt = Awq(4, group)
    got = fmt.quantize(w)
    _, _, _, want = read_gemv(*gemv_tensors(q, z, s, group), group, "m")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@settings(max_examples=30, deadline=None)
@given(
    group=st.sampled_from(GROUP_SIZES),
    out_f=st.integers(1, 6),
    n_groups=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    spread=st.sampled_from([1e-2, 1.0, 30.0]),
)
def test_quantize_error_bound(group: int, out_f: int, n_groups: int, seed: int, spread: float):
    """|dequant - w| <= s/2 inside [-z*s, (15-z)*s]; the fp16 scale and the clamped zero can push
    the group's edges out by at most one step."""
    fmt = Awq(4, group)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_f, group * n_groups)) * spread + rng.normal()).astype(np.float32)
    bufs = fmt.quantize(w)
    fmt.check_buffers(bufs, *w.shape, where="q")
    got = fmt.dequantize(bufs, *w.shape).reshape(out_f, n_groups, group)
    s = bufs["scales"][:, :n_groups].astype(np.float32)[..., None]
    wg = w.reshape(out_f, n_groups, group)
    rng_w = wg.max(-1, keepdims=True) - wg.min(-1, keepdims=True)
    # Zero is clamped to [0, 15]: a group entirely above or below 0 is off by its distance to 0.
    off = np.maximum(np.maximum(wg.min(-1, keepdims=True), -wg.max(-1, keepdims=True)), 0)
    assert np.all(np.abs(got - wg) <= np.maximum(s / 2 + 1e-3 * rng_w, off + s) + 1e-6)


# ---- format facts and refusals ---------------------------------------------------------------


def test_spell_tag_sizes_and_buffers() -> None:
    fmt = Awq(4, 64)
    assert fmt.spell() == "awq<bits=4,group_size=64>"
    check_spell(fmt)
    assert fmt.tag() == "awq4g64" and fmt.fragment == "awq"
    assert fmt.bytes_per_weight() == 0.5 + 2.5 / 64
    assert {k: (t.shape, t.dtype) for k, t in fmt.buffers(512, 256).items()} == {
        "weight": ((512, 32), U32),
        "zeros": ((512, 2), U32),
        "scales": ((512, 16), F16),
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"bits": 8, "group_size": 64}, "bits=8"), ({"bits": 4, "group_size": 48}, "group_size=48")],
)
def test_invalid_parameters(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(FormatError, match=message):
        Awq(**kwargs)


def _write(tmp: Path, tensors: dict[str, np.ndarray], **qcfg: Any) -> Path:
    src = json.loads((DATA / "awq_gemm_g64_S" / "config.json").read_text())
    src["quantization_config"].update(qcfg)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(src))
    save_file(tensors, str(tmp / "model.safetensors"))
    return tmp


Q = f"{LAYER}.self_attn.q_proj"


def _q_tensors() -> dict[str, np.ndarray]:
    tensors = load_file(str(DATA / "awq_gemm_g64_S" / "model.safetensors"))
    return {k: v for k, v in tensors.items() if k.startswith(Q)}


@pytest.mark.parametrize(
    ("edit", "qcfg", "message"),
    [
        (lambda t: t.pop(f"{Q}.qzeros"), {}, rf"{Q}\.qzeros: missing"),
        (
            lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"].astype(np.float32)}),
            {},
            rf"{Q}\.scales: dtype float32, expected float16",
        ),
        (
            lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].view(np.float32)}),
            {},
            rf"{Q}\.qweight: dtype float32, expected int32",
        ),
        (
            lambda t: t.update({f"{Q}.qzeros": t[f"{Q}.qzeros"][:, :16]}),
            {},
            rf"{Q}\.qzeros: shape \[4, 16\], expected \[4, 32\]",
        ),
        (lambda t: None, {"group_size": 128}, rf"{Q}\.qzeros: shape \[4, 32\], expected \[2, 32\]"),
        (
            lambda t: t[f"{Q}.scales"].__setitem__((1, 3), np.nan),
            {},
            rf"{Q}\.scales: contains NaN or Inf",
        ),
        (
            lambda t: None,
            {"version": "gemv"},
            rf"{Q}\.qzeros: shape \[4, 32\], expected \[256, 2\]",
        ),
        (lambda t: None, {"version": "gemv_fast"}, "not supported: AWQ version gemv_fast"),
        (lambda t: None, {"zero_point": False}, "not supported: AWQ zero_point false"),
        (lambda t: None, {"group_size": 48}, rf"{Q}: awq: group_size=48 not supported"),
        (
            lambda t: None,
            {"modules_to_not_convert": ["q_proj"]},
            rf"{Q}\.weight: missing from .*\(expected an unquantized linear\)",
        ),
        (
            lambda t: t.update({f"{Q}.weight": t[f"{Q}.qweight"]}),
            {"modules_to_not_convert": ["q_proj"]},
            rf"{Q}\.weight: int32 \[256, 32\], expected an unquantized f16/bf16/f32",
        ),
    ],
)
def test_refusals_name_the_tensor(tmp_path: Path, edit: Any, qcfg: dict[str, Any], message: str):
    tensors = {k: v.copy() for k, v in _q_tensors().items()}
    edit(tensors)
    ck = load(_write(tmp_path / "ck", tensors, **qcfg))
    with pytest.raises(FormatError, match=message) as info:
        ck.linear(Q)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("skipped", [["q_proj"], ["self_attn"], None])
def test_unquantized_modules_read_dense(tmp_path: Path, skipped: list[str] | None) -> None:
    """modules_to_not_convert (a substring test, as AutoAWQ does), or no list at all: a module
    stored as a 16-bit `.weight` without `.qweight` (AutoAWQ never quantizes lm_head)."""
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float16)
    ck = load(_write(tmp_path / "ck", {f"{Q}.weight": w}, modules_to_not_convert=skipped))
    lin = ck.linear(Q)
    assert lin.weight.format.spell() == "dense<dtype=f16>"
    np.testing.assert_array_equal(lin.buffers["weight"], w)


def test_transformers5_format_key_selects_gemv(tmp_path: Path) -> None:
    tensors = load_file(str(DATA / "awq_gemv_g64_S" / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if k.startswith(Q)}
    ck = load(_write(tmp_path / "ck", tensors, version=None, format="gemv"))
    want = golden("awq_gemv_g64_S")["W.0.q"]
    lin = ck.linear(Q)
    np.testing.assert_array_equal(lin.weight.format.dequantize(lin.buffers, 256, 256), want)


# ---- end to end and kernels ------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_fixture_block_reference_matches_golden(case: str, block: str) -> None:
    check_fixture_block(case, block, ("reference",))


@needs_host
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_fixture_block_host_matches_reference_and_golden(case: str, block: str) -> None:
    check_fixture_block(case, block, ("reference", "host"))


@needs_host
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    group=st.sampled_from(GROUP_SIZES),
    n=st.integers(1, 37),
    k_groups=st.integers(1, 3),
    m=st.integers(1, 9),
    act=st.sampled_from([F16, F32]),
    seed=st.integers(0, 2**16),
)
def test_host_qlinear_equals_reference(group, n, k_groups, m, act, seed) -> None:
    rng = np.random.default_rng(seed)
    fmt = Awq(4, group)
    k = group * k_groups
    bufs = fmt.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.05)
    check_qlinear_host(QWeight(fmt, n, k), bufs, m, rng, act)
