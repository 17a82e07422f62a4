"""The GEMM family's codegen and its selection by M, without compiling: which launches a plan
holds for which batch sizes, the tile table's invariants for every format, and what the kernel
source says of itself."""

from __future__ import annotations

import re

import pytest

from qir.builder import Builder
from qir.codegen.fragments import fragment_for
from qir.codegen.gemm import (
    GEMM_TILES,
    M_BUCKETS,
    SMEM_BYTES,
    GemmSpec,
    bucket_ranges,
    choose_tile,
    gemm_kernel,
    smem_bytes,
)
from qir.codegen.lower import lower
from qir.codegen.plan import ALL_M
from qir.codegen.render import TEMPLATES
from qir.dtypes import BF16, F16, F32, DType
from qir.formats.base import WeightFormat
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.ops import W4A4_MAX_M
from qir.passes.manager import PassOptions, run_pipeline
from qir.passes.select_kernels import GEMM_FROM_M
from qir.runtime.memory import plan_memory
from qir.types import QWeight
from tests.conftest import FMT4, FORMAT_ZOO


def mlp(fmt: WeightFormat, act: DType = F16) -> Graph:
    b = Builder("mlp")
    x = b.input("x", ("M", 256), act)
    w = {
        n: b.weight(n, QWeight(fmt, o, i), name=f"w_{n}")
        for n, o, i in (("gate", 384, 256), ("up", 384, 256), ("down", 256, 384))
    }
    h = b.mul(b.silu(b.qlinear(x, w["gate"])), b.qlinear(x, w["up"]))
    b.output("y", b.add(x, b.qlinear(h, w["down"])))
    return b.graph


def families(graph: Graph, gemm_from_m: int | None = None) -> list[tuple[str, tuple[int, int]]]:
    passed, _ = run_pipeline(graph, options=PassOptions(gemm_from_m=gemm_from_m))
    return [(la.kernel.name.split("_")[0], la.when) for la in lower(passed).launches]


def test_the_plan_switches_family_at_the_table_crossover() -> None:
    first = GEMM_FROM_M["mlx_affine"]
    per_node = [("qgemv", (1, first - 1)), ("qgemm", (first, 64)), ("qgemm", (65, ALL_M[1]))]
    assert families(mlp(FMT4)) == per_node * 2  # gate/up pair, then down_proj
    assert families(mlp(FMT4), gemm_from_m=100) == [
        ("qgemv", (1, 99)), ("qgemm", (100, ALL_M[1]))] * 2  # fmt: skip
    assert families(mlp(FMT4, F32)) == [("qgemv", ALL_M)] * 2  # f32 stays on the GEMV


def test_w4a4_nodes_split_at_their_crossover_and_at_64_rows() -> None:
    first = GEMM_FROM_M["nvfp4 w4a4"]
    got = families(mlp(Nvfp4("div", 4), BF16))
    quant = ("quantize", (1, W4A4_MAX_M))
    node = [("qgemv", (1, first - 1)), ("qgemm", (first, 64)), ("qgemm", (65, ALL_M[1]))]
    assert got == [quant, *node, quant, *node]
    passed, _ = run_pipeline(mlp(Nvfp4("div", 4), BF16), options=PassOptions(gemm_from_m=1))
    names = [(la.kernel.name, la.when) for la in lower(passed).launches]
    assert [n for n, w in names if w == (1, 64) and n.startswith("qgemm")] == [
        "qgemm_nvfp4diva4_bf16_n384_384_k256_64x32x32s3w4x1_silumul_a4",
        "qgemm_nvfp4diva4_bf16_n256_k384_64x32x32s3w4x1_res_a4",
    ]
    # above 64 rows the 16-bit twins, on the 128-row tiles
    assert [n for n, w in names if w[0] == 65] == [
        "qgemm_nvfp4diva4_bf16_n384_384_k256_128x64x32s3w2x2_silumul",
        "qgemm_nvfp4diva4_bf16_n256_k384_128x64x32s3w2x2_res",
    ]


def test_every_batch_size_runs_each_node_exactly_once() -> None:
    passed, _ = run_pipeline(mlp(Nvfp4("mul", 4), BF16))
    plan = lower(passed)
    for m in (1, 8, 9, 16, 17, 63, 64, 65, 66, 1024, 4096):
        covered = [plan.launches[i].nodes[0] for i in plan_memory(plan, m).active]
        qlinears = [n for n in covered if passed.node(n).op == "qlinear"]
        assert len(qlinears) == len(set(qlinears)) == 2, m


def test_bucket_ranges_cut_at_the_table_buckets() -> None:
    assert (64, ALL_M[1]) == M_BUCKETS
    assert bucket_ranges(17, ALL_M[1]) == [(17, 64), (65, ALL_M[1])]
    assert bucket_ranges(65, ALL_M[1]) == [(65, ALL_M[1])]
    assert bucket_ranges(9, 64) == [(9, 64)]
    assert bucket_ranges(1, 1) == [(1, 1)]


@pytest.mark.parametrize("fmt", FORMAT_ZOO, ids=lambda f: f.tag())
def test_every_format_gets_a_tile_that_fits(fmt: WeightFormat) -> None:
    """BK holds whole fragment chunks, shared memory fits, and each warp owns whole m16 tiles
    and an even number of n8 tiles (B is loaded two n8 tiles per ldmatrix.x4)."""
    for k in (256, 208):
        try:
            chunk = fragment_for(fmt, 96, k).chunk_elems
            fmt.check_shape(96, k)
        except Exception:
            continue  # K not allowed by this format's groups
        a4 = isinstance(fmt, Nvfp4) and fmt.act_bits == 4
        for m_max in M_BUCKETS:
            for n in (40, 384, 14336):
                quantized = a4 and m_max <= W4A4_MAX_M
                t = choose_tile(m_max, n, chunk, quantized)
                assert t.bk % chunk == 0 and t.bk % 16 == 0
                assert smem_bytes(t, t.stages, quantized) <= SMEM_BYTES
                assert t.bm % (16 * t.warps_m) == 0 and t.nt % 2 == 0 and t.stages >= 2


def test_the_table_is_ordered_from_small_to_large_m() -> None:
    bounds = [m for m, _, _ in GEMM_TILES]
    assert bounds == sorted(bounds)
    # every bucket has a row for any N
    assert {m for m, n_min, _ in GEMM_TILES if n_min == 0} == set(M_BUCKETS)


def test_template_substitutes() -> None:
    """The kernel template places what Python rendered and decided (issue: far fewer control
    tags than the GEMV's 68); the pieces it places have none."""
    assert len(re.findall(r"{%", (TEMPLATES / "qgemm.cu.j2").read_text())) <= 25
    for piece in ("a_cp_async", "a_silu", "a_nvfp4", "a_silu_nvfp4", "b_dequant"):
        assert "{%" not in (TEMPLATES / "gemm" / f"{piece}.cuh.j2").read_text()


def test_kernel_source_spells_its_specialisation() -> None:
    w = QWeight(FMT4, 37, 256)
    k = gemm_kernel(GemmSpec((w, QWeight(FMT4, 40, 256)), F16, ALL_M[1]))
    assert k.name == "qgemm_mlx4g64bf16_f16_n37_40_k256_128x64x32s3w2x2"
    assert k.block == (128, 1, 1)
    assert "y0 = x W0^T; W0 is [37, 256]" in k.source
    assert "qir_mma_m16n8k16<act_t>" in k.source and "qir_cp_async_cg16" in k.source
    assert [h for h, _ in k.headers] == ["qir_common.cuh", "qir_mma.cuh", "qir_gemm.cuh"]
    with pytest.raises(ValueError, match="f16 or bf16 activations"):
        GemmSpec((w,), F32, 64)
    with pytest.raises(ValueError, match="residual epilogue takes exactly one weight"):
        GemmSpec((w, w), F16, 64, epilogue="residual")
