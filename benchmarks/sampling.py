"""The sample op on the device against what it replaces: copying a decode step's logits to the
host and drawing there (numpy, qir.sampling's reference), side by side in one run, medians.

    python benchmarks/sampling.py [--backend host|cuda] [--vocab 32000 151936] [--repeat 9]

Per vocabulary and setting (greedy; temperature; top-k 50 + top-p 0.9 + min-p 0.05): the
sample kernel's time for one row (a captured launch, synchronized), the host path's time (the
copy of the logits and the numpy draw), and their ratio. On the host backend both run on the
CPU, so only the GPU's numbers say what a decode step saves."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from qir.api import compile
from qir.builder import Builder
from qir.dtypes import BF16, F32, I32
from qir.runtime.backend import best_backend
from qir.sampling import Sampling, sample

SETTINGS = {
    "greedy": Sampling(),
    "temperature": Sampling(temperature=0.8),
    "top-k/p, min-p": Sampling(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
}


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def host_draw(device: object, inputs: dict[str, np.ndarray]) -> None:
    """What a step without the kernel does: the logits to the host, then the draw there."""
    raw = device.get() if hasattr(device, "get") else np.asarray(device)
    sample(raw.view(BF16.np), inputs["params"], inputs["seed"], inputs["pos"])


def main(argv: list[str] | None = None) -> list[tuple[int, str, float, float]]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default=None, help="host or cuda (default: best available)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)
    backend = args.backend or best_backend()
    rng = np.random.default_rng(0)
    print(f"backend {backend}; one row; median of {args.repeat}; ratio = host path / kernel")
    print(f"{'vocab':>7} {'setting':15} {'kernel ms':>10} {'host path ms':>12} {'ratio':>6}")
    rows = []
    for vocab in args.vocab:
        b = Builder("sample")
        logits = b.input("logits", ("M", vocab), BF16)
        params = b.input("params", ("M", 4), F32)
        seed, pos = b.input("seed", ("M", 2), I32), b.input("pos", ("M",), I32)
        b.output("next", b.sample(logits, params, seed, pos))
        compiled = compile(b.graph, {}, backend=backend)
        step = compiled.capture(1)
        z = (rng.standard_normal((1, vocab)) * 3).astype(BF16.np)
        sync = compiled._exec.backend.synchronize if compiled._exec else lambda: None
        for name, s in SETTINGS.items():
            inputs = {
                "logits": z,
                "params": s.row()[None],
                "seed": np.array([[7, 0]], np.int32),
                "pos": np.array([3], np.int32),
            }
            step(inputs)  # the logits are on the device, as a decode step leaves them
            device = step.inputs["logits"]

            k = median_ms(lambda step=step, sync=sync: (step(), sync()), args.repeat)
            h = median_ms(lambda d=device, x=inputs: host_draw(d, x), args.repeat)
            rows.append((vocab, name, k, h))
            print(f"{vocab:>7} {name:15} {k:>10.3f} {h:>12.3f} {h / k:>6.2f}")
    return rows


if __name__ == "__main__":
    main()
