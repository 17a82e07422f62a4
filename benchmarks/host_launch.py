"""Per-launch cost of the host backend (g++ + fibers): the median wall time of one launch of

  (a) `tiny`: 1 block of 32 threads, one add per thread: nothing but launch overhead;
  (b) `gemv`: 128 blocks of 128 threads, one warp per row, 5 warp shuffles per thread (the shape
      of a decode GEMV): launch overhead plus 16384 fibers' worth of switches.

    python benchmarks/host_launch.py [--repeat 200] [--threads N]

"launch" goes through `HostBackend.launch` (argument checks and ctypes marshalling every time);
"replay" calls a launch bound once by `HostBackend.record`, which is what the executor's
captured blocks do. `--threads` sets QIR_HOST_THREADS (default: every CPU). Kernels compile into
a temporary cache, so the first run pays two g++ compiles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from qir.codegen.kernel import Kernel, KernelParam

TINY = Kernel(
    "bench_tiny",
    'extern "C" __global__ void bench_tiny(const float* x, float* y) {\n'
    "  y[threadIdx.x] = x[threadIdx.x] + 1.f;\n}\n",
    (KernelParam("x", "const float*", "buffer"), KernelParam("y", "float*", "buffer")),
    (32, 1, 1),
)

GEMV = Kernel(
    "bench_gemv",
    'extern "C" __global__ void bench_gemv(const float* __restrict__ w, '
    "const float* __restrict__ x, float* __restrict__ y, int n, int k) {\n"
    "  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;\n"
    "  const int lane = threadIdx.x % 32;\n"
    "  if (row >= n) return;\n"
    "  float acc = 0.f;\n"
    "  for (int j = lane; j < k; j += 32) acc += w[row * k + j] * x[j];\n"
    "  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);\n"
    "  if (lane == 0) y[row] = acc;\n}\n",
    (
        KernelParam("w", "const float* __restrict__", "buffer"),
        KernelParam("x", "const float* __restrict__", "buffer"),
        KernelParam("y", "float* __restrict__", "buffer"),
        KernelParam("n", "int", "int"),
        KernelParam("k", "int", "int"),
    ),
    (128, 1, 1),
)


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None, help="QIR_HOST_THREADS")
    args = ap.parse_args()
    if args.threads is not None:
        os.environ["QIR_HOST_THREADS"] = str(args.threads)
    from qir.runtime.host import HostBackend

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        be = HostBackend(cache_dir=Path(root))
        x32, y32 = rng.standard_normal(32).astype(np.float32), np.zeros(32, np.float32)
        n, k = 512, 256  # 4 rows per 128-thread block: 128 blocks
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal(k).astype(np.float32)
        y = np.zeros(n, np.float32)
        cases: list[tuple[str, Kernel, tuple[int, int, int], list[np.ndarray | int]]] = [
            ("(a) tiny 1x32", TINY, (1, 1, 1), [x32, y32]),
            ("(b) gemv 128x128", GEMV, (n // 4, 1, 1), [w, x, y, n, k]),
        ]
        threads = os.environ.get("QIR_HOST_THREADS", f"all ({os.cpu_count()})")
        print(f"host launch, median of {args.repeat}, QIR_HOST_THREADS={threads}")
        print(f"{'kernel':18} {'launch us':>11} {'replay us':>11}")
        for label, kernel, grid, kargs in cases:
            hk = be.load(kernel)
            launch = median_seconds(partial(be.launch, hk, grid, kargs), args.repeat)
            replay = median_seconds(partial(be.record([(hk, grid, kargs)]), None), args.repeat)
            print(f"{label:18} {launch * 1e6:>11.1f} {replay * 1e6:>11.1f}")
        np.testing.assert_allclose(y32, x32 + 1)
        np.testing.assert_allclose(y, w @ x, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    main()
