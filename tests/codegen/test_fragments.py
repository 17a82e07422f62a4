"""Every format's device fragment, decoded on the host backend, against the format's numpy
dequantize: the float decode to float32 rounding, the packed f16/bf16 decode (what a GEMM's MMA
fragments take) to one rounding in the pair's type."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qir.codegen.fragments import fragment_for
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.render import common_header, render
from qir.dtypes import BF16, F16, F32
from qir.formats import fp_codes
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.fp8 import Fp8
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4
from qir.formats.nvfp4 import Nvfp4
from qir.runtime.host import HostBackend
from tests.conftest import random_weight
from tests.requires import requires

pytestmark = requires("gxx")

# One thread per (row, chunk): every interface of the fragment, written out side by side.
_KERNEL = """\
{target}
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "qir_common.cuh"
{fragment}
extern "C" __global__ void {name}({params}, float* out_f32, uint32_t* out_h, uint32_t* out_b,
    float* out_compat, int rows, int chunks) {{
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * chunks) return;
  const int row = t / chunks, chunk = t % chunks;
  qir_raw r;
  qir_load({init}, row, chunk, r);
  float f[QIR_CHUNK];
  qir_decode_f32(r, f);
  uint32_t h[QIR_CHUNK / 2], b[QIR_CHUNK / 2];
  qir_decode<__half>(r, h);
  qir_decode<__nv_bfloat16>(r, b);
  float compat[QIR_CHUNK];
  qir_dequant_chunk({args}, row, chunk, compat);
  for (int i = 0; i < QIR_CHUNK; ++i) {{
    out_f32[(size_t)t * QIR_CHUNK + i] = f[i];
    out_compat[(size_t)t * QIR_CHUNK + i] = compat[i];
  }}
  for (int i = 0; i < QIR_CHUNK / 2; ++i) {{
    out_h[(size_t)t * QIR_CHUNK / 2 + i] = h[i];
    out_b[(size_t)t * QIR_CHUNK / 2 + i] = b[i];
  }}
}}
"""


def fragment_kernel(fmt: WeightFormat, rows: int, k: int, fp4_cvt: bool = False) -> Kernel:
    """fp4_cvt: E2M1 decoded as on a target with the FP4 conversion (sm_100a, sm_120a)."""
    frag = fragment_for(fmt, rows, k)
    name = f"frag_{fmt.tag()}_k{k}{'_cvt' if fp4_cvt else ''}"
    out = ("float*", "uint32_t*", "uint32_t*", "float*")
    params = (
        *frag.params,
        *(KernelParam(n, t, "buffer") for n, t in zip(("f", "h", "b", "c"), out, strict=True)),
        KernelParam("rows", "int", "int"),
        KernelParam("chunks", "int", "int"),
    )
    source = _KERNEL.format(
        target="#define QIR_FP4_CVT 1" if fp4_cvt else "",
        fragment=render(frag.template, **frag.context),
        name=name,
        params=", ".join(f"{p.c_type} {p.name}" for p in frag.params),
        init=frag.weight_init("w_"),
        args=", ".join(p.name for p in frag.params),
    )
    return Kernel(name, source, params, (64, 1, 1), (common_header(),))


@pytest.fixture(scope="module")
def be(tmp_path_factory: pytest.TempPathFactory) -> HostBackend:
    return HostBackend(cache_dir=tmp_path_factory.mktemp("frag-cache"))


def pairs_as(values: np.ndarray, dtype: type) -> np.ndarray:
    return values.view(np.uint16).view(dtype).astype(np.float32)


# 3 groups of 128 (or 12 MX/NVFP4 blocks): several chunks per row, a group per chunk or several.
K = 384
# The decoder paths the GEMV tests reach least directly (they cover every format's packed sums):
# codes of 1 bit (stride 16), 6 (straddling words, MLX's bias), 4 with packed zeros, 8 with v1's
# zero offset and bf16 scales, act-order (float only), E4M3, E2M1 with E8M0 or E4M3 scales.
FORMATS = (
    MlxAffine(1, 32, F16),
    MlxAffine(6, 128, F32),
    Awq(4, 64),
    Gptq(3, 128, "gptq", 1, F16),
    Gptq(8, 32, "gptq", 0, BF16),
    Fp8("channel"),
    Mxfp4(),
    Nvfp4("div", 16),
)


CASES = [
    *(pytest.param(f, False, id=f.tag()) for f in FORMATS),
    # E2M1 through the FP4 conversion's decode (k-order pairs; its host emulation).
    *(pytest.param(f, True, id=f"{f.tag()}-fp4cvt") for f in FORMATS if fragment_for(f, 5, K).e2m1),
]


@pytest.mark.parametrize(("fmt", "fp4_cvt"), CASES)
def test_fragment_decodes_equal_the_numpy_dequant(
    fmt: WeightFormat, fp4_cvt: bool, be: HostBackend
) -> None:
    rows = 5
    rng = np.random.default_rng(7)
    _, bufs = random_weight(rng, rows, K, fmt)
    ref = fmt.dequantize(bufs, rows, K)
    frag = fragment_for(fmt, rows, K)
    chunks = frag.chunks_per_row(K)
    kern = be.load(fragment_kernel(fmt, rows, K, fp4_cvt))
    f32 = np.zeros((rows, K), np.float32)
    h = np.zeros((rows, K // 2), np.uint32)
    b = np.zeros((rows, K // 2), np.uint32)
    compat = np.zeros((rows, K), np.float32)
    args = [np.ascontiguousarray(bufs[name]) for name in frag.buffers]
    grid = (-(-rows * chunks // 64), 1, 1)
    be.launch(kern, grid, [*args, f32, h, b, compat, rows, chunks])
    np.testing.assert_array_equal(compat, f32)
    # float32: the reference rounds q * s + b twice, the fragment once (fmaf).
    row_max = np.abs(ref).max(axis=1, keepdims=True)
    np.testing.assert_allclose(f32, ref, rtol=2**-23, atol=0 if "mlx" not in fmt.tag() else 1e-7)
    for pairs, dtype, eps in ((h, np.float16, 2**-11), (b, ml_dtypes.bfloat16, 2**-8)):
        got = pairs_as(pairs, dtype)
        # Scale (and bias) rounded to the pair type, then one rounding of c * s + b: within a
        # few ulps of the row's largest weight (|c * s| and |b| are at most about twice it).
        assert np.all(np.abs(got - ref) <= eps * (np.abs(ref) + 4 * row_max)), fmt.spell()


def test_nvfp4_chunk_codes_for_w4a4_kernels(be: HostBackend) -> None:
    """The raw side W4A4 kernels read (codes as loaded, each block's factor s * g or s / g, as
    the numpy decode forms it), one call per chunk: what the GEMM family's W4A4 path calls."""
    rows, k = 3, 64
    for fmt in (Nvfp4("mul", 4), Nvfp4("div", 16)):
        frag = fragment_for(fmt, rows, k)
        _, bufs = random_weight(np.random.default_rng(2), rows, k, fmt)
        chunks = frag.chunks_per_row(k)
        blocks = frag.chunk_elems // 16
        name = f"chunk_codes_{fmt.tag()}"
        params = (
            *frag.params,
            KernelParam("words", "uint32_t*", "buffer"),
            KernelParam("factors", "float*", "buffer"),
        )
        source = f"""\
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "qir_common.cuh"
{render(frag.template, **frag.context)}
extern "C" __global__ void {name}({", ".join(f"{p.c_type} {p.name}" for p in params)}) {{
  const int t = threadIdx.x, row = t / {chunks}, chunk = t % {chunks};
  if (t >= {rows * chunks}) return;
  uint32_t w[QIR_WORDS];
  float f[{blocks}];
  qir_nvfp4_chunk_codes({", ".join(p.name for p in frag.params)}, row, chunk, w, f);
  for (int i = 0; i < QIR_WORDS; ++i) words[t * QIR_WORDS + i] = w[i];
  for (int b = 0; b < {blocks}; ++b) factors[t * {blocks} + b] = f[b];
}}
"""
        kern = be.load(Kernel(name, source, params, (32, 1, 1), (common_header(),)))
        words = np.zeros(rows * k // 8, np.uint32)
        factors = np.zeros(rows * k // 16, np.float32)
        args = [np.ascontiguousarray(bufs[b]) for b in frag.buffers]
        be.launch(kern, (1, 1, 1), [*args, words, factors])
        assert words.tobytes() == np.ascontiguousarray(bufs["weight"]).tobytes()
        s = fp_codes.e4m3_decode(bufs["block_scale"].reshape(-1))
        g = np.float32(bufs["global_scale"][0])
        want = s * g if fmt.scale_mode == "mul" else s / g
        np.testing.assert_array_equal(factors, want.astype(np.float32))
