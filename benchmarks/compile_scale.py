"""Compile time at model scale: a graph of L Llama-3-8B layers (q/k/v, gate/up/down) through the
default pass pipeline, lowering and rendering, timed separately (median of --repeat), for a
W4A16 format (MLX affine 4-bit) and a W4A4 one (compressed-tensors NVFP4), then the ratio of each
step's time at 80 layers to its time at 8: 10 when the step grows linearly with the model.

    python benchmarks/compile_scale.py [--layers 8 16 32 80 160] [--repeat 5] [--formats w4a16 w4a4]
                                       [--clock wall|cpu]

The graphs carry weight types only (no data): passes, lowering and rendering never read weights.
There is no attention op yet, so a layer's q projection stands in for the attention output: the
MLP reads it and adds it back (h' = q + down(silu(gate(q)) * up(q))); k and v are outputs.
"rendering" is the time spent in the Jinja templates (`render` of qir.codegen), "lowering" the
rest of `lower()`; each repetition starts with lowering's kernel memo empty, as a fresh process
does. Timings are printed, never asserted (tests/test_benchmarks.py runs a tiny L as a smoke test).
On a machine other jobs share, `--clock cpu` (this process's CPU time) moves less than wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import qir.codegen.lower as lowering
import qir.codegen.render as rendering
from qir.builder import Builder
from qir.dtypes import BF16
from qir.formats.base import WeightFormat
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.passes.manager import run_pipeline
from qir.types import QWeight


@dataclass(frozen=True)
class Dims:
    hidden: int = 4096
    q: int = 4096
    kv: int = 1024
    intermediate: int = 14336


LLAMA3_8B = Dims()
# name -> (weight format, the activation rule each weight node carries)
FORMATS: dict[str, tuple[WeightFormat, dict[str, float]]] = {
    "w4a16": (MlxAffine(bits=4, group_size=64, scale_dtype=BF16), {}),
    # compressed-tensors W4A4: calibrated activation scales, 4-bit activations declared
    "w4a4": (Nvfp4(scale_mode="div", act_bits=4), {"input_global_scale": 2688.0}),
}


def build_layers(layers: int, fmt: WeightFormat, rule: dict[str, float], d: Dims) -> Graph:
    b = Builder(f"layers{layers}")
    h = b.input("x", ("M", d.hidden), BF16)
    for i in range(layers):

        def w(proj: str, out: int, k: int, i: int = i) -> Any:
            key = f"model.layers.{i}.{proj}"
            return b.weight(key, QWeight(fmt, out, k), name=f"w{i}_{proj}", act_rule=rule)

        q = b.qlinear(h, w("q_proj", d.q, d.hidden), name=f"q{i}")
        b.output(f"k{i}", b.qlinear(h, w("k_proj", d.kv, d.hidden), name=f"k{i}"))
        b.output(f"v{i}", b.qlinear(h, w("v_proj", d.kv, d.hidden), name=f"v{i}"))
        gate = b.qlinear(q, w("gate_proj", d.intermediate, d.q), name=f"gate{i}")
        up = b.qlinear(q, w("up_proj", d.intermediate, d.q), name=f"up{i}")
        prod = b.mul(b.silu(gate, name=f"act{i}"), up, name=f"prod{i}")
        down = b.qlinear(prod, w("down_proj", d.hidden, d.intermediate), name=f"down{i}")
        h = b.add(q, down, name=f"h{i + 1}")
    b.output("y", h)
    return b.graph


@contextmanager
def render_timer(clock: Callable[[], float]) -> Iterator[list[float]]:
    """Accumulates the seconds spent in qir.codegen's `render` (wherever a kernel module
    imported it) into the yielded one-element list."""
    spent = [0.0]
    original = rendering.render

    def timed(template: str, **context: Any) -> str:
        t0 = clock()
        try:
            return original(template, **context)
        finally:
            spent[0] += clock() - t0

    patched = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("qir.codegen") and getattr(m, "render", None) is original
    ]
    for m in patched:
        m.render = timed  # type: ignore[attr-defined]
    try:
        yield spent
    finally:
        for m in patched:
            m.render = original  # type: ignore[attr-defined]


def clear_kernel_memo() -> None:
    """Empty whatever lowering memoizes (functools caches), as in a fresh process."""
    for value in vars(lowering).values():
        clear: Callable[[], None] | None = getattr(value, "cache_clear", None)
        if clear is not None:
            clear()


@dataclass
class Row:
    format: str
    layers: int
    nodes: int
    launches: int
    passes: float
    lower: float
    render: float

    @property
    def total(self) -> float:
        return self.passes + self.lower + self.render


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure(name: str, layers: int, repeat: int, d: Dims, clock: str = "wall") -> Row:
    now = CLOCKS[clock]
    fmt, rule = FORMATS[name]
    graph = build_layers(layers, fmt, rule, d)
    passes, lowers, renders = [], [], []
    launches = 0
    for _ in range(repeat):
        t0 = now()
        passed, _ = run_pipeline(graph, "default")
        passes.append(now() - t0)
        clear_kernel_memo()
        with render_timer(now) as spent:
            t0 = now()
            plan = lowering.lower(passed)
            elapsed = now() - t0
        renders.append(spent[0])
        lowers.append(elapsed - spent[0])
        launches = len(plan.launches)
    med = statistics.median
    return Row(name, layers, len(graph), launches, med(passes), med(lowers), med(renders))


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 80, 160])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument(
        "--scale", type=int, default=1, help="divide the Llama-3-8B widths by this (smoke tests)"
    )
    ap.add_argument("--clock", choices=CLOCKS, default="wall", help="wall time or CPU time")
    args = ap.parse_args(argv)
    d = Dims(*(getattr(LLAMA3_8B, f) // args.scale for f in ("hidden", "q", "kv", "intermediate")))
    print(f"Llama-3-8B layer shapes {d}; median of {args.repeat}; {args.clock} ms")
    print(
        f"{'format':6} {'layers':>6} {'nodes':>6} {'launches':>8} {'passes':>9} {'lower':>9} "
        f"{'render':>9} {'total':>9} {'ms/layer':>9}"
    )
    # Jinja parses each template on first use: not a cost of the model's size.
    measure(args.formats[0], 1, 1, d, args.clock)
    rows = []
    for name in args.formats:
        for layers in args.layers:
            r = measure(name, layers, args.repeat, d, args.clock)
            rows.append(r)
            print(f"{r.format:6} {r.layers:>6} {r.nodes:>6} {r.launches:>8} "
                  f"{r.passes * 1e3:>9.1f} {r.lower * 1e3:>9.1f} {r.render * 1e3:>9.1f} "
                  f"{r.total * 1e3:>9.1f} {r.total * 1e3 / r.layers:>9.2f}", flush=True)  # fmt: skip
    lo, hi = min(args.layers), (80 if 80 in args.layers else max(args.layers))
    if lo != hi:
        print(f"\ntime at {hi} layers / time at {lo} ({hi // lo} if linear)")
        for name in args.formats:
            by = {r.layers: r for r in rows if r.format == name}
            ratios = "  ".join(
                f"{step} {getattr(by[hi], step) / max(getattr(by[lo], step), 1e-9):5.1f}"
                for step in ("passes", "lower", "render", "total")
            )
            print(f"{name:6} {ratios}")
    return rows


if __name__ == "__main__":
    main()
