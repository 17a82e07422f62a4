"""The compile gate at a checkpoint's shapes, not only the toy shapes of the other tests:
whether a GEMV spills depends on K (ptxas unrolls its loop over K), so the fused MLP and q/k/v
GEMVs (and W4A4's quantize_act) of one format per dequant fragment, and of W4A4, are built for
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
        for name, n in {"q": HIDDEN, "k": KV, "v": KV}.items():
            w = b.weight(name, QWeight(fmt, n, HIDDEN), name=f"w_{name}")
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


# Mixture-of-experts kernels (qir/codegen/moe.py, moe_gemm.py) at a checkpoint's shapes: the
# expert GEMVs (gate/up with silu(g) * u; down with the combine and the residual: K = 1408) of
# one format per fragment kind (codes straddling words, E4M3 with a per-tensor scale per
# expert, NVFP4), the grouped GEMMs of the 64-row bucket, and the route, group and combine
# kernels.
MOE_FORMATS: tuple[WeightFormat, ...] = (MlxAffine(3, 64, BF16), Fp8("tensor"), Nvfp4("mul", 16))


def _moe_kernels() -> list[Kernel]:
    from tests.moe_common import moe_graph

    seen: dict[str, Kernel] = {}
    rng = np.random.default_rng(0)
    for i, fmt in enumerate(MOE_FORMATS):
        graph, _ = moe_graph(rng, HIDDEN, INTER, 8, 2, fmt, BF16 if isinstance(fmt, Nvfp4) else F16)
        for launch in lower(run_pipeline(graph, "default")[0]).launches:
            name = launch.kernel.name
            gemm = name.startswith("moe_qgemm")
            if name.startswith("moe_") and (not gemm or (i != 1 and launch.when[1] <= 64)):
                seen.setdefault(name, launch.kernel)
    return list(seen.values())


@pytest.mark.parametrize("arch", nvrtc.GATE_ARCHS)
def test_moe_kernels_build_without_spills(arch: str) -> None:
    kernels = _moe_kernels()
    prepare_all(lambda k: nvrtc.compile_cubin(k, arch), kernels)
    results = [nvrtc.compile_cubin(k, arch) for k in kernels]
    kinds = {"_".join(k.name.split("_")[:2]) for k in kernels}
    assert kinds == {"moe_route", "moe_gemv", "moe_group", "moe_qgemm", "moe_combine"}
    assert len([k for k in kernels if k.name.startswith("moe_gemv")]) == 2 * len(MOE_FORMATS)
    spilling = {
        k.name: r.spill_bytes for k, r in zip(kernels, results, strict=True) if r.spill_bytes
    }
    assert spilling == {}, f"spills on {arch}"
