"""Runtime costs per block of the first embedded checkpoint: kernel loading through the compile
cache (cold compile, warm-disk load, in-process hit) on the host backend (g++) and compile-only
NVRTC, and, on a GPU, the CPU time per block run: plain launches vs CUDA graph replay.

    python benchmarks/runtime.py [--arch sm_90] [--repeat 200]

Cold and warm-disk numbers use a fresh temporary cache. A warm-disk host load runs in a child
process (this one has already dlopen'ed the libraries, which would make it look free); NVRTC has
no such process state, so there the in-process level is simply dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import qir
from qir.cli import embedded_checkpoints
from qir.codegen.lower import Plan, lower
from qir.models import load
from qir.models.blocks import BLOCKS, build
from qir.passes.manager import run_pipeline
from qir.runtime.cache import KernelCache
from qir.runtime.cuda import available
from qir.runtime.host import HostBackend
from qir.runtime.nvrtc import compile_cubin

CHILD = """
import json, sys, time
sys.path.insert(0, {here!r})
from runtime import block_plan
from qir.runtime.host import HostBackend
plan = block_plan({block!r})
be = HostBackend()
t0 = time.perf_counter()
for launch in plan.launches:
    be.load(launch.kernel)
print(json.dumps({{"seconds": time.perf_counter() - t0, "compiles": be.cache.compiles}}))
"""


def block_plan(name: str) -> Plan:
    b = build(load(embedded_checkpoints()[0]), name, 0)
    return lower(run_pipeline(b.graph, "default")[0])


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hit_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()
    return statistics.median(timed(fn) for _ in range(repeat))


def host_row(name: str, plan: Plan, repeat: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        be = HostBackend(cache_dir=Path(root))
        cold = sum(timed(lambda k=launch.kernel: be.load(k)) for launch in plan.launches)
        child = CHILD.format(here=str(Path(__file__).parent), block=name)
        env = {**os.environ, "QIR_CACHE_DIR": root}
        out = subprocess.run(
            [sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True
        )
        warm = json.loads(out.stdout)
        assert warm["compiles"] == 0, f"the warm-disk load compiled: {out.stderr}"
        kernels = [launch.kernel for launch in plan.launches]
        hit = hit_seconds(lambda: [be.load(k) for k in kernels], repeat)
    return cold, warm["seconds"], hit


def nvrtc_row(plan: Plan, arch: str, repeat: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        store = KernelCache(Path(root))
        kernels = [launch.kernel for launch in plan.launches]
        cold = sum(timed(lambda k=k: compile_cubin(k, arch, store)) for k in kernels)
        store.forget()
        warm = sum(timed(lambda k=k: compile_cubin(k, arch, store)) for k in kernels)
        assert store.compiles == len(set(kernels)), "the warm-disk load compiled"
        hit = hit_seconds(lambda: [compile_cubin(k, arch, store) for k in kernels], repeat)
    return cold, warm, hit


def gpu_rows(repeat: int) -> None:
    import cupy

    ck = load(embedded_checkpoints()[0])
    print("\nCPU time per block run on the GPU, M=1 (median us; launches are not waited on)")
    print(f"{'block':6} {'kernels':>7} {'plain launches':>15} {'graph replay':>13}")
    for name in BLOCKS:
        b = build(ck, name, 0)
        c = qir.compile(b.graph, b.weights, backend="cuda")
        stream = cupy.cuda.Stream(non_blocking=True)
        x16 = np.zeros((1, ck.hidden_size), ck.act_dtype.np)
        # CuPy holds bf16 as its bits
        x = cupy.asarray(x16.view(np.uint16) if x16.dtype.kind == "V" else x16)
        g = c.capture(1, stream=stream)
        g.inputs["x"][...] = x

        def plain(c: qir.Compiled = c, x: object = x, stream: object = stream) -> None:
            c({"x": x}, stream=stream)

        def replay(g: qir.runtime.executor.CapturedBlock = g, stream: object = stream) -> None:
            g(stream=stream)

        t_plain = hit_seconds(plain, repeat)
        t_replay = hit_seconds(replay, repeat)
        stream.synchronize()
        print(f"{name:6} {c.kernel_count:>7} {t_plain * 1e6:>15.1f} {t_replay * 1e6:>13.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="sm_90", help="NVRTC target (default sm_90)")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    print(f"checkpoint {embedded_checkpoints()[0].name}; times per block, kernels in brackets")
    header = f"{'block':6} {'backend':12} {'cold compile ms':>16} {'warm disk ms':>13}"
    print(f"{header} {'in-process us':>14} {'us/kernel':>10}")
    for name in BLOCKS:
        plan = block_plan(name)
        n = len(plan.launches)
        rows = [(f"host [{n}]", host_row(name, plan, args.repeat))]
        try:
            rows.append((f"nvrtc {args.arch}", nvrtc_row(plan, args.arch, args.repeat)))
        except qir.errors.QirError as e:
            print(f"nvrtc skipped: {e}")
        for label, (cold, warm, hit) in rows:
            print(f"{name:6} {label:12} {cold * 1e3:>16.1f} {warm * 1e3:>13.2f} "
                  f"{hit * 1e6:>14.2f} {hit * 1e6 / n:>10.2f}")  # fmt: skip
    if available():
        gpu_rows(args.repeat)
    else:
        print("\nno GPU: plain launches vs graph replay not measured")


if __name__ == "__main__":
    main()
