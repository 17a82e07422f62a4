"""Kernel speed at a real layer's shapes (Llama-3-8B: hidden 4096, intermediate 14336, 32 query
and 8 key/value heads of 128), every weight format, side by side in one run: the default fused
pipeline, the MLP with silu(g)*u in down_proj's prologue instead, with silu and mul as their
own launches, unfused, and, on a GPU, dense f16 cuBLAS (CuPy matmuls) as the baseline.

    python benchmarks/llama_shapes.py [--backend cuda|host] [--m 1 8] [--repeat 15]
        [--scale 1.0] [--formats mlx4g64bf16 ...] [--json results.json]

Each block is captured for its M (`Compiled.capture`: one CUDA graph) and replayed; a sample is
the device time of --inner replays between two CUDA events (wall time on the host backend),
and the figure is the median of --repeat samples. Weights are random (quantized 64-row tiles,
repeated: values do not change the speed of these kernels). Bandwidth is the bytes the plan
moves (weights once, activations) over that time, also as a share of a device-to-device copy
measured in the same run. --scale shrinks every dimension (the host backend defaults to 1/32,
to finish in seconds). Ratios > 1 mean the fused block is faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import qir
from qir.builder import Builder
from qir.dtypes import BF16, F16
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.ct_int import CtInt
from qir.formats.fp8 import Fp8
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.passes.manager import PIPELINES
from qir.runtime.backend import best_backend
from qir.types import QWeight

LLAMA3_8B = {"hidden": 4096, "inter": 14336, "q": 4096, "kv": 1024}
FORMATS: tuple[WeightFormat, ...] = (
    MlxAffine(4, 64, BF16),
    Awq(4, 128),
    Gptq(4, 128, "gptq", 0, F16),
    CtInt(4, 128, BF16),
    Fp8("channel"),
    Mxfp4(),
    Nvfp4("mul", 16),
    Nvfp4("mul", 4),
)
PIPELINE_VARIANTS: dict[str, dict[str, str | tuple[str, ...]]] = {
    # fused: the default (16-bit: silu(g)*u in the gate/up epilogue; W4A4: in down_proj's
    # prologue); silu_prologue: always down_proj's prologue; no_silu_fusion: silu and mul as
    # their own launches.
    "mlp": {
        "fused": "default",
        "silu_prologue": tuple(p for p in PIPELINES["default"] if p != "silu_epilogue"),
        "no_silu_fusion": tuple(
            p for p in PIPELINES["default"] if p not in ("silu_epilogue", "silu_prologue")
        ),
        "unfused": "none",
    },
    "qkv": {"fused": "default", "unfused": "none"},
}
TILE_ROWS = 64
Weights = dict[str, dict[str, np.ndarray]]


@dataclass
class Row:
    format: str
    block: str
    m: int
    variant: str
    launches: int
    mib: float
    us: float
    gbps: float


def dims(scale: float) -> dict[str, int]:
    """LLAMA3_8B scaled, each kept a multiple of 128 (every group and tile size divides it)."""
    return {k: max(128, round(v * scale / 128) * 128) for k, v in LLAMA3_8B.items()}


def tiled_weight(
    rng: np.random.Generator, fmt: WeightFormat, out_f: int, in_f: int
) -> tuple[QWeight, dict[str, np.ndarray]]:
    """Kernel-layout buffers for [out_f, in_f]: a quantized TILE_ROWS-row weight repeated down the
    rows (quantizing 58M weights in numpy would take longer than the benchmark)."""
    w = rng.standard_normal((TILE_ROWS, in_f), dtype=np.float32) * 0.02
    small = (
        fmt.quantize(w, input_amax=4.0)
        if isinstance(fmt, Nvfp4) and fmt.act_bits == 4
        else fmt.quantize(w)
    )
    small_types = fmt.buffers(TILE_ROWS, in_f)
    bufs = {}
    for name, t in fmt.buffers(out_f, in_f).items():
        v = small[name]
        if small_types[name].shape[0] == TILE_ROWS != t.shape[0]:  # a per-row buffer
            v = np.tile(v, (-(-out_f // TILE_ROWS),) + (1,) * (v.ndim - 1))[:out_f]
        assert tuple(v.shape) == tuple(t.shape), (fmt.spell(), name, v.shape, t.shape)
        bufs[name] = np.ascontiguousarray(v)
    return QWeight(fmt, out_f, in_f), bufs


def build(block: str, fmt: WeightFormat, d: dict[str, int], seed: int) -> tuple[Graph, Weights]:
    rng = np.random.default_rng(seed)
    b = Builder(block)
    x = b.input("x", ("M", d["hidden"]), F16)
    shapes = (
        {"gate": d["inter"], "up": d["inter"]}
        if block == "mlp"
        else {"q": d["q"], "k": d["kv"], "v": d["kv"]}
    )
    weights: Weights = {}
    outs = {}
    for name, n in shapes.items():
        qw, weights[name] = tiled_weight(rng, fmt, n, d["hidden"])
        outs[name] = b.qlinear(x, b.weight(name, qw, name=f"w_{name}"), name=name)
    if block == "mlp":
        qw, weights["down"] = tiled_weight(rng, fmt, d["hidden"], d["inter"])
        h = b.mul(b.silu(outs["gate"]), outs["up"])
        b.output("y", b.add(x, b.qlinear(h, b.weight("down", qw, name="w_down"))))
    else:
        for name, v in outs.items():
            b.output(name, v)
    return b.graph, weights


class Timer:
    """Median time of `inner` calls of a function, on the backend's clock: CUDA events on a
    non-default stream (the function gets the stream), wall time on the host."""

    def __init__(self, backend: str, repeat: int, inner: int) -> None:
        self.backend, self.repeat, self.inner = backend, repeat, inner
        self.stream: Any = None
        if backend == "cuda":
            import cupy

            self._cp = cupy
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def seconds(self, fn: Callable[[Any], object]) -> float:
        for _ in range(3):
            fn(self.stream)
        samples = []
        for _ in range(self.repeat):
            if self.backend == "cuda":
                start, end = self._cp.cuda.Event(), self._cp.cuda.Event()
                start.record(self.stream)
                for _ in range(self.inner):
                    fn(self.stream)
                end.record(self.stream)
                end.synchronize()
                samples.append(self._cp.cuda.get_elapsed_time(start, end) / 1e3 / self.inner)
            else:
                t0 = time.perf_counter()
                for _ in range(self.inner):
                    fn(self.stream)
                samples.append((time.perf_counter() - t0) / self.inner)
        return statistics.median(samples)


def copy_gbps(timer: Timer) -> float:
    """Device-to-device copy bandwidth, bytes read plus written: the ceiling for these kernels."""
    cp = timer._cp
    src = cp.ones(1 << 28, dtype=cp.float32)  # 1 GiB
    dst = cp.empty_like(src)

    def copy(stream: Any) -> None:
        with stream:
            dst[...] = src

    return 2 * src.nbytes / timer.seconds(copy) / 1e9


def cublas_seconds(timer: Timer, block: str, d: dict[str, int], m: int) -> float:
    """The same block with dense f16 weights through CuPy (cuBLAS GEMMs, CuPy elementwise)."""
    cp = timer._cp
    rng = cp.random.default_rng(0)
    x = rng.standard_normal((m, d["hidden"]), dtype=cp.float32).astype(cp.float16)

    def dense(n: int, k: int) -> Any:
        return (rng.standard_normal((k, n), dtype=cp.float32) * 0.02).astype(cp.float16)

    if block == "mlp":
        wg, wu, wd = dense(d["inter"], d["hidden"]), dense(d["inter"], d["hidden"])
        wd = dense(d["hidden"], d["inter"])

        def run(stream: Any) -> None:
            with stream:
                g, u = x @ wg, x @ wu
                x + (g / (1 + cp.exp(-g)) * u) @ wd
    else:
        ws = [dense(d["q"], d["hidden"]), dense(d["kv"], d["hidden"]), dense(d["kv"], d["hidden"])]

        def run(stream: Any) -> None:
            with stream:
                for w in ws:
                    x @ w

    return timer.seconds(run)


def measure(args: argparse.Namespace, backend: str) -> tuple[list[Row], dict[str, float]]:
    d = dims(args.scale)
    timer = Timer(backend, args.repeat, args.inner)
    extra: dict[str, float] = {}
    if backend == "cuda":
        extra["copy_gbps"] = copy_gbps(timer)
        print(f"device-to-device copy: {extra['copy_gbps']:.0f} GB/s (read + write)")
    rows: list[Row] = []
    formats = [f for f in FORMATS if not args.formats or f.tag() in args.formats]
    for i, fmt in enumerate(formats):
        for block, variants in PIPELINE_VARIANTS.items():
            graph, weights = build(block, fmt, d, seed=i)
            for variant, passes in variants.items():
                compiled = qir.compile(graph, weights, backend=backend, passes=passes)
                assert compiled.plan is not None
                for m in args.m:
                    rng = np.random.default_rng(m)
                    x = rng.standard_normal((m, d["hidden"]), dtype=np.float32).astype(np.float16)
                    replay = compiled.capture(m, stream=timer.stream)
                    replay({"x": x}, stream=timer.stream)
                    s = timer.seconds(lambda stream, r=replay: r(stream=stream))
                    moved = sum(
                        compiled.plan.bytes_moved(la, m)
                        for la in compiled.plan.launches
                        if la.runs_for(m)
                    )
                    row = Row(
                        fmt.tag(),
                        block,
                        m,
                        variant,
                        compiled.launches_for(m),
                        moved / 2**20,
                        s * 1e6,
                        moved / s / 1e9,
                    )
                    rows.append(row)
                    print(
                        f"{row.format:14} {block:4} {m:>3} {variant:17} {row.launches:>3} "
                        f"{row.mib:>8.1f} {row.us:>9.1f} {row.gbps:>8.1f}",
                        flush=True,
                    )
                del compiled
    if backend == "cuda":
        for block in PIPELINE_VARIANTS:
            for m in args.m:
                extra[f"cublas_f16_{block}_M{m}_us"] = 1e6 * cublas_seconds(timer, block, d, m)
    return rows, extra


def summary(rows: Sequence[Row], extra: dict[str, float]) -> list[str]:
    """Per format, block and M: fused vs each other variant, and vs dense cuBLAS."""
    by = {(r.format, r.block, r.m, r.variant): r for r in rows}
    lines = []
    for (fmt, block, m, variant), r in by.items():
        if variant != "fused":
            continue
        parts = [f"{fmt:14} {block:4} M={m:<3} fused {r.us:8.1f} us"]
        for other in PIPELINE_VARIANTS[block]:
            if other != "fused":
                parts.append(f"{other} x{by[fmt, block, m, other].us / r.us:.2f}")
        dense = extra.get(f"cublas_f16_{block}_M{m}_us")
        if dense:
            parts.append(f"cuBLAS f16 x{dense / r.us:.2f}")
        if "copy_gbps" in extra:
            parts.append(f"{100 * r.gbps / extra['copy_gbps']:.0f}% of copy bandwidth")
        lines.append("  ".join(parts))
    return lines


def main(argv: Sequence[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None, help="cuda or host (default: best available)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=15, help="samples; the median is reported")
    ap.add_argument("--inner", type=int, default=None, help="replays per sample")
    ap.add_argument("--scale", type=float, default=None, help="shrink every dimension")
    ap.add_argument("--formats", nargs="*", default=[], help="format tags, e.g. mlx4g64bf16")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    backend = args.backend or best_backend()
    if backend not in ("cuda", "host"):
        ap.error(f"--backend {backend}: expected cuda or host")
    unknown = set(args.formats) - {f.tag() for f in FORMATS}
    if unknown:
        ap.error(f"unknown --formats {sorted(unknown)}; choose from {[f.tag() for f in FORMATS]}")
    args.scale = args.scale if args.scale is not None else (1.0 if backend == "cuda" else 1 / 32)
    args.inner = args.inner if args.inner is not None else (20 if backend == "cuda" else 1)
    print(
        f"backend {backend}; shapes {dims(args.scale)}; median of {args.repeat} samples "
        f"of {args.inner} replays"
    )
    print(f"{'format':14} {'blk':4} {'M':>3} {'variant':17} {'n':>3} {'MiB':>8} {'us':>9} GB/s")
    rows, extra = measure(args, backend)
    print("\n".join(["", "fused vs the others (x>1: fused is faster):", *summary(rows, extra)]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], **extra}, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
