"""The static cost table: what each kernel of a plan costs on an arch, from its compiled code
alone (no GPU), and the bandwidth that cost allows at most.

Per kernel: ptxas' registers, spills, stack and shared memory (NVRTC's ptxas -v, the figures
nvcc -Xptxas -v prints); occupancy (resident blocks per SM from registers, shared memory and
threads, with the GPU's allocation units); and, for kernels that stream weights, a model of the
loop that streams them, read off the SASS (nvdisasm, the `sass` extra; qir.cost.sass):

1. Which loads read weights: the kernel's parameters are labelled (weight buffers from the
   launch's arguments, and M), and a dataflow pass over the SASS tells which global loads take
   their address from which buffer, and which branches test M.
2. The weight loop: loops are back edges; the weight loop is the outermost loop containing
   loads of the weight buffers (the one with the most such loads, if several). If no loop
   holds them, the compiler unrolled the K loop entirely (each lane's few chunks), and the
   whole kernel is the region.
3. Chunks per pass: Python knows the format's chunk (weights a lane dequantizes at once, the
   bytes of packed codes that takes), the chunks of a row each lane handles and the DRAM bytes
   per weight with scales; the SASS tells how many bytes of codes one pass loads. Their ratio
   is the chunks per pass (the compiler's unroll, times two for a gate/up pair): it must be a
   whole number, and for an unrolled kernel every chunk of the lane's row; otherwise the cost
   is not given and the note says why.
4. Cost at M: every instruction of the weight loop once per pass, nested loops times their
   trip counts, and the code that branches on M (one row of the batch per branch; the table
   checks that a pass's branches cover whole multiples of the kernel's m_tile rows) in
   proportion to the rows that run in each block of rows; a warp makes (its row's chunks /
   chunks per pass) passes, and runs the rest of the kernel (set-up, shuffle reductions,
   stores) once, counted the same way. Warp instructions per 512 B of weights = that total /
   the DRAM bytes of the warp's rows x 512, summed over the blocks of rows (grid.y) that each
   read the same weights.
5. Bytes of weights in flight per SM: the most bytes of weight loads a warp has issued and not
   yet used in a pass (the loads it issues before it first needs one), times 32 lanes, times
   the warps resident per SM (occupancy, or fewer if the grid is small).

The bound: a GPU issues SMs x schedulers x clock warp instructions per second; in the time its
DRAM moves 512 B that is the budget per 512 B (qir.cost.gpus). Issue-bound at budget / cost;
latency-bound at bytes in flight / Little's law's bytes per SM (bandwidth x latency / SMs),
whichever is lower.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qir.codegen.collectives import CollectiveKernel
from qir.codegen.fragments import fragment_for
from qir.codegen.gemv import lanes_of, rows_per_warp
from qir.codegen.plan import Launch, Plan
from qir.cost import sass
from qir.cost.gpus import Gpu, gpus_for
from qir.dtypes import F16, F32
from qir.errors import UsageError
from qir.runtime.nvrtc import PtxasReport, compile_cubin
from qir.types import QExperts, QWeight, TensorType

WARP = 32
CODES = "weight"  # the buffer of packed codes, in every format


@dataclass(frozen=True)
class WeightStream:
    """What Python knows about the weights a GEMV launch streams."""

    buffers: frozenset[str]  # kernel parameters that are weight buffers
    codes: frozenset[str]  # of which the packed codes
    chunk_elems: int  # weights a lane dequantizes at once
    chunk_code_bytes: float  # bytes of codes in a chunk
    bytes_per_weight: float  # DRAM bytes per weight, scales included
    chunks_per_lane: int  # chunks of one row a lane handles (the most, over lanes)
    weights_per_warp: int  # weight rows one lane computes (its slots: of a gate/up pair both)
    row_bytes: int  # DRAM bytes of the rows one warp reads (all its groups of lanes)
    m_tile: int  # batch rows one block covers


@dataclass(frozen=True)
class KernelCost:
    name: str
    arch: str
    gpu: Gpu
    grid: tuple[int, int, int]
    threads: int
    ptxas: PtxasReport
    blocks_per_sm: int
    limiter: str  # what limits blocks_per_sm: registers, smem, threads or blocks
    streams_weights: bool
    region: str = ""  # "loop" (its address range) or "unrolled"
    chunks_per_pass: int | None = None
    instr_per_512: float | None = None
    mix_per_512: dict[str, float] = field(default_factory=dict)
    in_flight_per_sm: int | None = None  # bytes of weights
    at_least: bool = False  # a nested loop with an unknown trip count was counted once
    notes: tuple[str, ...] = ()
    # Tensor-core kernels (GEMMs): the main loop's warp instructions per MMA instruction, its
    # mix per MMA, and the multiply-adds one MMA does and of which kind (f16, e2m1).
    instr_per_mma: float | None = None
    mma_mix: dict[str, float] = field(default_factory=dict)
    mma_fma: int = 0
    mma_kind: str = ""

    @property
    def mma_budget(self) -> float | None:
        """Warp instructions the SM can issue per MMA while its tensor cores run at their peak
        (schedulers x the clocks one MMA takes), None without the GPU's tensor rate."""
        rate = (
            self.gpu.e2m1_fma_per_clock if self.mma_kind == "e2m1" else self.gpu.f16_fma_per_clock
        )
        return self.gpu.schedulers_per_sm * self.mma_fma / rate if rate and self.mma_fma else None

    @property
    def mma_bound(self) -> str:
        """ "tensor-bound" when the main loop issues within the budget, else "issue-bound at N%"
        of the tensor cores' peak."""
        budget, ipm = self.mma_budget, self.instr_per_mma
        if budget is None or ipm is None:
            return "?"
        if ipm <= budget:
            return "tensor-bound"
        return f"issue-bound at {100 * budget / ipm:.0f}% of tensor peak"

    @property
    def budget(self) -> float:
        return self.gpu.instructions_per_bytes(512)

    @property
    def issue_pct(self) -> float | None:
        return (
            None if not self.instr_per_512 else min(100.0, 100 * self.budget / self.instr_per_512)
        )

    @property
    def latency_pct(self) -> float | None:
        if self.in_flight_per_sm is None:
            return None
        return min(100.0, 100 * self.in_flight_per_sm / self.gpu.bytes_in_flight_per_sm())

    @property
    def bound(self) -> str:
        """ "issue-bound at N%" or "latency-bound at N%", whichever caps bandwidth lower; for a
        tensor-core kernel, its mma_bound (of the tensor cores' peak)."""
        if self.mma_fma:
            return self.mma_bound
        issue, latency = self.issue_pct, self.latency_pct
        if issue is None or latency is None:
            return "n/a" if not self.streams_weights else "?"
        if issue <= latency:
            return f"issue-bound at {'<=' if self.at_least else ''}{issue:.0f}%"
        return f"latency-bound at {latency:.0f}%"


def occupancy(gpu: Gpu, registers: int, smem: int, threads: int) -> tuple[int, str]:
    """Resident blocks per SM and what limits them, as the CUDA occupancy calculator counts."""
    warps = -(-threads // WARP)
    limits = {"blocks": gpu.blocks_per_sm, "threads": gpu.threads_per_sm // (warps * WARP)}
    if registers:
        per_warp = -(-registers * WARP // gpu.register_unit) * gpu.register_unit
        limits["registers"] = gpu.registers_per_sm // per_warp // warps
    per_block = -(-(smem + gpu.smem_reserved_per_block) // gpu.smem_unit) * gpu.smem_unit
    limits["smem"] = gpu.smem_per_sm // per_block
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter


def weight_stream(plan: Plan, launch: Launch) -> WeightStream | None:
    """The weight stream of a launch with weight arguments (None for quantize_act, elementwise)."""
    params = launch.kernel.params
    if len(params) != len(launch.args):
        return None
    buffers, codes, weights = set(), set(), []
    act = F16
    for p, a in zip(params, launch.args, strict=True):
        # The router's weights (an expert combine's rw) are float32 whatever the activations.
        if a.kind == "value" and p.name != "rw":
            t = plan.value_type(a.ref)
            if isinstance(t, TensorType) and t.dtype == F32:
                act = F32
        if a.kind != "weight":
            continue
        w = plan.graph.node(a.ref).type
        if isinstance(w, QExperts):
            w = w.expert  # an expert kernel streams one chosen expert's weight at a time
        if not isinstance(w, QWeight):
            continue  # a norm prologue's weight vector: read with the activations, not streamed
        buffers.add(p.name)
        if a.buffer == CODES:
            codes.add(p.name)
            weights.append(w)
    if not weights:
        return None
    w = weights[0]
    fmt = w.format
    frag = fragment_for(fmt, w.out_features, w.in_features)
    code = fmt.buffers(w.out_features, w.in_features)[CODES]
    code_bytes = (
        math.prod(code.concrete({})) * code.dtype.itemsize / (w.out_features * w.in_features)
    )
    # A group of lanes computes rows_per_warp rows of each of the weights it pairs (gate/up: 2),
    # a warp 32 / lanes such groups; an expert kernel's pair is crowded (ExpertGemvSpec.gemv).
    pairs = max(1, len(weights) // max(1, len(launch.outputs)))
    crowded = pairs > 1 and launch.kernel.name.startswith("moe_gemv_")
    per_lane = pairs * rows_per_warp(frag, pairs, act, crowded)
    chunks = frag.chunks_per_row(w.in_features)
    lanes = lanes_of(launch.kernel.name)
    return WeightStream(
        buffers=frozenset(buffers),
        codes=frozenset(codes),
        chunk_elems=frag.chunk_elems,
        chunk_code_bytes=frag.chunk_elems * code_bytes,
        bytes_per_weight=fmt.bytes_per_weight(),
        # Lanes take chunks in pairs (qir_chunks: lane l of its group reads 2l and 2l + 1, then
        # 2 * lanes on): the busiest lane's count, which sets the warp's passes.
        chunks_per_lane=2 * -(-chunks // (2 * lanes)),
        weights_per_warp=per_lane,
        row_bytes=round(per_lane * WARP // lanes * w.in_features * fmt.bytes_per_weight()),
        m_tile=launch.m_tile,
    )


def param_slots(launch: Launch, arch: str) -> dict[int, str]:
    """Constant-bank word -> kernel parameter name (M's is "M"), for the dataflow labels."""
    base, offset, slots = sass.param_base(arch), 0, {}
    for p, a in zip(launch.kernel.params, launch.args, strict=False):
        size = 8 if p.kind == "buffer" else 4
        offset = -(-offset // size) * size
        for word in range(0, size, 4):
            slots[base + offset + word] = "M" if a.kind == "M" else p.name
        offset += size
    return slots


def kernel_costs(
    what: Plan | Any, arch: str | None, m: int, gpu: Gpu | None = None
) -> list[KernelCost]:
    """The cost table of the launches that run at batch size `m`, compiled for the plan's
    target (through the NVRTC cache), on `gpu` (default: the target's reference GPU,
    qir.cost.gpus). `what` is a Plan or a qir.api.Compiled for a kernel backend; `arch`, if
    given, must be the plan's target (a plan's kernels are lowered for one)."""
    plan = what if isinstance(what, Plan) else getattr(what, "plan", None)
    if not isinstance(plan, Plan):
        raise TypeError("kernel_costs takes a Plan or a Compiled with a plan (host or cuda)")
    target = plan.target
    if arch is not None and arch != target.arch:
        raise UsageError(f"the plan is for {target.arch}, not {arch}: lower it for {arch}")
    ref = gpu or gpus_for(target.arch)[0]
    return [
        _cost(plan, launch, target.arch, m, ref)
        for launch in plan.launches
        if launch.runs_for(m) and not isinstance(launch.kernel, CollectiveKernel)  # no source
    ]


def _cost(plan: Plan, launch: Launch, arch: str, m: int, gpu: Gpu) -> KernelCost:
    result = compile_cubin(launch.kernel, arch)
    report = result.report
    threads = math.prod(launch.kernel.block)
    blocks, limiter = occupancy(gpu, report.registers, report.smem_bytes, threads)
    stream = weight_stream(plan, launch)
    base = KernelCost(
        launch.kernel.name,
        arch,
        gpu,
        launch.grid(m),
        threads,
        report,
        blocks,
        limiter,
        stream is not None,
    )
    if stream is None:
        return base
    if not sass.available():
        return _replace(base, notes=("SASS columns need nvdisasm: pip install 'qir[sass]'",))
    instrs = sass.disassemble(result.cubin, launch.kernel.name)
    if launch.kernel.name.startswith("qgemm_"):
        return _mma_cost(base, launch, instrs, m)
    return _stream_cost(base, launch, stream, instrs, m)


MMA_OPS = ("HMMA", "OMMA")
_MMA_SHAPE = re.compile(r"(16)(8)(8|16|32|64)")


def _mma_cost(base: KernelCost, launch: Launch, instrs: Sequence[sass.Instr], m: int) -> KernelCost:
    """A GEMM's main loop: the outermost loop holding its MMA instructions, every instruction
    once per pass (nested loops times their trip counts), per MMA instruction of the pass."""
    slots = param_slots(launch, base.arch)
    flow = sass.labels(instrs, slots)
    decided = sass.decide(instrs, flow, slots, m, 0)
    live = sass.reachable(instrs, decided)
    mmas = [i for i in live if instrs[i].op in MMA_OPS]
    if not mmas:
        return _replace(base, notes=("no MMA instruction in the SASS",))
    loops = sass.loops(instrs, live)
    holding = [lp for lp in loops if any(i in lp for i in mmas)]
    outer = [lp for lp in holding if not any(lp.inside(o) for o in holding)]
    if not outer:
        return _replace(base, notes=("no loop holds the MMA instructions",))
    span = max(outer, key=lambda lp: sum(i in lp for i in mmas))
    r = sass.region(instrs, span, flow, loops, "M", decided)
    mix = sass.cost(instrs, r, 1.0, live=live)
    count = sum(mix.get(op, 0.0) for op in MMA_OPS)
    shape = next(
        (s for i in mmas if i in span for p in instrs[i].parts if (s := _MMA_SHAPE.fullmatch(p))),
        None,
    )
    if shape is None:
        return _replace(base, notes=("the MMA's shape is not in its opcode",))
    kind = "e2m1" if any(instrs[i].op == "OMMA" for i in mmas) else "f16"
    return _replace(
        base,
        region=f"main loop {span.head * 16:#x}-{span.tail * 16:#x}",
        instr_per_mma=sum(mix.values()) / count,
        mma_mix={op: n / count for op, n in sorted(mix.items(), key=lambda kv: -kv[1])},
        mma_fma=math.prod(int(g) for g in shape.groups()),
        mma_kind=kind,
        at_least=bool(r.unknown_loops),
    )


def _replace(c: KernelCost, **changes: Any) -> KernelCost:
    from dataclasses import replace

    return replace(c, **changes)


def _stream_cost(
    base: KernelCost, launch: Launch, stream: WeightStream, instrs: Sequence[sass.Instr], m: int
) -> KernelCost:
    slots = param_slots(launch, base.arch)
    flow = sass.labels(instrs, slots)
    # Code this batch size never runs (another M's path) is neither the weight loop nor counted.
    decided = sass.decide(instrs, flow, slots, m, 0)
    live = sass.reachable(instrs, decided)
    loops = sass.loops(instrs, live)
    flow = sass.labels(instrs, slots, live)
    loads = [
        i
        for i, ins in enumerate(instrs)
        if ins.op in sass.GLOBAL_LOADS and flow.address[i] & stream.buffers and i in live
    ]
    if not loads:
        return _replace(base, notes=("no load of the weight buffers found in the SASS",))
    holding = [lp for lp in loops if any(i in lp for i in loads)]
    # A loop with a block barrier walks tiles of work (an expert kernel's loop over the pairs
    # that chose its expert, run once per tile), not the stream of one row's weights.
    holding = [
        lp for lp in holding if not any(instrs[i].op == "BAR" for i in range(lp.head, lp.tail + 1))
    ]
    outer = [lp for lp in holding if not any(lp.inside(o) for o in holding)]
    notes: list[str] = []
    if outer:
        span = max(outer, key=lambda lp: sum(i in lp for i in loads))
        where = f"loop {span.head * 16:#x}-{span.tail * 16:#x}"
    else:
        span = sass.Loop(0, len(instrs) - 1)
        where = "unrolled"
    whole = sass.region(instrs, sass.Loop(0, len(instrs) - 1), flow, loops, "M", decided)
    r = sass.region(instrs, span, flow, loops, "M", decided) if outer else whole
    code_bytes = sass.loaded_bytes(instrs, r, flow, set(stream.codes))
    chunks = code_bytes / stream.chunk_code_bytes
    expected = stream.chunks_per_lane * stream.weights_per_warp
    if chunks != int(chunks) or chunks < 1 or chunks > expected:
        notes.append(
            f"a pass loads {code_bytes} B of codes per lane: not a whole number of "
            f"{stream.chunk_code_bytes:g}-byte chunks up to {expected}"
        )
        return _replace(base, region=where, notes=tuple(notes))
    if not outer and chunks != expected:
        notes.append(f"unrolled kernel loads {chunks:.0f} chunks per lane, expected {expected}")
        return _replace(base, region=where, notes=tuple(notes))
    # A warp runs the weight loop once per `chunks` of its row's chunks, and the rest of the
    # kernel (index set-up, the shuffle reductions, the stores) once. A weight loop inside loops
    # of known trip counts (an expert combine's loop over a token's k slots at M = 1, each
    # another expert's rows) streams that many times the rows.
    passes = expected / chunks
    streams = whole.runs.get(span.head, 1) if outer else 1
    mix: dict[str, float] = {}
    for tile in range(launch.grid(m)[1]):
        share = min(stream.m_tile, m - tile * stream.m_tile) / stream.m_tile
        live_t = sass.reachable(instrs, sass.decide(instrs, flow, slots, m, tile))
        loop_mix = sass.cost(instrs, r, share, live=live_t) if outer else {}
        for mix_part, times in (
            (loop_mix, passes * streams),
            (sass.cost(instrs, whole, share, span if outer else None, live_t), 1.0),
        ):
            for op, n in mix_part.items():
                mix[op] = mix.get(op, 0.0) + n * times * 512 / (stream.row_bytes * streams)
    unknown = [
        lp for lp in (*whole.unknown_loops, *r.unknown_loops) if lp != span and lp.head in live
    ]
    if unknown:
        spans = ", ".join(sorted({f"{lp.head * 16:#x}-{lp.tail * 16:#x}" for lp in unknown}))
        notes.append(f"loops with an unknown trip count counted once: {spans}")
    if outer and r.rows_covered % stream.m_tile:
        notes.append(
            f"{r.rows_covered} branches on M per pass, not a multiple of the kernel's "
            f"{stream.m_tile} rows: the cost below {stream.m_tile} rows is approximate"
        )
    lanes_in_flight = sass.in_flight(
        instrs, span, flow, set(stream.buffers), passes=2 if outer else 1
    )
    grid_blocks = launch.grid(m)[0] * launch.grid(m)[1]
    resident = min(base.blocks_per_sm, -(-grid_blocks // base.gpu.sms))
    warps = resident * -(-base.threads // WARP)
    return _replace(
        base,
        region=where,
        chunks_per_pass=int(chunks),
        instr_per_512=sum(mix.values()),
        mix_per_512=dict(sorted(mix.items(), key=lambda kv: -kv[1])),
        in_flight_per_sm=lanes_in_flight * WARP * warps,
        at_least=bool(unknown),
        notes=tuple(notes),
    )


COLUMNS = (
    "kernel",
    "regs",
    "spill st/ld",
    "stack",
    "smem",
    "blocks/SM",
    "instr/512B|MMA",
    "in flight/SM",
    "bound",
)


def format_table(costs: Sequence[KernelCost], mix_top: int = 6) -> str:
    """The cost table as text: one line per kernel, then its region, its instruction mix per
    512 B of weights and any notes; the GPU's budget last."""
    if not costs:
        return "no launch runs at this M\n"
    rows = [COLUMNS]
    for c in costs:
        r = c.ptxas
        gemm = c.name.startswith("qgemm_")  # its loop reuses a weight tile: costed per MMA
        rows.append(
            (
                c.name,
                str(r.registers),
                f"{r.spill_stores}/{r.spill_loads}",
                str(r.stack_bytes),
                str(r.smem_bytes),
                f"{c.blocks_per_sm} ({c.limiter})",
                _num(c, c.instr_per_mma, ">={:.1f}/MMA" if c.at_least else "{:.1f}/MMA")
                if gemm
                else _num(c, c.instr_per_512, ">={:.0f}" if c.at_least else "{:.0f}"),
                "-"
                if gemm
                else _num(
                    c,
                    None if c.in_flight_per_sm is None else c.in_flight_per_sm / 1024,
                    "{:.1f} KB",
                ),
                c.bound,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(rows):
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
        c = costs[n - 1]
        if n == 0 or not c.streams_weights:
            continue
        detail = []
        if c.region:
            per = f", {c.chunks_per_pass} chunk(s) per lane per pass" if c.chunks_per_pass else ""
            detail.append(f"{c.region}{per}")
        if c.mix_per_512:
            top = list(c.mix_per_512.items())[:mix_top]
            detail.append("per 512 B: " + " ".join(f"{op} {n:.0f}" for op, n in top))
        if c.mma_mix:
            top = list(c.mma_mix.items())[:mix_top]
            detail.append("per MMA: " + " ".join(f"{op} {n:.1f}" for op, n in top))
            if c.mma_budget is not None:
                detail.append(
                    f"{c.gpu.name}'s tensor cores take {c.mma_budget:g} warp instructions per "
                    f"m16n8k{c.mma_fma // 128} MMA at their peak"
                )
        if detail:
            lines.append("    " + "; ".join(detail))
        lines += [f"    note: {n}" for n in c.notes]
    g = costs[0].gpu
    lines.append(
        f"{g.name} ({costs[0].arch}): budget {g.instructions_per_bytes(512):.0f} warp instructions "
        f"per 512 B ({g.sms} SMs x {g.schedulers_per_sm} x {g.clock_hz / 1e9:.2f} GHz against "
        f"{g.bandwidth / 1e12:.2f} TB/s); Little's law {g.bytes_in_flight_per_sm() / 1024:.1f} KB "
        "in flight per SM"
    )
    if not sass.available() and any(c.streams_weights for c in costs):
        lines.append(
            "instr/512B|MMA, in flight/SM, bound: not filled, no nvdisasm (pip install 'qir[sass]')"
        )
    return "\n".join(lines) + "\n"


def _num(c: KernelCost, value: float | None, fmt: str) -> str:
    if not c.streams_weights:
        return "n/a"
    return "?" if value is None else fmt.format(value)
