"""Rendering: names spell the specialisation, templates are strict, every dumped .cu compiles."""

from __future__ import annotations

import subprocess

import jinja2
import pytest

from qir.codegen.fragments import fragment_for
from qir.codegen.gemm import GemmSpec, gemm_kernel
from qir.codegen.gemv import WARPS_PER_BLOCK, GemvSpec, gemv_kernel, lanes_per_row
from qir.codegen.lower import lower
from qir.codegen.render import render
from qir.dtypes import BF16, F16
from qir.dump import dump
from qir.formats.awq import Awq
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from qir.models import load
from qir.models.blocks import build
from qir.passes.manager import run_pipeline
from qir.types import QWeight
from tests.conftest import DATA
from tests.requires import requires


def test_kernel_name_spells_the_specialisation():
    w = QWeight(MlxAffine(4, 128, BF16), 512, 256)
    k = gemv_kernel(GemvSpec((w,), F16, 8))
    assert k.name == "qgemv_mlx4g128bf16_f16_n512_k256_m8_l2"
    assert f"void __launch_bounds__(128, 3) {k.name}(" in k.source
    assert [p.name for p in k.params] == ["x", "w0_weight", "w0_scales", "w0_biases", "y0", "M"]
    assert k.headers[0][0] == "qir_common.cuh"
    dual = gemv_kernel(GemvSpec((w, w), F16, 8))
    assert dual.name == "qgemv_mlx4g128bf16_f16_n512_512_k256_m8_l2"
    assert [p.name for p in dual.params][-3:] == ["y0", "y1", "M"]
    pair_spec = GemvSpec((w, w), F16, 8, epilogue="silu_mul")
    pair = gemv_kernel(pair_spec)
    assert pair.name == "qgemv_mlx4g128bf16_f16_n512_512_k256_m8_l2_silumul"
    assert [p.name for p in pair.params][-2:] == ["y0", "M"]  # one result, silu(g) * u
    # A warp computes four rows of one weight, or two rows of gate and up each.
    assert pair_spec.grid_x == 2 * GemvSpec((w,), F16, 8).grid_x
    with pytest.raises(ValueError, match="two weights of one shape"):
        GemvSpec((w,), F16, 8, epilogue="silu_mul")
    with pytest.raises(ValueError, match="two weights of one shape"):
        GemvSpec((w, QWeight(MlxAffine(4, 128, BF16), 256, 256)), F16, 8, epilogue="silu_mul")
    down = QWeight(MlxAffine(4, 128, BF16), 256, 512)
    fused = gemv_kernel(GemvSpec((down,), F16, 8, prologue=True, epilogue="residual"))
    assert fused.name == "qgemv_mlx4g128bf16_f16_n256_k512_m8_l4_silu_res"
    assert [p.name for p in fused.params] == [
        "g",
        "u",
        "w0_weight",
        "w0_scales",
        "w0_biases",
        "y0",
        "r",
        "M",
    ]


def test_short_rows_take_groups_of_lanes():
    """A row of few chunks takes the fewest lanes (a power of two) that cover its chunk pairs in
    at most LANE_PASSES passes; the warp's groups each take their own rows, the grid shrinks by
    as much, and the name says so (a whole warp's row: no suffix)."""
    chunks = (1, 6, 8, 24, 64, 90, 128, 448)
    assert [lanes_per_row(c) for c in chunks] == [1, 1, 2, 4, 16, 16, 32, 32]
    for k, lanes in ((768, 4), (2048, 16), (4096, 32)):  # Qwen3-30B-A3B's expert K, Llama-3's
        w = QWeight(Awq(4, 128), 100, k)
        spec = GemvSpec((w,), F16, 8)
        assert spec.lanes == lanes and spec.warp_rows == 4 * 32 // lanes
        assert spec.grid_x == -(-100 // (4 * spec.warp_rows))
        assert ("_l" in spec.name) == (lanes < 32)
        assert f"constexpr int QIR_LANES = {lanes};" in gemv_kernel(spec).source


def test_mixed_formats_are_parts_of_one_launch():
    a = QWeight(MlxAffine(4, 128, BF16), 512, 256)
    b = QWeight(MlxAffine(8, 128, BF16), 512, 256)
    spec = GemvSpec((a, b, a), F16, 8)
    assert [index for index, _ in spec.parts] == [(0, 2), (1,)]
    assert spec.grid_x == sum(p.grid_x for _, p in spec.parts)
    assert spec.name == "qgemv_mlx4g128bf16_mlx8g128bf16_f16_n512_512_512_k256_m8"
    source = gemv_kernel(spec).source
    assert source.count("namespace qir_part1 {") == 1 and "qir_part1::qir_part(" in source
    # Gate and up of two formats: both parts over each block's rows, the up's reading g back
    pair = GemvSpec((a, b), F16, 8, epilogue="silu_mul")
    assert pair.name == "qgemv_mlx4g128bf16_mlx8g128bf16_f16_n512_512_k256_m8_silumul"
    assert [p.epilogue for _, p in pair.parts] == ["", "gated"]
    rows = [WARPS_PER_BLOCK * p.warp_rows for _, p in pair.parts]
    assert pair.grid_x == -(-512 // max(rows))
    source = gemv_kernel(pair).source
    assert "qir_part1::qir_part(" in source and "EPILOGUE == QIR_GATED" in source
    w4a4 = (QWeight(Nvfp4("mul", 4), 512, 256), QWeight(Nvfp4("div", 4), 512, 256))
    with pytest.raises(ValueError, match="16-bit activations"):
        GemvSpec(w4a4, F16, 8, a4=True)
    # The GEMM: one launch, each format's fragment in a namespace, chosen by the block's weight
    gemm = GemmSpec.of(spec, 64)
    assert gemm.name.startswith("qgemm_mlx4g128bf16_mlx8g128bf16_f16_n512_512_512_k256_")
    assert gemm.grid_x == 3 * gemm.tiles(a)
    source = gemm_kernel(gemm).source
    assert source.count("namespace qir_part1 {") == 1
    assert "if (seg == 0 || seg == 2) {" in source and "qir_part1::qir_gemm_weight_chunk(" in source


def test_templates_reject_missing_variables():
    with pytest.raises(jinja2.UndefinedError):
        render("qgemv.cu.j2", name="k")


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_fragment_chunks_tile_rows_exactly(bits, group):
    for k in (group, 2 * group, 3 * group):
        frag = fragment_for(MlxAffine(bits, group, F16), 8, k)
        c = frag.context
        assert frag.chunk_elems * bits == c["chunk_words"] * 32
        assert k % frag.chunk_elems == 0
        assert c["words_per_row"] % c["chunk_words"] == 0
        assert frag.chunk_elems <= 64 and frag.chunk_elems % 8 == 0
        # Runs of steps tile the chunk, and a run never spans two groups.
        run = c["run_steps"] * c["step"]
        assert c["runs"] * run == frag.chunk_elems
        assert group % run == 0 and run % (2 * c["stride"]) == 0


@requires("nvcc")
def test_every_dumped_cu_compiles_on_its_own_with_nvcc(tmp_path):
    ck = load(DATA / "mlx_mixed_3_6_S")
    b = build(ck, "mlp", 0)
    after, _ = run_pipeline(b.graph)
    files = dump(b.graph, after, lower(after), tmp_path)
    cus = [f for f in files if f.suffix == ".cu"]
    # gate/up in one launch; down with the silu prologue and residual: each as a GEMV and as
    # the GEMM's two tile buckets
    assert len(cus) == 6
    for cu in cus:
        r = subprocess.run(
            ["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", cu.name, "-o", cu.stem + ".cubin"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        assert (tmp_path / (cu.stem + ".cubin")).read_bytes()[:4] == b"\x7fELF"
