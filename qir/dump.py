"""Writing a compiled block to a directory: the IR before and after passes, and one .cu per
kernel (named by its specialisation) with the headers it includes beside it, so each file
compiles on its own with `nvcc -std=c++17 -arch=<the plan's target> -cubin`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qir.codegen.plan import Launch, Plan, experts_per_row, value_bytes
from qir.graph import Graph
from qir.printer import print_graph
from qir.runtime.memory import plan_memory
from qir.types import QExperts, QWeight


def dump(before: Graph, after: Graph, plan: Plan, out: Path, m: int | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "before.ir", out / "after.ir"]
    written[0].write_text(print_graph(before))
    written[1].write_text(print_graph(after))
    for launch in plan.launches:
        k = launch.kernel
        path = out / f"{k.name}.cu"
        if path in written:  # two launches of one specialisation share a kernel
            continue
        path.write_text(k.source)
        written.append(path)
        for header, text in k.headers:
            (out / header).write_text(text)
    written.append(out / "plan.json")
    written[-1].write_text(json.dumps(plan_json(plan, m), indent=2) + "\n")
    return written


def weights_bytes(graph: Graph) -> int:
    """Bytes of every weight buffer the graph reads (each weight node once)."""
    return sum(weights_bytes_of(graph.node(n).type) for n in graph.weights)


def weights_bytes_of(t: object) -> int:
    """Bytes of one weight node's buffers (every expert of stacked experts)."""
    if isinstance(t, QExperts):
        return sum(value_bytes(b, {}) for b in t.buffers().values())
    if isinstance(t, QWeight):
        return sum(value_bytes(b, {}) for b in t.buffers().values())
    return value_bytes(t, {})


def active_weights_bytes(graph: Graph) -> int:
    """Bytes of the weights one token's step reads: every weight as weights_bytes counts it,
    but of stacked experts only the k its row chooses."""
    total = 0
    for n in graph.weights:
        t = graph.node(n).type
        if isinstance(t, QExperts):
            one = sum(value_bytes(b, {}) for b in t.expert_buffers().values())
            total += one * min(t.count, experts_per_row(graph, n))
        else:
            total += weights_bytes_of(t)
    return total


def grid_y(launch: Launch) -> str:
    """grid.y as a formula of M."""
    rows = "M" if launch.rows_per_m == 1 else f"M*{launch.rows_per_m}"
    tiles = f"ceil({rows}/{launch.m_tile})" if launch.rows_per_m else ""
    extra = str(launch.extra_y) if launch.extra_y else ""
    return " + ".join(p for p in (tiles, extra) if p) or "0"


def collectives_json(plan: Plan) -> list[dict[str, object]]:
    """Each collective of a rank's plan and the bytes it moves per token (one row of M): the
    payload (the rank's buffer row), and what a ring algorithm sends from each rank (NCCL's
    and MPI's for large messages): all_reduce 2 (N - 1) / N of the row, all_gather N - 1
    rows of the rank's part."""
    out: list[dict[str, object]] = []
    for name, node in plan.graph.items():
        if node.op not in ("all_reduce", "all_gather"):
            continue
        x = plan.graph.node(plan.graph.operands(name)[0]).type
        n = node.attr("ranks")
        row = value_bytes(x, {"M": 1})
        sent = 2 * (n - 1) * row // n if node.op == "all_reduce" else (n - 1) * row
        out.append({"value": name, "op": node.op, "payload_bytes": row, "sent_bytes": sent})
    return out


def k_parts_json(plan: Plan) -> list[dict[str, Any]]:
    """A rank's K parts (its row-parallel shards, inputs start..stop of `of`), one entry per
    distinct cut with the linears cut there: where the ranks' parts differ (groups that do not
    divide by the ranks), what each holds."""
    parts: dict[tuple[int, int, int], set[str]] = {}
    for w in plan.graph.weights:
        shard = plan.graph.node(w).attr("shard")
        if shard and shard[1] == "in":
            parts.setdefault(tuple(shard[2:5]), set()).add(shard[0].rpartition(".")[2])
    return [
        {"inputs": [lo, hi], "of": of, "linears": sorted(names)}
        for (lo, hi, of), names in sorted(parts.items())
    ]


def plan_json(plan: Plan, m: int | None = None) -> dict[str, object]:
    """The target, then one entry per launch: kernel name, block, grid, the IR nodes it covers;
    for a given M only
    the launches that run at that M, with the bytes each moves, and the memory a run allocates
    (the intermediates' arena planned from liveness, with each value's offset; the outputs),
    else every launch with the range of M it serves."""
    kernels = []
    for launch in plan.launches:
        grid: object = list(launch.grid(m)) if m else [launch.grid_x, grid_y(launch), 1]
        if m and not launch.runs_for(m):
            continue
        entry: dict[str, object] = {
            "name": launch.kernel.name,
            "grid": grid,
            "block": list(launch.kernel.block),
            "nodes": list(launch.nodes),
        }
        if m:
            entry["bytes"] = plan.bytes_moved(launch, m)
        else:
            entry["m_range"] = list(launch.when)
        kernels.append(entry)
    target = {"arch": plan.target.arch, "features": list(plan.target.features)}
    out: dict[str, object] = {"graph": plan.graph.name, "target": target, "kernels": kernels}
    if m:
        mem = plan_memory(plan, m)
        out["memory"] = {
            "weights_bytes": weights_bytes(plan.graph),
            "active_weights_bytes": active_weights_bytes(plan.graph),
            "kv_cache_bytes": sum(
                value_bytes(plan.graph.node(n).type, {}) for n in plan.graph.of_op("state")
            ),
            "peak_bytes": mem.peak_bytes,
            "arena_bytes": mem.arena_bytes,
            "output_bytes": mem.output_bytes,
            "intermediates_without_reuse_bytes": mem.unshared_bytes,
            "arena_offsets": dict(mem.offsets),
        }
    return out
