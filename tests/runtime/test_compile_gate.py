"""The compile gate at a checkpoint's shapes, not only the toy shapes of the other tests:
whether a GEMV spills depends on K (ptxas unrolls its loop over K), so the fused MLP and q/k/v
GEMVs (q/k/v with biases) and W4A4's quantize_act of one format per dequant fragment, and of W4A4, are built for
every gate arch at hidden 512 and intermediate 1408 (issue 14's W4A4 down projection,
K = 1408) and must not spill. The GEMMs' loop over K tiles is never unrolled (`#pragma unroll 1`
in qgemm.cu.j2): their code does not depend on K, and their gates build them at small shapes
(test_every_format.py, test_gemm_kernels.py). The figures are ptxas' own, the ones
`nvcc -Xptxas -v` prints for the dumped .cu (tests/runtime/test_nvrtc.py compares them)."""

from __future__ import annotations

import numpy as np
import pytest

from qir.builder import Builder
from qir.codegen.kernel import Kernel
from qir.codegen.lower import lower
from qir.dtypes import BF16, F16
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.fp8 import Fp8
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4
from qir.formats.nvfp4 import Nvfp4
from qir.passes.manager import run_pipeline
from qir.runtime import nvrtc
from qir.runtime.executor import prepare_all
from qir.types import QWeight
from tests.conftest import mlp_graph

pytestmark = pytest.mark.skipif(not nvrtc.available(), reason="needs qir[compile] (NVRTC)")

HIDDEN, INTER, KV = 512, 1408, 128
# One format per dequant fragment (MLX affine with codes straddling words, packed integer
# codes, FP8, MX, NVFP4 W4A16) and NVFP4 W4A4 (the 4-bit activation kernels).
FORMATS: tuple[WeightFormat, ...] = (
    MlxAffine(3, 64, BF16),
    Awq(4, 128),
    Fp8("channel"),
    Mxfp4(),
    Nvfp4("mul", 16),
    Nvfp4("div", 4),
)


def _kernels() -> list[Kernel]:
    seen: dict[str, Kernel] = {}
    rng = np.random.default_rng(0)
    for fmt in FORMATS:
        act = BF16 if isinstance(fmt, Nvfp4) else F16
        mlp, _ = mlp_graph(rng, HIDDEN, INTER, fmt, act)
        b = Builder("qkv")
        x = b.input("x", ("M", HIDDEN), act)
        # Biased, as Qwen2's: the bias joins the sums after the warp reduction.
        for name, n in {"q": HIDDEN, "k": KV, "v": KV}.items():
            w = b.weight(name, QWeight(fmt, n, HIDDEN, bias=True), name=f"w_{name}")
            b.output(name, b.qlinear(x, w, name=name))
        for g in (mlp, b.graph):
            for launch in lower(run_pipeline(g, "default")[0]).launches:
                if not launch.kernel.name.startswith("qgemm"):
                    seen.setdefault(launch.kernel.name, launch.kernel)
    return list(seen.values())


@pytest.mark.parametrize("arch", nvrtc.GATE_ARCHS)
def test_kernels_at_checkpoint_shapes_build_without_spills(arch: str) -> None:
    kernels = _kernels()
    prepare_all(lambda k: nvrtc.compile_cubin(k, arch), kernels)  # on the compile threads
    results = [nvrtc.compile_cubin(k, arch) for k in kernels]  # then from the cache
    spilling = {
        k.name: f"{r.report.spill_stores}/{r.report.spill_loads} B spill stores/loads"
        for k, r in zip(kernels, results, strict=True)
        if r.spill_bytes
    }
    assert {k.name.split("_")[0] for k in kernels} == {"qgemv", "quantize"}
    assert all(r.cubin[:4] == b"\x7fELF" for r in results)
    assert spilling == {}, f"spills on {arch}"
