"""select_kernels: the family label (GEMV below a crossover, the tensor-core GEMM from it) from
the one table, per format and for W4A4; f32 stays GEMV; the label prints, parses back and is
verified; the override moves every node's crossover."""

from __future__ import annotations

import pytest

from qir import parse, print_graph
from qir.passes.manager import PassOptions, run_pipeline
from qir.passes.select_kernels import GEMM_FROM_M, SelectKernels
from qir.verify import VerifyError, verify

W4 = "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>"
FP8 = "qweight<fp8<granularity=channel>>"


def graph(act: str, fmt: str = W4) -> str:
    return f"""
graph g {{
  %x = input : {act}[M, 128]
  %w_a = weight {{key="a"}} : {fmt}[64, 128]
  %w_b = weight {{key="b"}} : {fmt}[96, 128]
  %a = qlinear %x, %w_a : {act}[M, 64]
  %b = qlinear %x, %w_b : {act}[M, 96]
  output a = %a
  output b = %b
}}
"""


def test_labels_the_crossover_from_the_table_and_prints_it() -> None:
    g = parse(graph("f16"))
    assert SelectKernels().run(g) == 2
    text = print_graph(g)
    first = GEMM_FROM_M["mlx_affine"]
    assert f'%a = qlinear %x, %w_a {{gemm_from_m={first}, kernel="gemv|gemm"}}' in text
    assert print_graph(parse(text)) == text  # the label round-trips
    assert SelectKernels().run(g) == 0  # labelled nodes are kept


def test_f32_activations_stay_on_the_gemv() -> None:
    g = parse(graph("f32"))
    assert SelectKernels(gemm_from_m=1).run(g) == 2
    assert '%a = qlinear %x, %w_a {kernel="gemv"}' in print_graph(g)


def test_override_moves_every_crossover_and_one_means_gemm_only() -> None:
    g = parse(graph("bf16", FP8))
    SelectKernels(gemm_from_m=1).run(g)
    assert '{gemm_from_m=1, kernel="gemm"}' in print_graph(g)
    after, records = run_pipeline(parse(graph("f16")), options=PassOptions(gemm_from_m=40))
    assert {r.name: r.matches for r in records}["select_kernels"] == 1  # a and b merged
    assert "gemm_from_m=40" in print_graph(after)


def test_w4a4_nodes_take_their_own_row() -> None:
    w = "qweight<nvfp4<scale_mode=div,act_bits=4>>"
    after, _ = run_pipeline(parse(graph("bf16", w)))
    text = print_graph(after)
    assert "quantize_act" in text
    assert f"gemm_from_m={GEMM_FROM_M['nvfp4 w4a4']}, kernel=" in text


@pytest.mark.parametrize(
    ("attrs", "error"),
    [
        ('{kernel="tensor"}', "unknown kernel 'tensor'"),
        ('{kernel="gemv|gemm"}', "gemm_from_m goes with"),
        ('{gemm_from_m=8, kernel="gemv"}', "gemm_from_m goes with"),
        ('{gemm_from_m=1, kernel="gemv|gemm"}', "gemm_from_m=1 must be"),
        ('{gemm_from_m=8, kernel="gemm"}', "gemm_from_m=8 must be"),
    ],
)
def test_verifier_rejects_inconsistent_labels(attrs: str, error: str) -> None:
    text = graph("f16").replace("%a = qlinear %x, %w_a :", f"%a = qlinear %x, %w_a {attrs} :")
    with pytest.raises(VerifyError, match=error):
        verify(parse(text))


def test_verifier_rejects_a_gemm_label_on_f32() -> None:
    text = graph("f32").replace(
        "%a = qlinear %x, %w_a :", '%a = qlinear %x, %w_a {gemm_from_m=1, kernel="gemm"} :'
    )
    with pytest.raises(VerifyError, match="takes f16 or bf16 activations, not f32"):
        verify(parse(text))
