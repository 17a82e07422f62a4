"""NVRTC compile-only checks: no GPU or driver needed."""

from __future__ import annotations

import re
import sys

import pytest

from qir.codegen.kernel import Kernel, KernelParam
from qir.runtime.errors import CompileError
from qir.runtime.nvrtc import (
    SpillError,
    available,
    check_no_spills,
    compile_cubin,
    kernel_include_dir,
    nvrtc_version,
)

# A skip mark rather than importorskip: test_cuda imports this module's kernels on GPU machines
# that have CuPy but not the `compile` extra.
pytestmark = pytest.mark.skipif(not available(), reason="needs cuda-core 1.x (qir[compile])")

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


def test_check_no_spills_returns_one_result_per_arch() -> None:
    results = check_no_spills(HALF_SUM)
    assert [r.arch for r in results] == ["sm_80", "sm_90"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
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
