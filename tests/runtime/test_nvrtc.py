"""NVRTC compile-only checks: no GPU or driver needed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.lower import lower
from qir.dtypes import BF16
from qir.formats.nvfp4 import Nvfp4
from qir.passes.manager import run_pipeline
from qir.runtime.errors import CompileError
from qir.runtime.nvrtc import (
    GATE_ARCHS,
    SpillError,
    check_no_spills,
    compile_cubin,
    kernel_include_dir,
    nvrtc_version,
    ptxas_reports,
)
from tests.conftest import mlp_graph
from tests.requires import requires

# A skip mark rather than importorskip: test_cuda imports this module's kernels on GPU machines
# that have CuPy but not the `compile` extra.
pytestmark = requires("nvrtc")

# y[i] = sum of the 8 halves packed in x[i], loaded as one 128-bit uint4.
HALF_SUM = Kernel(
    name="half_sum8",
    source=r"""#include <cuda_fp16.h>
#include <stdint.h>

extern "C" __global__ void half_sum8(const uint4* __restrict__ x, __half* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint4 v = x[i];
  const __half2* h = reinterpret_cast<const __half2*>(&v);
  float acc = 0.0f;
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    float2 f = __half22float2(h[j]);
    acc += f.x + f.y;
  }
  y[i] = __float2half(acc);
}
""",
    params=(
        KernelParam("x", "const uint4* __restrict__", "buffer"),
        KernelParam("y", "__half* __restrict__", "buffer"),
        KernelParam("n", "int", "int"),
    ),
    block=(128, 1, 1),
)

# y[i] = x[i] * k in bfloat16, through float.
BF16_SCALE = Kernel(
    name="bf16_scale",
    source=r"""#include <cuda_bf16.h>
#include <stdint.h>

extern "C" __global__ void bf16_scale(const __nv_bfloat16* __restrict__ x,
                                      __nv_bfloat16* __restrict__ y, int k, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(__bfloat162float(x[i]) * static_cast<float>(k));
}
""",
    params=(
        KernelParam("x", "const __nv_bfloat16* __restrict__", "buffer"),
        KernelParam("y", "__nv_bfloat16* __restrict__", "buffer"),
        KernelParam("k", "int", "int"),
        KernelParam("n", "int", "int"),
    ),
    block=(256, 1, 1),
)

# y[i] = 2 * x[i] + b[i], with the helper coming from kernel.headers (in a subdirectory).
HEADER_AXPY = Kernel(
    name="header_axpy",
    source=r"""#include <stdint.h>
#include "ops/axpy.h"

extern "C" __global__ void header_axpy(const float* __restrict__ x, const float* __restrict__ b,
                                       float* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = qir_test::axpy(2.0f, x[i], b[i]);
}
""",
    params=(
        KernelParam("x", "const float* __restrict__", "buffer"),
        KernelParam("b", "const float* __restrict__", "buffer"),
        KernelParam("y", "float* __restrict__", "buffer"),
        KernelParam("n", "int", "int"),
    ),
    block=(64, 1, 1),
    headers=(
        (
            "ops/axpy.h",
            "#pragma once\nnamespace qir_test {\n"
            "__device__ inline float axpy(float a, float x, float b) { return a * x + b; }\n}\n",
        ),
    ),
)

KERNELS = (HALF_SUM, BF16_SCALE, HEADER_AXPY)

# __launch_bounds__(1024, 2) caps ptxas at 32 registers per thread, far below the 64 live floats.
SPILLY = Kernel(
    name="spilly",
    source=r"""extern "C" __global__ void __launch_bounds__(1024, 2)
spilly(const float* __restrict__ x, float* __restrict__ y) {
  float acc[64];
  #pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = x[threadIdx.x * 64 + j];
  #pragma unroll
  for (int r = 0; r < 8; ++r) {
    #pragma unroll
    for (int j = 0; j < 64; ++j) acc[j] = acc[j] * acc[(j + r + 1) & 63] + 1.0f;
  }
  float s = 0.0f;
  #pragma unroll
  for (int j = 0; j < 64; ++j) s += acc[j] * x[j];
  y[threadIdx.x] = s;
}
""",
    params=(
        KernelParam("x", "const float* __restrict__", "buffer"),
        KernelParam("y", "float* __restrict__", "buffer"),
    ),
    block=(1024, 1, 1),
)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_compiles_to_cubin_without_spills(kernel: Kernel, arch: str) -> None:
    result = compile_cubin(kernel, arch)
    assert result.cubin[:4] == b"\x7fELF"
    assert result.arch == arch
    assert result.registers > 0
    assert result.spill_bytes == 0
    assert f"'{kernel.name}' for '{arch}'" in result.log


def test_check_no_spills_returns_one_result_per_gate_arch() -> None:
    results = check_no_spills(HALF_SUM)
    assert [r.arch for r in results] == ["sm_80", "sm_90", "sm_100a", "sm_120a"]


@pytest.mark.parametrize("arch", GATE_ARCHS)
def test_spilling_kernel_is_rejected_naming_kernel_and_arch(arch: str) -> None:
    assert compile_cubin(SPILLY, arch).spill_bytes > 0
    with pytest.raises(SpillError, match=rf"kernel spilly spills \d+ bytes .* on {arch}") as info:
        check_no_spills(SPILLY, archs=(arch,))
    assert (info.value.kernel, info.value.arch) == ("spilly", arch)


def test_syntax_error_names_kernel_and_offending_line() -> None:
    bad_line = "  float v = x[i] * * 2.0f;"
    source = "\n".join(
        [
            "#include <cuda_fp16.h>",
            'extern "C" __global__ void broken(const float* x, float* y) {',
            "  int i = threadIdx.x;",
            bad_line,
            "  y[i] = v;",
            "}",
        ]
    )
    kernel = Kernel("broken", source, (), (32, 1, 1))
    with pytest.raises(CompileError) as info:
        compile_cubin(kernel, "sm_90")
    message = str(info.value)
    assert info.value.kernel == "broken"
    assert info.value.compiler == "nvrtc"
    assert "broken" in message
    assert re.search(r"broken\.cu\(4\): error", message)
    assert f"4 | {bad_line}" in message  # the numbered excerpt of the generated source


def test_header_names_may_not_leave_the_include_dir() -> None:
    kernel = Kernel("escape", "", (), (1, 1, 1), headers=(("../evil.h", ""),))
    with pytest.raises(ValueError, match="escape"), kernel_include_dir(kernel):
        pass


def test_nvrtc_version_names_the_build() -> None:
    assert re.fullmatch(r"\d+\.\d+(\.\d+ \S+)?", nvrtc_version())


def test_nvrtc_error_type_falls_back_when_the_private_module_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qir.runtime import nvrtc

    assert nvrtc._nvrtc_error().__name__ == "NVRTCError"
    monkeypatch.setitem(sys.modules, "cuda.core._utils.cuda_utils", None)
    assert nvrtc._nvrtc_error() is Exception
    assert nvrtc.available()  # the public API is all the backend needs


def test_ptxas_report_reads_each_functions_figures() -> None:
    result = compile_cubin(SPILLY, "sm_90")
    report = ptxas_reports(result.log)["spilly"]
    assert report == result.report
    assert 0 < report.registers <= 32  # __launch_bounds__(1024, 2): 64K / 2048 threads
    assert report.spill_stores > 0 and report.spill_loads > 0
    assert report.stack_bytes >= report.spill_stores // 4  # spills live in the stack frame
    assert result.spill_bytes == report.spill_stores + report.spill_loads


def _issue14_down_projection() -> Kernel:
    """The W4A4 down projection `qir dump` writes for an NVFP4 W4A4 MLP with hidden 512 and
    intermediate 1408 (issue 14's example: it spilled 608 bytes on sm_80/sm_90 before the
    packed-pair rewrite)."""
    g, _ = mlp_graph(np.random.default_rng(0), 512, 1408, Nvfp4("div", 4), BF16)
    plan = lower(run_pipeline(g, "default")[0])
    name = "qgemv_nvfp4diva4_bf16_n512_k1408_m8_l8_res_a4"
    return next(la.kernel for la in plan.launches if la.kernel.name == name)


@requires("nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120a"])
def test_ptxas_figures_equal_nvccs_on_the_dumped_source(tmp_path: Path, arch: str) -> None:
    """What the gate reads from NVRTC is what `nvcc -cubin -Xptxas -v` prints for the .cu that
    `qir dump` writes: registers, stack, spill stores and loads, shared memory, barriers."""
    for kernel in (_issue14_down_projection(), HALF_SUM, SPILLY):
        cu = tmp_path / f"{kernel.name}.cu"
        cu.write_text(kernel.source)
        for header, text in kernel.headers:
            (tmp_path / header).write_text(text)
        nvcc = subprocess.run(
            ["nvcc", "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", cu.name],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        theirs = ptxas_reports(nvcc.stdout + nvcc.stderr)[kernel.name]
        assert compile_cubin(kernel, arch).report == theirs, (kernel.name, arch)
