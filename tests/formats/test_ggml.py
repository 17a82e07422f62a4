"""ggml's (GGUF's) tensor types as qir weights: every type reads its blocks (as a GGUF stores a
tensor's rows) into the format the registry names, and decodes them as llama.cpp's C library
and gguf-py do, bit for bit: on blocks the C quantizer wrote (tests/data/ggml_blocks) and on
random blocks whose fp16 scales sit at the edges (subnormal, largest finite, signed zero)."""

from __future__ import annotations

import numpy as np
import pytest

from qir.formats import parse_format
from qir.formats.base import FormatError
from qir.formats.ggml import Ggml
from qir.formats.ggml_blocks import SPECS, Fields, encode, parse, unparse
from qir.formats.ggml_types import TYPES, reader
from qir.formats.mx import Mxfp4
from tests.conftest import DATA
from tests.requires import import_or_skip

gguf = import_or_skip("gguf", "gguf")
GGMLQuantizationType = gguf.GGMLQuantizationType

BLOCKS = np.load(DATA / "ggml_blocks" / "blocks.npz")
IDS = {t.name: i for i, t in TYPES.items()}
READ = sorted(k.removesuffix(".raw") for k in BLOCKS.files if k.endswith(".raw"))
# fp16 bit patterns of edge scales: the smallest and largest subnormal, the smallest normal, 1,
# the largest finite, their negatives, and both zeros.
EDGE_F16 = np.array(
    [0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x8001, 0x83FF, 0xBC00, 0xFBFF, 0x0000, 0x8000],
    dtype=np.uint16,
).view(np.float16)


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def read(name: str, raw: np.ndarray, in_features: int, where: str = "t"):
    r = reader(IDS[name], where)
    fmt = r.format()
    return fmt, r.repack(raw, raw.shape[-2], in_features, where)


def test_the_fixture_has_every_type_and_its_edges() -> None:
    assert set(READ) == {*SPECS, "MXFP4"}
    # row 3's fp16 block scales are subnormal (below 2^-14) in every type with fp16 scales
    d = parse(SPECS["Q4_0"], BLOCKS["Q4_0.raw"]).d
    assert np.all(np.abs(d[3].astype(np.float32)) < 2.0**-14) and np.all(d[3] != 0)


@pytest.mark.parametrize("name", READ)
def test_c_blocks_decode_as_llama_cpp_does(name: str) -> None:
    raw, want = BLOCKS[f"{name}.raw"], BLOCKS[f"{name}.decoded"]
    fmt, bufs = read(name, raw, 512)
    ours = fmt.dequantize(bufs, raw.shape[0], 512)
    np.testing.assert_array_equal(bits(ours), bits(want))
    np.testing.assert_array_equal(
        bits(gguf.quants.dequantize(raw, GGMLQuantizationType[name])), bits(want)
    )
    assert fmt.spell() == ("mxfp4<>" if name == "MXFP4" else f"ggml<type={name}>")


def _edge_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Raw blocks of random codes and sub-scales (random bytes parsed), every fp16 scale an
    edge value, row 1 all top codes, row 2 all zero codes."""
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // spec.block * spec.block_bytes), dtype=np.uint8)
    f = parse(spec, raw)
    q = f.q.copy()
    q[1] = 255 >> (8 - spec.bits) if spec.bits < 8 else 255
    q[2] = 0

    def edges(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else rng.choice(EDGE_F16, a.shape)

    edged = edges(f.d)
    assert edged is not None
    return unparse(spec, Fields(q, edged, edges(f.dmin), f.sc, f.mn))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_random_blocks_with_edge_scales_decode_as_gguf_py(name: str) -> None:
    raw = _edge_blocks(name, 4, 512, seed=len(name))
    fmt, bufs = read(name, raw, 512)
    want = gguf.quants.dequantize(raw, GGMLQuantizationType[name])
    np.testing.assert_array_equal(bits(fmt.dequantize(bufs, 4, 512)), bits(want))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_blocks_parse_and_write_back(name: str) -> None:
    spec = SPECS[name]
    raw = _edge_blocks(name, 3, 256, seed=7)
    np.testing.assert_array_equal(unparse(spec, parse(spec, raw)), raw)
    # the planes hold the same fields
    fmt = Ggml(name)
    f = fmt.fields(fmt.planes(parse(spec, raw)), 256)
    np.testing.assert_array_equal(unparse(spec, f), raw)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0"])
def test_legacy_quantizer_writes_ggmls_bytes(name: str) -> None:
    """Where ggml's reference quantizer is ported to numpy (gguf-py), ours writes its bytes."""
    x = BLOCKS["x"]
    ours = unparse(SPECS[name], encode(SPECS[name], x))
    np.testing.assert_array_equal(ours, gguf.quants.quantize(x, GGMLQuantizationType[name]))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_quantize_is_close_to_the_c_quantizer(name: str) -> None:
    """Our round-to-nearest is no llama.cpp error search, but within 3x its error on N(0, 1)
    (the K-quants' sub-scales and mins cost most)."""
    x = BLOCKS["x"][:1]
    fmt = Ggml(name)
    ours = fmt.dequantize(fmt.quantize(x), 1, x.shape[1])
    c = BLOCKS[f"{name}.decoded"][:1]
    nmse = float(np.sum((ours - x) ** 2) / np.sum(x**2))
    assert nmse <= 3 * float(np.sum((c - x) ** 2) / np.sum(x**2)) + 1e-6, nmse


def test_ggml_mxfp4_halves_become_ocp_pairs_and_subnormal_scales_stay_exact() -> None:
    """ggml's nibbles: byte j holds elements j and j + 16; qir's MXFP4: elements 2k, 2k + 1.
    Exponents 0 and 1 decode to 2^-127 and 2^-126 times E2M1 (ggml's subnormal special case),
    254 overflows to Inf in both. Equal values, not bits: code 8 is E2M1's -0, which ggml's
    table reads as +0."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (3, 4 * 17), dtype=np.uint8)
    raw[:, 0::17] = np.array([[0, 1, 2, 254], [127, 128, 0, 1], [200, 3, 254, 1]], np.uint8)
    fmt, bufs = read("MXFP4", raw, 128)
    assert isinstance(fmt, Mxfp4)
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(raw, GGMLQuantizationType.MXFP4)
        ours = fmt.dequantize(bufs, 3, 128)
    np.testing.assert_array_equal(ours, want)
    assert np.isinf(want).any() and (want[:, :32] != 0).any()
    raw[2, 17] = 255
    with pytest.raises(FormatError, match=r"^blk\.0\.ffn_down_exps\.weight: E8M0 NaN"):
        read("MXFP4", raw, 128, "blk.0.ffn_down_exps.weight")


@pytest.mark.parametrize("name", ["Q4_K", "MXFP4"])
def test_expert_tensors_keep_the_experts_first(name: str) -> None:
    raw = np.stack([BLOCKS[f"{name}.raw"][:2], BLOCKS[f"{name}.raw"][3:5]])  # [E=2, 2, row]
    fmt, bufs = read(name, raw, 512)
    for e in range(2):
        one = {n: a[e] for n, a in bufs.items()}
        want = BLOCKS[f"{name}.decoded"][[0, 1] if e == 0 else [3, 4]]
        np.testing.assert_array_equal(bits(fmt.dequantize(one, 2, 512)), bits(want))


@pytest.mark.parametrize(
    ("type_id", "message"),
    [
        (16, r"^blk\.3\.attn_q\.weight: ggml type IQ2_XXS is not supported; qir reads .*Q4_K"),
        (19, r"^blk\.3\.attn_q\.weight: ggml type IQ1_S is not supported"),
        (29, r"^blk\.3\.attn_q\.weight: ggml type IQ1_M is not supported"),
        (21, r"^blk\.3\.attn_q\.weight: ggml type IQ3_S is not supported"),
        (99, r"^blk\.3\.attn_q\.weight: unknown ggml type id 99$"),
    ],
)
def test_codebook_and_unknown_types_are_refused_naming_the_tensor(type_id, message) -> None:
    with pytest.raises(FormatError, match=message):
        reader(type_id, "blk.3.attn_q.weight")


def test_bad_tensors_are_refused_in_one_line() -> None:
    raw = BLOCKS["Q6_K.raw"]
    where = "blk.0.ffn_down.weight"
    with pytest.raises(
        FormatError, match=r"^blk\.0\.ffn_down\.weight: shape \[5, 420\], expected \[4, 420\]"
    ):
        reader(14, where).repack(raw, 4, 512, where)
    with pytest.raises(
        FormatError, match=r"^blk\.0\.ffn_down\.weight: .*not a multiple of the Q6_K block 256"
    ):
        reader(14, where).repack(raw[:, :210], 5, 128, where)
    bad = raw.copy()
    bad[2, 210 + 208 : 210 + 210] = np.array([0x00, 0x7C], np.uint8)  # block 1's d = +Inf
    with pytest.raises(
        FormatError,
        match=r"^blk\.0\.ffn_down\.weight: Q6_K block 1 of row 2 has a NaN or Inf scale$",
    ):
        reader(14, where).repack(bad, 5, 512, where)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_format_spells_and_counts_its_bytes(name: str) -> None:
    fmt = Ggml(name)
    assert parse_format(fmt.spell()) == fmt
    for k in (fmt.spec.block, 512):
        bufs = fmt.buffers(4, k)
        # the planes' bytes, the rows of `fields` padded to 16 (aligned loads of every row)
        assert bufs["weight"].shape[1] * 4 % 16 == 0 and bufs["fields"].shape[1] % 16 == 0
        row = bufs["weight"].shape[1] * 4 + bufs["fields"].shape[1]
        assert 0 <= row - fmt.bytes_per_weight() * k < 16
    with pytest.raises(FormatError, match="has no qir layout"):
        Ggml("IQ2_XXS")


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "Q6_K", "Q3_K", "IQ4_XS"])
def test_rows_and_k_splits_are_slices_of_the_planes(name: str) -> None:
    fmt, bufs = read(name, BLOCKS[f"{name}.raw"], 512)
    want = BLOCKS[f"{name}.decoded"]
    rows = fmt.rows(bufs, 5, 512, 1, 4)
    np.testing.assert_array_equal(bits(fmt.dequantize(rows, 3, 512)), bits(want[1:4]))
    cols = fmt.columns(bufs, 5, 512, 256, 512, "w")
    np.testing.assert_array_equal(bits(fmt.dequantize(cols, 5, 256)), bits(want[:, 256:]))
    with pytest.raises(FormatError, match="cannot be exact"):
        fmt.columns(bufs, 5, 512, 0, 128 if fmt.spec.block == 256 else 16, "w")
