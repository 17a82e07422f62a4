"""Runtime costs per block of the first embedded checkpoint: kernel loading through the compile
cache (cold compile one kernel after another, and on the block's thread pool as qir.compile
does it; warm-disk load; in-process hit) on the host backend (g++) and compile-only NVRTC, and,
on a GPU, the CPU time per block run: plain launches vs CUDA graph replay.

    python benchmarks/runtime.py [--arch sm_90] [--repeat 200] [--blocks mlp qkv]

Cold and warm-disk numbers use a fresh temporary cache; a host one starts with the default
cache's precompiled header and runtime library (qir.runtime.host.seed_cache), which a machine
builds once per toolchain, not per block. A warm-disk host load runs in a child process (this
one has already dlopen'ed the libraries, which would make it look free); NVRTC has no such
process state, so there the in-process level is simply dropped.
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
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

import qir
from qir.codegen.lower import lower
from qir.codegen.plan import Plan
from qir.models import load
from qir.models.blocks import BLOCKS, build
from qir.models.goldens import embedded_checkpoints
from qir.passes.manager import run_pipeline
from qir.runtime.cache import KernelCache
from qir.runtime.cuda import available
from qir.runtime.host import HostBackend, seed_cache
from qir.runtime.loading import compile_jobs, load_kernels
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


Row = tuple[float, float, float, float]  # cold serial, cold on threads, warm disk, in-process


def host_row(name: str, plan: Plan, repeat: int) -> Row:
    kernels = [launch.kernel for launch in plan.launches]
    default = HostBackend()
    default.load(kernels[0])  # the default cache's header and runtime library, to seed from
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        pooled = timed(
            lambda: load_kernels(
                HostBackend(cache_dir=seed_cache(default.cache.root, Path(root))), kernels
            )
        )
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        be = HostBackend(cache_dir=seed_cache(default.cache.root, Path(root)))
        cold = sum(timed(lambda k=k: be.load(k)) for k in kernels)
        child = CHILD.format(here=str(Path(__file__).parent), block=name)
        env = {**os.environ, "QIR_CACHE_DIR": root}
        out = subprocess.run(
            [sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True
        )
        warm = json.loads(out.stdout)
        assert warm["compiles"] == 0, f"the warm-disk load compiled: {out.stderr}"
        hit = hit_seconds(lambda: [be.load(k) for k in kernels], repeat)
    return cold, pooled, warm["seconds"], hit


def nvrtc_row(plan: Plan, arch: str, repeat: int) -> Row:
    kernels = [launch.kernel for launch in plan.launches]
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        # NVRTC's first compile in a process also loads NVRTC (~70 ms): not part of either column.
        compile_cubin(kernels[0], arch, KernelCache(Path(root)))
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        store = KernelCache(Path(root))
        with ThreadPoolExecutor(min(compile_jobs(), len(set(kernels)))) as pool:
            pooled = timed(
                lambda: list(pool.map(partial(compile_cubin, arch=arch, cache=store), set(kernels)))
            )
    with tempfile.TemporaryDirectory(prefix="qir-bench-") as root:
        store = KernelCache(Path(root))
        cold = sum(timed(lambda k=k: compile_cubin(k, arch, store)) for k in kernels)
        store.forget()
        warm = sum(timed(lambda k=k: compile_cubin(k, arch, store)) for k in kernels)
        assert store.compiles == len(set(kernels)), "the warm-disk load compiled"
        hit = hit_seconds(lambda: [compile_cubin(k, arch, store) for k in kernels], repeat)
    return cold, pooled, warm, hit


def executor_rows(blocks: list[str], repeat: int) -> dict[str, float]:
    """qir's own CPU time per run (binding, arena, arguments; the kernel calls stubbed out) on
    the host backend: what a plain run on the GPU pays on top of CuPy's per-launch cost."""
    ck = load(embedded_checkpoints()[0])
    x = np.zeros((1, ck.hidden_size), ck.act_dtype.np)
    out = {}
    for name in blocks:
        b = build(ck, name, 0)
        c = qir.compile(b.graph, b.weights, backend="host")
        be = c._executor("stub").backend
        be.launch = lambda *a, **k: None  # type: ignore[method-assign]
        out[name] = hit_seconds(lambda c=c: c({"x": x}), repeat)
    return out


def gpu_rows(repeat: int) -> None:
    import cupy

    ck = load(embedded_checkpoints()[0])
    print("\nCPU time per block run on the GPU, M=1 (median us; launches are not waited on)")
    # padded: capture_batches([1, 2, 4]) called with 3 rows (an input copy, then the replay)
    print(f"{'block':6} {'kernels':>7} {'plain launches':>15} {'graph replay':>13} {'padded':>7}")
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

        batches = c.capture_batches([1, 2, 4], stream=stream)
        x3 = cupy.zeros((3, ck.hidden_size), dtype=x.dtype)

        def padded(
            batches: qir.runtime.executor.CapturedBatches = batches,
            x3: object = x3,
            stream: object = stream,
        ) -> None:
            batches({"x": x3}, stream=stream)

        t_plain = hit_seconds(plain, repeat)
        t_replay = hit_seconds(replay, repeat)
        t_padded = hit_seconds(padded, repeat)
        stream.synchronize()
        print(f"{name:6} {c.kernel_count:>7} {t_plain * 1e6:>15.1f} {t_replay * 1e6:>13.1f} "
              f"{t_padded * 1e6:>7.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> list[tuple[str, str, Row]]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="sm_90", help="NVRTC target (default sm_90)")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--blocks", nargs="+", choices=BLOCKS, default=list(BLOCKS))
    args = ap.parse_args(argv)
    print(f"checkpoint {embedded_checkpoints()[0].name}; times per block, kernels in brackets")
    threads = f"cold, {compile_jobs()} threads ms"
    header = (
        f"{'block':6} {'backend':12} {'cold compile ms':>16} {threads:>20} {'warm disk ms':>13}"
    )
    print(f"{header} {'in-process us':>14} {'us/kernel':>10}")
    table: list[tuple[str, str, Row]] = []
    for name in args.blocks:
        plan = block_plan(name)
        n = len(plan.launches)
        rows = [(f"host [{n}]", host_row(name, plan, args.repeat))]
        try:
            rows.append((f"nvrtc {args.arch}", nvrtc_row(plan, args.arch, args.repeat)))
        except qir.errors.QirError as e:
            print(f"nvrtc skipped: {e}")
        table += [(name, label, row) for label, row in rows]
        for label, (cold, pooled, warm, hit) in rows:
            print(f"{name:6} {label:12} {cold * 1e3:>16.1f} {pooled * 1e3:>20.1f} "
                  f"{warm * 1e3:>13.2f} {hit * 1e6:>14.2f} {hit * 1e6 / n:>10.2f}")  # fmt: skip
    print("\nqir's CPU time per run at M=1, kernel calls stubbed out (host backend, median us)")
    for name, seconds in executor_rows(args.blocks, args.repeat).items():
        print(f"{name:6} {seconds * 1e6:8.1f}")
    if available():
        gpu_rows(args.repeat)
    else:
        print("\nno GPU: plain launches vs graph replay not measured")
    return table


if __name__ == "__main__":
    main()
