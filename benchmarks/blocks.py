"""Time each block of the embedded checkpoints on a kernel backend against the numpy reference,
side by side in one run (median of several runs), and print the bytes each block moves.

    python benchmarks/blocks.py [--backend host|cuda] [--repeat 7] [--m 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import qir
from qir.models import load
from qir.models.blocks import BLOCKS, build
from qir.models.goldens import embedded_checkpoints
from qir.runtime.backend import best_backend
from qir.types import QWeight


def median_seconds(
    fn: Callable[[dict[str, np.ndarray]], object], x: dict[str, np.ndarray], repeat: int
) -> float:
    fn(x)  # warm: compile, upload, first-touch
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def weight_bytes(graph: qir.Graph) -> int:
    total = 0
    for w in graph.weights:
        t = graph.node(w).type
        assert isinstance(t, QWeight)
        total += int(t.format.bytes_per_weight() * t.out_features * t.in_features)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default=None, help="host or cuda (default: best available)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    backend = args.backend or best_backend()
    rng = np.random.default_rng(0)
    print(f"backend {backend}; median of {args.repeat} runs; ratio = reference / {backend}")
    print(f"{'checkpoint':20} {'block':5} {'M':>3} {'kernels':>7} {'weight KiB':>10} "
          f"{'reference ms':>12} {backend + ' ms':>10} {'ratio':>6}")  # fmt: skip
    for path in embedded_checkpoints():
        ck = load(path)
        for name in BLOCKS:
            b = build(ck, name, 0)
            fast = qir.compile(b.graph, b.weights, backend=backend)
            ref = qir.compile(b.graph, b.weights, backend="reference")
            for m in args.m:
                x = {"x": rng.standard_normal((m, ck.hidden_size)).astype(ck.act_dtype.np)}
                t_ref = median_seconds(ref, x, args.repeat)
                t_fast = median_seconds(fast, x, args.repeat)
                print(f"{path.name:20} {name:5} {m:>3} {fast.kernel_count:>7} "
                      f"{weight_bytes(b.graph) / 1024:>10.1f} {t_ref * 1e3:>12.3f} "
                      f"{t_fast * 1e3:>10.3f} {t_ref / t_fast:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
