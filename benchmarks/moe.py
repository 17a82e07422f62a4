"""A mixture-of-experts layer at Qwen3-30B-A3B's and gpt-oss-20b's shapes: what reading only the
chosen experts saves at decode, and what grouping tokens by expert saves at prefill.

    python benchmarks/moe.py [--backend host|cuda] [--models qwen3-30b-a3b gpt-oss-20b]
        [--experts 16] [--scale 0.25] [--prefill 64] [--repeat 5]

The layer: y = x + moe(x), an f16 router choosing k experts per token under the model's rule,
gate/up (silu(g) * u) and down with the router's weights, experts stacked [E, out, in] in the
model's quantized format (Qwen3-30B-A3B: AWQ 4-bit, group 128, as its AWQ checkpoints ship;
gpt-oss-20b: MXFP4, as its authors ship it). Weights are a quantized tile repeated (values do not
change these kernels' speed).

Decode (one token): the bytes of weights the step reads, ours (the router and the k chosen
experts) against reading every expert (the router and all E), and their ratio; the time of our
step (router, top-k, the two expert GEMVs: one captured replay) against a dense MLP over every
expert's rows (gate/up of E x inter rows, down over E x inter inputs: the same bytes as reading
every expert), medians, side by side in one run.

Prefill (--prefill tokens): our step (tokens grouped by expert on the device, a grouped GEMM per
expert qlinear, the combine) against one GEMM per expert (a dense MLP of one expert's shapes run
on the rows that chose it, for every expert chosen, summed; qir's GEMM family forced), medians.

On the host backend both sides run on the CPU: the ratios of time say how the work scales, not
what a GPU gains. --experts and --scale shrink the layer for a slow host; the output says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path

from llama_shapes import tiled_weight

from qir.api import Compiled, compile
from qir.builder import Builder
from qir.dtypes import F16
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.dense import Dense
from qir.formats.mx import Mxfp4
from qir.graph import Graph
from qir.runtime.backend import best_backend
from qir.types import QExperts, QWeight

Weights = dict[str, dict[str, np.ndarray]]


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    k: int
    rule: str
    fmt: WeightFormat


MODELS = {
    "qwen3-30b-a3b": Shape(2048, 768, 128, 8, "softmax_topk_norm", Awq(4, 128)),
    "gpt-oss-20b": Shape(2880, 2880, 32, 4, "topk_softmax", Mxfp4()),
}


@dataclass
class Row:
    model: str
    shape: Shape
    bytes_ours: int
    bytes_all: int
    decode_ms: float
    decode_all_ms: float
    prefill_ms: float
    prefill_per_expert_ms: float
    decode_kernels: tuple[str, ...]  # what our step launches at each
    prefill_kernels: tuple[str, ...]

    @property
    def bytes_ratio(self) -> float:
        return self.bytes_all / self.bytes_ours

    @property
    def decode_ratio(self) -> float:
        return self.decode_all_ms / self.decode_ms

    @property
    def prefill_ratio(self) -> float:
        return self.prefill_per_expert_ms / self.prefill_ms


def weight_bytes(w: QWeight) -> int:
    total = 0
    for t in w.buffers().values():
        n = t.dtype.itemsize
        for d in t.shape:
            assert isinstance(d, int)
            n *= d
        total += n
    return total


def scaled(s: Shape, scale: float, experts: int | None) -> Shape:
    """Widths times `scale` (below 1: multiples of 128, which every group and tile size
    divides; gpt-oss's 2880 is not one), at most `experts` experts (k kept below that)."""
    e = min(s.experts, experts) if experts else s.experts
    w = lambda v: v if scale == 1 else max(128, round(v * scale / 128) * 128)  # noqa: E731
    return Shape(w(s.hidden), w(s.inter), e, min(s.k, e), s.rule, s.fmt)


def _router(b: Builder, rng: np.random.Generator, s: Shape, weights: Weights) -> Any:
    x = b.input("x", ("M", s.hidden), F16)
    w = rng.standard_normal((s.experts, s.hidden), dtype=np.float32) / s.hidden**0.5
    weights["router"] = Dense(F16).quantize(w)
    router = b.weight("router", QWeight(Dense(F16), s.experts, s.hidden), name="w_router")
    return x, b.qlinear(x, router, name="logits")


def moe_layer(s: Shape, seed: int = 0) -> tuple[Graph, Weights]:
    """Ours: router, top-k, gate/up and down + combine over the chosen experts."""
    rng = np.random.default_rng(seed)
    b = Builder("moe")
    weights: Weights = {}
    x, logits = _router(b, rng, s, weights)
    ids, rw = b.route(logits, s.k, s.rule, name="route")
    ws = {}
    for name, (o, i) in {
        "gate": (s.inter, s.hidden),
        "up": (s.inter, s.hidden),
        "down": (s.hidden, s.inter),
    }.items():
        qw, one = tiled_weight(rng, s.fmt, o, i)
        weights[name] = {
            n: np.ascontiguousarray(np.broadcast_to(v, (s.experts, *v.shape)))
            for n, v in one.items()
        }
        ws[name] = b.weight(name, QExperts(qw, s.experts), name=f"w_{name}")
    h = b.expert_qlinear(x, (ws["gate"], ws["up"]), ids, name="h")
    b.output("y", b.expert_qlinear(h, ws["down"], ids, rw, x, name="y"))
    b.output("ids", ids)
    return b.graph, weights


def dense_mlp(s: Shape, inter: int, seed: int = 0) -> tuple[Graph, Weights]:
    """y = x + down(silu(gate(x)) * up(x)) with `inter` rows: every expert's rows at once
    (inter = E x s.inter), or one expert's (inter = s.inter)."""
    rng = np.random.default_rng(seed)
    b = Builder("mlp")
    weights: Weights = {}
    x = b.input("x", ("M", s.hidden), F16)
    outs = {}
    for name in ("gate", "up"):
        qw, weights[name] = tiled_weight(rng, s.fmt, inter, s.hidden)
        outs[name] = b.qlinear(x, b.weight(name, qw, name=f"w_{name}"), name=name)
    qw, weights["down"] = tiled_weight(rng, s.fmt, s.hidden, inter)
    h = b.mul(b.silu(outs["gate"]), outs["up"])
    b.output("y", b.add(x, b.qlinear(h, b.weight("down", qw, name="w_down"), name="down")))
    return b.graph, weights


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _sync(c: Compiled) -> Callable[[], None]:
    return c._exec.backend.synchronize if c._exec else lambda: None


def replay_ms(c: Compiled, x: np.ndarray, repeat: int) -> float:
    """Median of a captured step's replays at x's rows (inputs already on the device)."""
    step, sync = c.capture(x.shape[0]), _sync(c)
    step({"x": x})
    return median_ms(lambda: (step(), sync()), repeat)


def measure(name: str, s: Shape, backend: str, prefill: int, repeat: int) -> Row:
    rng = np.random.default_rng(1)
    g, w = moe_layer(s)
    ours = compile(g, w, backend=backend)
    # Bytes of weights a decode step reads: the router's and the chosen experts' (k of E).
    router = weight_bytes(QWeight(Dense(F16), s.experts, s.hidden))
    expert = sum(
        weight_bytes(QWeight(s.fmt, o, i))
        for o, i in ((s.inter, s.hidden), (s.inter, s.hidden), (s.hidden, s.inter))
    )
    x1 = rng.standard_normal((1, s.hidden), dtype=np.float32).astype(np.float16)
    decode = replay_ms(ours, x1, repeat)
    every = compile(*dense_mlp(s, s.experts * s.inter), backend=backend)
    decode_all = replay_ms(every, x1, repeat)
    del every

    xp = rng.standard_normal((prefill, s.hidden), dtype=np.float32).astype(np.float16)
    grouped = replay_ms(ours, xp, repeat)
    ids = np.asarray(ours({"x": xp})["ids"]).reshape(prefill, s.k)
    one = compile(*dense_mlp(s, s.inter), backend=backend, gemm_from_m=1)
    steps = []
    for e in np.unique(ids):
        rows = np.nonzero((ids == e).any(axis=1))[0]
        step = one.capture(len(rows))
        step({"x": xp[rows]})
        steps.append(step)
    sync = _sync(one)
    per_expert = median_ms(lambda: ([st() for st in steps], sync()), repeat)
    assert ours.plan is not None
    kernels = [
        tuple(la.kernel.name for la in ours.plan.launches if la.runs_for(m)) for m in (1, prefill)
    ]
    return Row(
        name,
        s,
        router + s.k * expert,
        router + s.experts * expert,
        decode,
        decode_all,
        grouped,
        per_expert,
        *kernels,
    )


def main(argv: Sequence[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", default=None, help="host or cuda (default: best available)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--experts", type=int, default=None, help="at most this many experts")
    ap.add_argument("--scale", type=float, default=1.0, help="widths times this (host: < 1)")
    ap.add_argument("--prefill", type=int, default=64, help="tokens of the prefill step")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if args.experts is not None and args.experts < 1:
        ap.error(f"--experts must be at least 1, got {args.experts}")
    if not 0 < args.scale <= 1:
        ap.error(f"--scale must be in (0, 1], got {args.scale}")
    backend = args.backend or best_backend()
    print(
        f"backend {backend}; medians of {args.repeat}; decode: one token, prefill: {args.prefill}"
    )
    print(
        f"{'model':14} {'format':9} {'E':>4} {'k':>2} {'MB/token ours':>13} {'all':>9} "
        f"{'ratio':>6} {'decode ms':>9} {'all ms':>9} {'ratio':>6} "
        f"{'prefill ms':>10} {'per expert':>10} {'ratio':>6}"
    )
    rows = []
    for name in args.models:
        full = MODELS[name]
        s = scaled(full, args.scale, args.experts)
        if s != full:
            print(
                f"{name}: reduced from hidden {full.hidden}, inter {full.inter}, "
                f"{full.experts} experts top {full.k} to hidden {s.hidden}, inter {s.inter}, "
                f"{s.experts} experts top {s.k} (--scale {args.scale}, --experts {args.experts})"
            )
        r = measure(name, s, backend, args.prefill, args.repeat)
        rows.append(r)
        print(
            f"{r.model:14} {r.shape.fmt.tag():9} {r.shape.experts:>4} {r.shape.k:>2} "
            f"{r.bytes_ours / 1e6:>13.2f} {r.bytes_all / 1e6:>9.2f} {r.bytes_ratio:>6.2f} "
            f"{r.decode_ms:>9.3f} {r.decode_all_ms:>9.3f} {r.decode_ratio:>6.2f} "
            f"{r.prefill_ms:>10.3f} {r.prefill_per_expert_ms:>10.3f} {r.prefill_ratio:>6.2f}"
        )
    print(
        "ratios: all experts / ours (bytes, decode time); one GEMM per expert / grouped (prefill)"
    )
    for r in rows:
        for when, names in (("decode", r.decode_kernels), ("prefill", r.prefill_kernels)):
            print(f"{r.model} {when}: {' '.join(names)}")
    return rows


if __name__ == "__main__":
    main()
