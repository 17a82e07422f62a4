"""Fused vs unfused, side by side in one run: launches, bytes moved and time per block, for every
checkpoint in tests/data (or the embedded ones when run from an installed package).

    python benchmarks/fusion.py [--backend host|cuda] [--repeat 5] [--m 1 8] [--only NAME...]

Time is the median of --repeat runs after a warm-up; the ratio is unfused / fused, so > 1 means
fusion is faster. Bytes are DRAM traffic per block as the plan counts it (each buffer once).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from blocks import median_seconds  # benchmarks run as scripts: this folder is on sys.path

import qir
from qir.models import load
from qir.models.blocks import BLOCKS, build
from qir.models.goldens import embedded_checkpoints
from qir.runtime.backend import best_backend

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def checkpoints(only: list[str]) -> list[Path]:
    found = (
        sorted(p for p in DATA.iterdir() if (p / "config.json").is_file()) if DATA.is_dir() else []
    )
    found = found or embedded_checkpoints()
    return [p for p in found if not only or p.name in only]


def block_bytes(c: qir.Compiled, m: int) -> int:
    assert c.plan is not None
    return sum(c.plan.bytes_moved(la, m) for la in c.plan.launches if la.runs_for(m))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backend", default=None, help="host or cuda (default: best available)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--only", nargs="*", default=[], help="checkpoint folder names")
    args = ap.parse_args()
    backend = args.backend or best_backend()
    rng = np.random.default_rng(0)
    print(f"backend {backend}; median of {args.repeat}; ratio = unfused / fused")
    head = f"{'checkpoint':20} {'block':5} {'M':>3} {'launches':>9} {'KiB moved':>15} {'ms':>17} {'ratio':>6}"
    print(head)
    for path in checkpoints(args.only):
        ck = load(path)
        for name in BLOCKS:
            b = build(ck, name, 0)
            fused = qir.compile(b.graph, b.weights, backend=backend)
            unfused = qir.compile(b.graph, b.weights, backend=backend, passes="none")
            for m in args.m:
                x = {"x": rng.standard_normal((m, ck.hidden_size)).astype(ck.act_dtype.np)}
                assert fused.plan is not None and unfused.plan is not None
                n_f, n_u = fused.launches_for(m), unfused.launches_for(m)
                kib_f, kib_u = block_bytes(fused, m) / 1024, block_bytes(unfused, m) / 1024
                t_f, t_u = (1e3 * median_seconds(c, x, args.repeat) for c in (fused, unfused))
                print(
                    f"{path.name:20} {name:5} {m:>3} {n_u:>4}->{n_f:<4} "
                    f"{kib_u:>7.1f}->{kib_f:<7.1f} {t_u:>8.2f}->{t_f:<8.2f} {t_u / t_f:>6.2f}"
                )


if __name__ == "__main__":
    main()
