"""Block-wise FP8 (a float32 scale per 128 x 128 block): the decode against the documented layout
on ragged shapes and against the tools' decodes of both fixtures (transformers' FineGrainedFP8
for HF `quant_method: fp8`, compressed-tensors for FP8_BLOCK), the quantizer, row views, the
kernels against the interpreter across block edges, `qir inspect`, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import qir
from qir.builder import Builder
from qir.cli import main
from qir.dtypes import BF16, F16
from qir.formats import parse_format
from qir.formats.base import FormatError
from qir.formats.dense import Dense
from qir.formats.fp8_block import Fp8Block
from qir.models import load
from qir.types import QWeight
from tests.conftest import BACKENDS, DATA, max_rel

E4M3 = ml_dtypes.float8_e4m3fn
PROJ = ["q", "k", "v", "o", "gate", "up", "down"]
FIXTURES = ["fp8block_qwen3", "ct_fp8block_qwen3"]


def _codes(rng: np.random.Generator, out_f: int, in_f: int) -> np.ndarray:
    # Every finite E4M3 code but the NaNs (0x7F, 0xFF).
    codes = rng.integers(0, 0xFE, (out_f, in_f)).astype(np.uint8)
    return np.where(codes == 0x7F, 0x7E, codes).astype(np.uint8).view(E4M3)


def test_decode_follows_the_documented_layout_on_ragged_blocks() -> None:
    """w[o, i] = e4m3[o, i] * scale[o // 128, i // 128], written out element by element, for a
    weight whose last row and column blocks are ragged (300 = 2 x 128 + 44, 424 = 3 x 128 + 40)."""
    rng = np.random.default_rng(0)
    out_f, in_f = 300, 424
    codes = _codes(rng, out_f, in_f)
    scale = rng.uniform(1e-4, 1e-1, (3, 4)).astype(np.float32)
    fmt = Fp8Block()
    got = fmt.dequantize({"weight": codes, "scale": scale}, out_f, in_f)
    values = codes.astype(np.float32)
    want = np.empty((out_f, in_f), np.float32)
    for o in range(out_f):
        for i in range(in_f):
            want[o, i] = values[o, i] * scale[o // 128, i // 128]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(FormatError, match=r"w\.scale: shape \[2, 4\], expected \[3, 4\]"):
        fmt.check_buffers({"weight": codes, "scale": scale[:2]}, out_f, in_f, where="w")


@pytest.mark.parametrize("case", FIXTURES)
def test_fixture_decode_matches_the_tools_bit_exactly(case: str) -> None:
    ck = load(DATA / case)
    golden = np.load(DATA / case / "golden.npz")
    for p in PROJ:
        lin = ck.linear(ck.layer_module(0, p))
        fmt, (o, i) = lin.weight.format, lin.buffers["weight"].shape
        assert fmt == Fp8Block()
        assert lin.buffers["scale"].shape == (-(-o // 128), -(-i // 128))
        assert all(not a.flags.writeable for a in lin.buffers.values())
        np.testing.assert_array_equal(fmt.dequantize(lin.buffers, o, i), golden[f"W.0.{p}"], p)
    assert ck.linear("lm_head").weight.format == Dense(BF16)


def test_quantize_scales_each_block_to_its_amax() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((200, 136)).astype(np.float32) * np.float32(0.05)
    w[128:, 128:] *= 100  # the ragged corner block, far larger than its neighbours
    w[:128, 128:] = 0  # an all-zero block: scale 1, codes 0
    fmt = Fp8Block()
    bufs = fmt.quantize(w)
    scale = bufs["scale"]
    assert scale.shape == (2, 2) and scale[0, 1] == 1
    for r, c in ((0, 0), (1, 0), (1, 1)):
        block = w[128 * r : 128 * (r + 1), 128 * c : 128 * (c + 1)]
        assert scale[r, c] == np.float32(np.abs(block).max() / np.float32(448))
    got = fmt.dequantize(bufs, 200, 136)
    # Half an E4M3 step (3 mantissa bits, subnormal step 2^-9) of each element's block scale.
    s = fmt.expand_scale(scale, 200, 136)
    v = np.abs(w) / s
    half_step = np.exp2(np.floor(np.log2(np.maximum(v, 2.0**-6))) - 4) * s
    assert np.all(np.abs(got - w) <= half_step * (1 + 1e-6))


def test_rows_are_views_only_where_they_keep_the_blocks() -> None:
    fmt = Fp8Block()
    bufs = fmt.quantize(np.random.default_rng(2).standard_normal((384, 64)).astype(np.float32))
    whole = fmt.dequantize(bufs, 384, 64)
    for start, stop in ((0, 256), (256, 384), (128, 300), (130, 200)):
        part = fmt.rows(bufs, 384, 64, start, stop)
        assert all(np.shares_memory(part[b], bufs[b]) for b in bufs)
        np.testing.assert_array_equal(fmt.dequantize(part, stop - start, 64), whole[start:stop])
    with pytest.raises(FormatError, match=r"rows 100\.\.200 start inside scale block 0"):
        fmt.rows(bufs, 384, 64, 100, 200)


def test_k_parts_keep_the_blocks_or_are_refused() -> None:
    # K of 416 = 3 whole blocks and a ragged one of 32 (ct_fp8block_qwen3's down_proj).
    fmt = Fp8Block()
    bufs = fmt.quantize(np.random.default_rng(3).standard_normal((64, 416)).astype(np.float32))
    whole = fmt.dequantize(bufs, 64, 416)
    for start, stop in ((0, 256), (256, 416), (128, 384)):
        part = fmt.columns(bufs, 64, 416, start, stop, where="w")
        np.testing.assert_array_equal(fmt.dequantize(part, 64, stop - start), whole[:, start:stop])
    # 208..416 would scale its first inputs (block 1 of the whole) by block 2's scale
    for start, stop in ((0, 208), (208, 416)):
        with pytest.raises(
            FormatError,
            match=rf"^w.scale: a K split {start}..{stop} of in_features 416 is not on its "
            r"blocks of 128 inputs, so it cannot be exact$",
        ):
            fmt.columns(bufs, 64, 416, start, stop, where="w")


def test_spelling_and_facts() -> None:
    fmt = Fp8Block()
    assert fmt.spell() == "fp8_block<block_out=128,block_in=128>"
    assert parse_format(fmt.spell()) == fmt
    assert fmt.tag() == "fp8b128x128"
    assert fmt.describe() == {"bits": 8, "group": 128, "w4a4": False}
    with pytest.raises(FormatError, match=r"^not supported: FP8 weight_block_size 64 "):
        Fp8Block(64, 128)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", [F16, BF16], ids=lambda a: a.name)
def test_kernels_match_the_interpreter_across_block_edges(backend: str, act) -> None:
    """A projection of 300 x 424 (ragged row and column blocks), each block's weights on a
    different scale (1e-3 .. 1e1), so a scale read from the wrong block shows: the GEMV
    (M = 1, 9) and the GEMM (M = 9, 70, its tiles crossing block rows)."""
    rng = np.random.default_rng(3)
    n, k = 300, 424
    w = rng.standard_normal((n, k)).astype(np.float32)
    w *= np.repeat(np.repeat(10.0 ** rng.uniform(-3, 1, (3, 4)), 128, 0), 128, 1)[:n, :k]
    fmt = Fp8Block()
    bufs = fmt.quantize(w)
    b = Builder()
    x = b.input("x", ("M", k), act)
    b.output("y", b.qlinear(x, b.weight("w", QWeight(fmt, n, k))))
    ref = qir.compile(b.graph, {"w": bufs}, backend="reference")
    tol = {F16: 2e-3, BF16: 1.6e-2}[act]
    for gemm_from_m, batches in ((None, (1, 9)), (1, (9, 70))):
        ours = qir.compile(b.graph, {"w": bufs}, backend=backend, gemm_from_m=gemm_from_m)
        family = "qgemm_" if gemm_from_m else "qgemv_"
        assert ours.plan.launches[0].kernel.name.startswith(family + "fp8b128x128")
        for m in batches:
            xa = rng.standard_normal((m, k)).astype(act.np)
            assert max_rel(ours({"x": xa})["y"], ref({"x": xa})["y"]) <= tol, (family, m)


def test_inspect_shows_the_block_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-q", "inspect", str(DATA / "fp8block_qwen3")]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split() for ln in out.split("\n\n")[0].splitlines()[1:-1]}
    down = rows["model.layers.1.mlp.down_proj"]
    assert down[1:4] == ["fp8_block<block_out=128,block_in=128>", "8", "128"]
    # e4m3 codes plus a float32 scale per block (2 x 4 of them)
    assert down[4:7] == ["[256,", "512]", str(256 * 512 + 4 * 2 * 4)]
    assert rows["lm_head"][1] == "dense<dtype=bf16>"
    assert "architecture: qwen3" in out


# ---- small synthetic checkpoints: refusals ---------------------------------------------------

Q = "model.layers.0.self_attn.q_proj"
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 160,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "torch_dtype": "bfloat16",
}
HF = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def _write(path: Path, tensors: dict[str, np.ndarray], **quant: Any) -> Path:
    path.mkdir()
    config = {**CONFIG, "quantization_config": {**HF, **quant}}
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _tensors(scale: np.ndarray) -> dict[str, np.ndarray]:
    codes = _codes(np.random.default_rng(4), 160, 160)
    return {f"{Q}.weight": codes, f"{Q}.weight_scale_inv": scale}


def test_hf_checkpoint_reads_and_leaves_unconverted_modules_dense(tmp_path: Path) -> None:
    scale = np.array([[0.5, 2.0], [0.25, 4.0]], np.float32)
    k = "model.layers.0.self_attn.k_proj.weight"
    tensors = {**_tensors(scale), k: np.ones((160, 160), ml_dtypes.bfloat16)}
    ck = load(_write(tmp_path / "ck", tensors, modules_to_not_convert=["k_proj"]))
    assert ck.convention.name == "fp8_block"
    lin = ck.linear(Q)
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:160, :160]
    want = tensors[f"{Q}.weight"].astype(np.float32) * full
    np.testing.assert_array_equal(lin.weight.format.dequantize(lin.buffers, 160, 160), want)
    assert ck.linear("model.layers.0.self_attn.k_proj").weight.format == Dense(BF16)


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"fmt": "e5m2"}, r"^not supported: FP8 fmt 'e5m2' \(quantization_config\.fmt"),
        (
            {"weight_block_size": [64, 64]},
            r"^not supported: FP8 block size \[64, 64\] \(quantization_config\.weight_block_size",
        ),
        ({"weight_block_size": None}, r"^not supported: FP8 without weight_block_size"),
        ({"weight_block_size": 128}, r"^quantization_config\.weight_block_size: expected \[rows"),
    ],
)
def test_hf_configs_qir_does_not_run_are_refused_in_one_line(
    tmp_path: Path, quant: dict, message: str
) -> None:
    with pytest.raises(FormatError, match=message) as e:
        load(_write(tmp_path / "ck", _tensors(np.ones((2, 2), np.float32)), **quant))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        (
            np.ones((2, 1), np.float32),
            r"weight_scale_inv: float32 \[2, 1\], expected a float \[2, 2\]",
        ),
        (np.ones((2, 2), np.int32), r"weight_scale_inv: int32 \[2, 2\], expected a float \[2, 2\]"),
        (
            np.array([[1.0, 1.0], [1.0, np.inf]], np.float32),
            r"weight_scale_inv: contains NaN or Inf",
        ),
    ],
)
def test_bad_scales_are_refused_by_name(tmp_path: Path, scale: np.ndarray, message: str) -> None:
    ck = load(_write(tmp_path / "ck", _tensors(scale)))
    with pytest.raises(FormatError, match=rf"^{Q}\.{message}"):
        ck.linear(Q)
