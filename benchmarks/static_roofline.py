"""The static cost of decode at Llama-3-8B shapes, no GPU needed: every format's kernels compiled
with NVRTC for one arch and read off their SASS (qir.cost.resources), with the share of the
GPU's memory bandwidth that cost allows at most.

    python benchmarks/static_roofline.py [--arch sm_90|sm_100a|sm_80|sm_120a] [--m 1 8]
        [--formats awq4g128 ...] [--blocks qkv o mlp moe]

Shapes: q/k/v 4096 -> 4096 + 1024 + 1024 (one merged launch), o 4096 -> 4096, the MLP's
gate/up 4096 -> 2 x 14336 (one launch, silu(g) * u as its epilogue) and down 14336 -> 4096 with
the residual add, all f16 activations, through the default passes. Weights are types only: the
kernels do not depend on their values.

--blocks moe: a routed MLP behind its RMSNorm (the router and the gate/up pair normalising
their input, down + combine) of stacked experts at Qwen3-30B-A3B's expert shapes (gpt-oss-20b's
for MXFP4); an expert GEMV's cost at M = 1 is per 512 B of one chosen expert's rows, the bytes a
decode step reads.

Per kernel: registers, spill bytes, resident blocks per SM, warp instructions per 512 B of
weights at M, bytes of weights in flight per SM, and per GPU of the arch the bound that implies:
"issue-bound at N%" (instruction budget / cost) or "latency-bound at N%" (bytes in flight /
Little's law), whichever is lower. At an M the GEMMs serve (--m 1024), a GEMM's row gives its
main loop's warp instructions per MMA and whether the GPU's tensor cores or the issue bound it.
Needs qir[compile] and, for the SASS columns, qir[sass].
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from qir.builder import Builder
from qir.codegen.lower import lower
from qir.codegen.plan import Plan
from qir.cost import sass
from qir.cost.gpus import gpus_for
from qir.cost.resources import KernelCost, kernel_costs
from qir.dtypes import BF16, F16
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.ct_int import CtInt
from qir.formats.dense import Dense
from qir.formats.fp8 import Fp8
from qir.formats.fp8_block import Fp8Block
from qir.formats.ggml import Ggml
from qir.formats.ggml_blocks import SPECS
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4, Mxfp8
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.passes.manager import run_pipeline
from qir.target import Target
from qir.types import QExperts, QWeight, TensorType

LLAMA3_8B = {"hidden": 4096, "inter": 14336, "q": 4096, "kv": 1024}
# One of each format and variant decode kernels specialise on (after tests/conftest.py's zoo),
# at the group sizes checkpoints use; dense f16 for reference.
FORMATS: tuple[WeightFormat, ...] = (
    MlxAffine(2, 64, BF16),
    MlxAffine(3, 64, BF16),
    MlxAffine(4, 64, BF16),
    MlxAffine(8, 64, BF16),
    Awq(4, 128),
    Gptq(4, 128, "gptq", 0, F16),
    Gptq(3, 128, "gptq", 1, F16),
    CtInt(4, 128, BF16),
    CtInt(8, 128, BF16),
    Fp8("channel"),
    Fp8("tensor"),
    Fp8Block(),
    Mxfp4(),
    Mxfp8(),
    Nvfp4("mul", 16),
    Nvfp4("div", 4),
    Dense(F16),
    # GGUF's tensor types (qir.formats.ggml); TQ1_0 runs TQ2_0's planes
    *(Ggml(t) for t in SPECS),
)
BLOCKS = ("qkv", "o", "mlp", "moe")
# The "moe" block: a routed MLP (router, gate/up pair, down + combine + residual) at
# Qwen3-30B-A3B's expert shapes, and at gpt-oss-20b's for MXFP4 (the format its authors ship).
QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "k": 8}
GPT_OSS_20B = {"hidden": 2880, "inter": 2880, "experts": 32, "k": 4}


def moe_shapes(fmt: WeightFormat) -> dict[str, int]:
    return GPT_OSS_20B if isinstance(fmt, Mxfp4) else QWEN3_30B_A3B


@dataclass
class Row:
    format: str
    m: int
    block: str
    cost: KernelCost


def graph(block: str, fmt: WeightFormat, d: dict[str, int]) -> Graph:
    b = Builder(block)
    x = b.input("x", ("M", d["hidden"]), F16)

    def linear(src: object, name: str, out_f: int, in_f: int) -> object:
        w = b.weight(name, QWeight(fmt, out_f, in_f), name=f"w_{name}")
        return b.qlinear(src, w, name=name)  # type: ignore[arg-type]

    if block == "moe":
        return moe_graph(fmt, moe_shapes(fmt))
    if block == "qkv":
        for name, n in {"q": d["q"], "k": d["kv"], "v": d["kv"]}.items():
            b.output(name, linear(x, name, n, d["hidden"]))  # type: ignore[arg-type]
    elif block == "o":
        b.output("y", linear(x, "o", d["hidden"], d["q"]))  # type: ignore[arg-type]
    else:
        g, u = (linear(x, n, d["inter"], d["hidden"]) for n in ("gate", "up"))
        h = b.mul(b.silu(g), u)  # type: ignore[arg-type]
        b.output("y", b.add(x, linear(h, "down", d["hidden"], d["inter"])))  # type: ignore[arg-type]
    return b.graph


def moe_graph(fmt: WeightFormat, d: dict[str, int]) -> Graph:
    """y = x + moe(rms_norm(x)): an f16 router choosing k of the experts, gate/up (silu(g) * u),
    down with the router's weights and the residual; experts stacked [E, out, in] in `fmt`. The
    default passes put the norm in the router's and the gate/up's prologues."""
    b = Builder("moe")
    x = b.input("x", ("M", d["hidden"]), F16)
    xn = b.rms_norm(x, b.param("norm", TensorType((d["hidden"],), BF16), name="w_norm"), 1e-6)
    router = b.weight("router", QWeight(Dense(F16), d["experts"], d["hidden"]), name="w_router")
    ids, rw = b.route(
        b.qlinear(xn, router, name="logits"), d["k"], "softmax_topk_norm", name="route"
    )
    shapes = {
        "gate": (d["inter"], d["hidden"]),
        "up": (d["inter"], d["hidden"]),
        "down": (d["hidden"], d["inter"]),
    }
    ws = {
        n: b.weight(n, QExperts(QWeight(fmt, o, i), d["experts"]), name=f"w_{n}")
        for n, (o, i) in shapes.items()
    }
    h = b.expert_qlinear(xn, (ws["gate"], ws["up"]), ids, name="h")
    b.output("y", b.expert_qlinear(h, ws["down"], ids, rw, x, name="y"))
    return b.graph


def plan_for(block: str, fmt: WeightFormat, arch: str = "sm_90") -> Plan:
    passed, _ = run_pipeline(graph(block, fmt, LLAMA3_8B), "default")
    return lower(passed, target=Target(arch))


def main(argv: Sequence[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--formats", nargs="+", help="format tags (default: all)")
    ap.add_argument("--blocks", nargs="+", choices=BLOCKS, default=list(BLOCKS))
    args = ap.parse_args(argv)
    tags = {f.tag(): f for f in FORMATS}
    if args.formats and (unknown := set(args.formats) - tags.keys()):
        ap.error(f"unknown formats {sorted(unknown)}; known: {', '.join(tags)}")
    formats = [tags[t] for t in args.formats] if args.formats else list(FORMATS)
    gpus = gpus_for(args.arch)
    rows = []
    for fmt in formats:
        for block in args.blocks:
            plan = plan_for(block, fmt, args.arch)
            for m in args.m:
                for cost in kernel_costs(plan, args.arch, m, gpus[0]):
                    rows.append(Row(fmt.tag(), m, block, cost))
    print(table(rows, args.arch))
    return rows


def table(rows: Sequence[Row], arch: str) -> str:
    gpus = gpus_for(arch)
    header = (
        "format",
        "M",
        "block",
        "kernel",
        "regs",
        "spill",
        "blk/SM",
        "instr/512B|MMA",
        "inflight/SM",
        *(f"bound {g.name}" for g in gpus),
    )
    lines = [header]
    for r in rows:
        c = r.cost
        if not c.streams_weights:
            continue
        at_least = ">=" if c.at_least else ""
        if c.name.startswith("qgemm_"):  # a GEMM's main loop, per MMA instruction
            instr = "?" if c.instr_per_mma is None else f"{at_least}{c.instr_per_mma:.1f}/MMA"
            flight = "-"
        else:
            instr = "?" if c.instr_per_512 is None else f"{at_least}{c.instr_per_512:.0f}"
            flight = "?" if c.in_flight_per_sm is None else f"{c.in_flight_per_sm / 1024:.1f} KB"
        bounds = []
        for g in gpus:
            # The same kernel on another GPU of the arch: only the budget and Little's law move.
            same = replace(c, gpu=g)
            bounds.append(same.bound)
        lines.append(
            (
                r.format,
                str(r.m),
                r.block,
                c.name,
                str(c.ptxas.registers),
                str(c.ptxas.spill_stores + c.ptxas.spill_loads),
                str(c.blocks_per_sm),
                instr,
                flight,
                *bounds,
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in lines
    ]
    for g in gpus:
        out.append(
            f"{g.name}: budget {g.instructions_per_bytes(512):.0f} warp instructions per 512 B, "
            f"Little's law {g.bytes_in_flight_per_sm() / 1024:.1f} KB per SM"
        )
    if not sass.available():
        out.append("instr/512B, inflight/SM, bound: no nvdisasm (pip install 'qir[sass]')")
    notes = sorted({f"{r.cost.name}: {n}" for r in rows for n in r.cost.notes})
    out += [f"note {n}" for n in notes]
    return "\n".join(out)


if __name__ == "__main__":
    main(sys.argv[1:])
