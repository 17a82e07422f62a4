"""Kernel speed at a real layer's shapes (Llama-3-8B: hidden 4096, intermediate 14336, 32 query
and 8 key/value heads of 128), every weight format, side by side in one run: the default fused
pipeline, the MLP with silu(g)*u in down_proj's prologue instead, with silu and mul as their
own launches, unfused, and, on a GPU, dense f16 cuBLAS (CuPy matmuls) as the baseline.

    python benchmarks/llama_shapes.py [--backend cuda|host] [--m 1 8] [--repeat 15]
        [--scale 1.0] [--formats mlx4g64bf16 ...] [--json results.json]
        [--sweep [--sweep-m 1 2 ... 4096] [--shapes qkv o gate_up down 8192]]

--sweep adds the M sweep of the kernel families (GEMV for decode, the tensor-core GEMM for
prefill; select_kernels' table picks one per M): each projection of the layer (q/k/v merged
4096 -> 6144, o 4096 -> 4096, gate/up 4096 -> 2 x 14336 with silu(g)*u, down 14336 -> 4096)
and 8192 x 8192, per format and M: device time, GB/s and its share of a device copy, TFLOP/s
from M = 64, and the ratio to CuPy's f16 matmul (cuBLAS) of the same shape in the same run.
Without a GPU it prints that part as "not measured: no GPU" and runs what it can: the plan
(family, kernel and grid per M) and the host backend's GEMM against its GEMV at M = 256 on a
small shape, so a slowdown of the emulated tensor cores shows.

Each block is captured for its M (`Compiled.capture`: one CUDA graph) and replayed; a sample is
the device time of --inner replays between two CUDA events (wall time on the host backend),
and the figure is the median of --repeat samples. Replays rotate over enough copies of the
block (own weights each) to overflow L2 twice, so weights come from DRAM as in a real model
whose layers follow each other. The cuBLAS baseline is replayed the same way (as CUDA graphs;
"eager" in the table if CuPy could not capture it). Weights are random (quantized 64-row
tiles, repeated: values do not change the speed of these kernels). Bandwidth is the bytes the plan
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
from qir.codegen.lower import lower
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
    # fused: the default (silu(g)*u in the gate/up pair's epilogue; W4A4: then one quantize_act
    # of it for down_proj); silu_prologue: down_proj computes it (and under W4A4 quantizes it)
    # in its prologue, in every warp; no_silu_fusion: silu and mul as their own launches.
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
    """Median time of `inner` calls, on the backend's clock: CUDA events on a non-default stream
    (each call gets the stream), wall time on the host. Calls rotate over several functions: the
    same computation on copies of its weights, so that replays do not find the weights still in
    L2 (an H200 holds ~50 MB there, more than a 4-bit q/k/v)."""

    def __init__(self, backend: str, repeat: int, inner: int) -> None:
        self.backend, self.repeat, self.inner = backend, repeat, inner
        self.stream: Any = None
        self.l2_bytes = 0
        if backend == "cuda":
            import cupy

            self._cp = cupy
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.l2_bytes = int(cupy.cuda.Device().attributes.get("L2CacheSize", 60 << 20))

    def copies(self, weight_bytes: int) -> int:
        """How many copies of `weight_bytes` of weights together overflow L2 twice."""
        return min(16, max(1, -(-2 * self.l2_bytes // max(weight_bytes, 1))))

    def seconds(self, fns: Sequence[Callable[[Any], object]]) -> float:
        for fn in fns:
            fn(self.stream)
        samples = []
        for _ in range(self.repeat):
            if self.backend == "cuda":
                start, end = self._cp.cuda.Event(), self._cp.cuda.Event()
                start.record(self.stream)
                for i in range(self.inner):
                    fns[i % len(fns)](self.stream)
                end.record(self.stream)
                end.synchronize()
                samples.append(self._cp.cuda.get_elapsed_time(start, end) / 1e3 / self.inner)
            else:
                t0 = time.perf_counter()
                for i in range(self.inner):
                    fns[i % len(fns)](self.stream)
                samples.append((time.perf_counter() - t0) / self.inner)
        return statistics.median(samples)


def copy_gbps(timer: Timer) -> float:
    """Device-to-device copy bandwidth, bytes read plus written: the ceiling for these kernels."""
    cp = timer._cp
    src = cp.ones(1 << 28, dtype=cp.float32)  # 1 GiB: far beyond L2
    dst = cp.empty_like(src)

    def copy(stream: Any) -> None:
        with stream:
            cp.copyto(dst, src)

    return 2 * src.nbytes / timer.seconds([copy]) / 1e9


@dataclass
class Dense:
    """A block with dense f16 weights; `run` writes `outs` from `x` and `weights` ([in, out])."""

    run: Callable[[], None]
    x: Any
    weights: list[Any]
    outs: list[Any]


def dense_block(xp: Any, block: str, d: dict[str, int], m: int, seed: int) -> Dense:
    """The block with dense f16 weights in array module `xp` (CuPy: cuBLAS GEMMs and CuPy
    elementwise kernels), every result written into buffers made here, so that a call
    allocates nothing and a CUDA graph can capture it."""
    rng = np.random.default_rng(seed)

    def dev(shape: tuple[int, ...], scale: float = 1.0) -> Any:
        return xp.asarray((rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16))

    x = dev((m, d["hidden"]))
    if block == "mlp":
        wg, wu = dev((d["hidden"], d["inter"]), 0.02), dev((d["hidden"], d["inter"]), 0.02)
        wd = dev((d["inter"], d["hidden"]), 0.02)
        g, u, h = (xp.empty((m, d["inter"]), dtype=xp.float16) for _ in range(3))
        y = xp.empty((m, d["hidden"]), dtype=xp.float16)

        def run() -> None:
            xp.matmul(x, wg, out=g)
            xp.matmul(x, wu, out=u)
            xp.negative(g, out=h)  # h = g / (1 + exp(-g)) * u, in place
            xp.exp(h, out=h)
            xp.add(h, 1, out=h)
            xp.divide(g, h, out=h)
            xp.multiply(h, u, out=h)
            xp.matmul(h, wd, out=y)
            xp.add(y, x, out=y)

        return Dense(run, x, [wg, wu, wd], [y])
    ws = [dev((d["hidden"], n), 0.02) for n in (d["q"], d["kv"], d["kv"])]
    outs = [xp.empty((m, w.shape[1]), dtype=xp.float16) for w in ws]

    def run_qkv() -> None:
        for w, o in zip(ws, outs, strict=True):
            xp.matmul(x, w, out=o)

    return Dense(run_qkv, x, ws, outs)


def cublas_seconds(timer: Timer, block: str, d: dict[str, int], m: int) -> tuple[float, str]:
    """Device time of the dense f16 block, replayed as a CUDA graph like qir's blocks (launched
    one by one from Python, as "eager", if CuPy cannot capture them)."""
    weight_bytes = 2 * d["hidden"] * (3 * d["inter"] if block == "mlp" else d["q"] + 2 * d["kv"])
    copies = range(timer.copies(weight_bytes))
    runs = [dense_block(timer._cp, block, d, m, seed).run for seed in copies]
    s = timer.stream
    graphs = []
    try:
        for run in runs:
            with s:
                run()  # first calls (cuBLAS handle, workspace) happen outside the capture
            s.synchronize()
            s.begin_capture()
            try:
                with s:
                    run()
            finally:
                graphs.append(s.end_capture())
    except Exception as e:
        print(f"cuBLAS baseline not captured ({type(e).__name__}: {e}); timing it eagerly")

        def eager(stream: Any, run: Callable[[], None]) -> None:
            with stream:
                run()

        return timer.seconds([lambda st, r=r: eager(st, r) for r in runs]), "eager"
    return timer.seconds([lambda st, g=g: g.launch(st) for g in graphs]), "graph"


def measure(args: argparse.Namespace, backend: str) -> tuple[list[Row], dict[str, Any]]:
    d = dims(args.scale)
    timer = Timer(backend, args.repeat, args.inner)
    extra: dict[str, Any] = {"shapes": d}
    if backend == "cuda":
        extra["copy_gbps"] = copy_gbps(timer)
        print(f"device-to-device copy: {extra['copy_gbps']:.0f} GB/s (read + write)")
    rows: list[Row] = []
    formats = [f for f in FORMATS if not args.formats or f.tag() in args.formats]
    for i, fmt in enumerate(formats):
        for block, variants in PIPELINE_VARIANTS.items():
            graph, weights = build(block, fmt, d, seed=i)
            n_copies = timer.copies(sum(b.nbytes for w in weights.values() for b in w.values()))
            for variant, passes in variants.items():
                # Copies share kernels (compiled once) but each uploads its own weights.
                copies = [
                    qir.compile(graph, weights, backend=backend, passes=passes)
                    for _ in range(n_copies)
                ]
                plan = copies[0].plan
                assert plan is not None
                for m in args.m:
                    rng = np.random.default_rng(m)
                    x = rng.standard_normal((m, d["hidden"]), dtype=np.float32).astype(np.float16)
                    replays = [c.capture(m, stream=timer.stream) for c in copies]
                    for r in replays:
                        r({"x": x}, stream=timer.stream)
                    s = timer.seconds([lambda st, r=r: r(stream=st) for r in replays])
                    moved = sum(plan.bytes_moved(la, m) for la in plan.launches if la.runs_for(m))
                    row = Row(
                        fmt.tag(),
                        block,
                        m,
                        variant,
                        copies[0].launches_for(m),
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
                    save(args.json, rows, extra)  # a timeout keeps what was measured
                del copies, replays
    if backend == "cuda":
        for block in PIPELINE_VARIANTS:
            for m in args.m:
                seconds, how = cublas_seconds(timer, block, d, m)
                extra[f"cublas_f16_{block}_M{m}_us"] = 1e6 * seconds
                extra[f"cublas_f16_{block}_M{m}_how"] = how
                save(args.json, rows, extra)
    return rows, extra


def save(path: str | None, rows: Sequence[Row], extra: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], **extra}, f, indent=1)


def summary(rows: Sequence[Row], extra: dict[str, Any]) -> list[str]:
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
            how = extra[f"cublas_f16_{block}_M{m}_how"]
            parts.append(f"cuBLAS f16 ({how}) x{dense / r.us:.2f}")
        if "copy_gbps" in extra:
            parts.append(f"{100 * r.gbps / extra['copy_gbps']:.0f}% of copy bandwidth")
        lines.append("  ".join(parts))
    return lines


# -- the M sweep: one projection per row -------------------------------------------------------

SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
# name: (K, N of each weight sharing the input); gate_up is a pair with silu(g) * u as epilogue.
SWEEP_SHAPES: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
    "8192": (8192, (8192,)),
}
# M and shape of the host backend's GEMM-vs-GEMV timing.
HOST_M, HOST_K, HOST_N = 256, 256, 128


@dataclass
class SweepRow:
    format: str
    shape: str
    m: int
    kernels: str  # the families that run, e.g. "qgemm" or "quantize_act+qgemv"
    us: float
    gbps: float
    tflops: float  # 0 below M = 64
    cublas_ratio: float  # cuBLAS f16 time / ours (x > 1: ours is faster); 0 if not measured


def projection(
    shape: str, fmt: WeightFormat, scale: float, seed: int
) -> tuple[Graph, Weights, int, int]:
    """One projection of the sweep (its K and total N scaled like dims(), multiples of 128)."""
    k, ns = SWEEP_SHAPES[shape]
    k = max(128, round(k * scale / 128) * 128)
    ns = tuple(max(128, round(n * scale / 128) * 128) for n in ns)
    rng = np.random.default_rng(seed)
    b = Builder(shape)
    x = b.input("x", ("M", k), F16)
    weights: Weights = {}
    outs = []
    for j, n in enumerate(ns):
        qw, weights[f"w{j}"] = tiled_weight(rng, fmt, n, k)
        outs.append(b.qlinear(x, b.weight(f"w{j}", qw, name=f"w_{j}")))
    if shape == "gate_up":
        b.output("h", b.mul(b.silu(outs[0]), outs[1]))
    else:
        for j, o in enumerate(outs):
            b.output(f"y{j}", o)
    return b.graph, weights, k, sum(ns[:1] if shape == "gate_up" else ns)


def families(c: qir.Compiled, m: int) -> str:
    assert c.plan is not None
    names = [la.kernel.name.split("_")[0] for la in c.plan.launches if la.runs_for(m)]
    return "+".join(dict.fromkeys("quantize_act" if n == "quantize" else n for n in names))


def plan_table(args: argparse.Namespace) -> None:
    """The compile-time part of the sweep: which family and kernel each M runs, and its grid."""
    for fmt in [f for f in FORMATS if not args.formats or f.tag() in args.formats]:
        for shape in args.shapes:
            graph, weights, _, _ = projection(shape, fmt, 1.0, 0)
            plan = lower(qir.compile(graph, weights, backend="reference").graph)
            for m in args.sweep_m:
                for la in plan.launches:
                    if la.runs_for(m) and not la.kernel.name.startswith("quantize_act"):
                        print(
                            f"  {fmt.tag():14} {shape:8} M={m:<5} {la.kernel.name} "
                            f"grid {list(la.grid(m))} block {list(la.kernel.block)}"
                        )


def cublas_gemm_seconds(timer: Timer, k: int, n: int, m: int) -> float:
    """CuPy's f16 matmul [m, k] x [k, n] (cuBLAS), rotating weight copies, as CUDA graphs."""
    cp = timer._cp
    rng = np.random.default_rng(m)
    x = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
    ws = [cp.asarray((rng.standard_normal((k, n), dtype=np.float32) * 0.02).astype(np.float16))
          for _ in range(timer.copies(2 * k * n))]  # fmt: skip
    y = cp.empty((m, n), dtype=cp.float16)
    s, graphs = timer.stream, []
    for w in ws:
        with s:
            cp.matmul(x, w, out=y)
        s.synchronize()
        s.begin_capture()
        try:
            with s:
                cp.matmul(x, w, out=y)
        finally:
            graphs.append(s.end_capture())
    return timer.seconds([lambda st, g=g: g.launch(st) for g in graphs])


def sweep(args: argparse.Namespace, backend: str, copy: float) -> list[SweepRow]:
    rows: list[SweepRow] = []
    if backend != "cuda":
        print("\nM sweep (device time, GB/s, TFLOP/s, vs cuBLAS f16): not measured: no GPU")
        print("its plan at full size (family, kernel, grid per M):")
        plan_table(args)
        return rows
    timer = Timer(backend, args.repeat, args.inner)
    print(f"\n{'format':14} {'shape':8} {'M':>5} {'kernels':22} {'us':>9} {'GB/s':>7} "
          f"{'%copy':>5} {'TFLOP/s':>7} {'cuBLAS/us':>9}")  # fmt: skip
    formats = [f for f in FORMATS if not args.formats or f.tag() in args.formats]
    for i, fmt in enumerate(formats):
        for shape in args.shapes:
            graph, weights, k, n = projection(shape, fmt, args.scale, i)
            n_copies = timer.copies(sum(b.nbytes for w in weights.values() for b in w.values()))
            copies = [qir.compile(graph, weights, backend=backend) for _ in range(n_copies)]
            plan = copies[0].plan
            assert plan is not None
            gemm_n = n * (2 if shape == "gate_up" else 1)
            for m in args.sweep_m:
                x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
                replays = [c.capture(m, stream=timer.stream) for c in copies]
                for r in replays:
                    r({"x": x.astype(np.float16)}, stream=timer.stream)
                t = timer.seconds([lambda st, r=r: r(stream=st) for r in replays])
                moved = sum(plan.bytes_moved(la, m) for la in plan.launches if la.runs_for(m))
                flops = 2 * m * k * gemm_n / t / 1e12 if m >= 64 else 0.0
                dense = cublas_gemm_seconds(timer, k, gemm_n, m)
                row = SweepRow(fmt.tag(), shape, m, families(copies[0], m), t * 1e6,
                               moved / t / 1e9, flops, dense / t)  # fmt: skip
                rows.append(row)
                print(f"{row.format:14} {shape:8} {m:>5} {row.kernels:22} {row.us:>9.1f} "
                      f"{row.gbps:>7.0f} {100 * row.gbps / copy:>5.0f} "
                      f"{row.tflops:>7.1f} {row.cublas_ratio:>9.2f}", flush=True)  # fmt: skip
                save_sweep(args.json, rows)
                del replays
            del copies
    return rows


def save_sweep(path: str | None, rows: Sequence[SweepRow]) -> None:
    if path:
        sweep_path = path.removesuffix(".json") + ".sweep.json"
        with open(sweep_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


def host_gemm_vs_gemv(repeat: int) -> tuple[float, float]:
    """Host-backend seconds of one [HOST_M, HOST_K] x [HOST_K, HOST_N] projection through the
    GEMM and through the GEMV (a regression in the tensor-core emulation shows here)."""
    b = Builder("host")
    x = b.input("x", ("M", HOST_K), F16)
    qw, bufs = tiled_weight(np.random.default_rng(0), MlxAffine(4, 64, BF16), HOST_N, HOST_K)
    b.output("y", b.qlinear(x, b.weight("w", qw, name="w_w")))
    xs = {"x": np.random.default_rng(1).standard_normal((HOST_M, HOST_K)).astype(np.float16)}
    out = []
    for first_gemm in (1, HOST_M + 1):  # the GEMM at every M; the GEMV up to HOST_M
        c = qir.compile(b.graph, {"w": bufs}, backend="host", gemm_from_m=first_gemm)
        c(xs)
        out.append(statistics.median(_wall(lambda c=c: c(xs)) for _ in range(repeat)))
    return out[0], out[1]


def _wall(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None, help="cuda or host (default: best available)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=15, help="samples; the median is reported")
    ap.add_argument("--inner", type=int, default=None, help="replays per sample")
    ap.add_argument("--scale", type=float, default=None, help="shrink every dimension")
    ap.add_argument("--formats", nargs="*", default=[], help="format tags, e.g. mlx4g64bf16")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--sweep", action="store_true", help="also the M sweep of the families")
    ap.add_argument("--sweep-m", type=int, nargs="+", default=list(SWEEP_M))
    ap.add_argument("--shapes", nargs="+", default=list(SWEEP_SHAPES), choices=list(SWEEP_SHAPES))
    ap.add_argument("--no-blocks", action="store_true", help="skip the fused-vs-unfused blocks")
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
    rows: list[Row] = []
    extra: dict[str, Any] = {}
    if not args.no_blocks:
        print(f"{'format':14} {'blk':4} {'M':>3} {'variant':17} {'n':>3} {'MiB':>8} {'us':>9} GB/s")
        rows, extra = measure(args, backend)
        print("\n".join(["", "fused vs the others (x>1: fused is faster):", *summary(rows, extra)]))
    if args.sweep:
        copy = extra.get("copy_gbps") or (
            copy_gbps(Timer(backend, 3, 5)) if backend == "cuda" else 0
        )
        sweep(args, backend, copy)
        if backend == "host":
            gemm, gemv = host_gemm_vs_gemv(args.repeat)
            print(f"\nhost backend, [{HOST_M}, {HOST_K}] x [{HOST_K}, {HOST_N}] MLX 4-bit: GEMM "
                  f"{gemm * 1e3:.1f} ms, GEMV {gemv * 1e3:.1f} ms (GEMM/GEMV x{gemm / gemv:.2f})")  # fmt: skip
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
