"""The memory plan of a run: where each intermediate lives in the run's one arena, laid out from
liveness (a value's bytes are reused once its last reader has run; graph outputs and states are
never in the arena)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qir.codegen.plan import Plan
from qir.types import QActType, TensorType

# Every arena slot starts on a 256-byte boundary, as cudaMalloc's own allocations do: kernels
# issue 128-bit loads, and this keeps any view's dtype aligned.
ALIGN = 256


@dataclass(frozen=True)
class MemoryPlan:
    m: int
    active: tuple[int, ...]  # the launches that run at this M (see Launch.runs_for)
    offsets: Mapping[str, int]  # intermediate value -> byte offset in the arena
    arena_bytes: int
    output_bytes: int
    unshared_bytes: int  # what the intermediates would take with no reuse

    @property
    def peak_bytes(self) -> int:
        """Bytes one run allocates besides its inputs and the weights."""
        return self.arena_bytes + self.output_bytes


def tensor_type(plan: Plan, value: str) -> TensorType:
    t = plan.value_type(value)
    assert isinstance(t, TensorType)
    return t


def state_aliases(plan: Plan) -> dict[str, str]:
    """Values whose buffer is a state's (value -> state node): each state, and the caches a
    kv_append writes, which it writes in place. They live outside the arena, for the block's
    lifetime."""
    graph = plan.graph
    # Unordered: a run at a new M plans its memory, and must not sort the graph.
    ops = {n: graph.node(n).op for n in graph.g.nodes}
    aliases = {n: n for n, op in ops.items() if op == "state"}
    for n, op in ops.items():
        if op == "kv_append":
            states = graph.operands(n)
            for u in graph.users(n):
                aliases[u] = states[graph.node(u).attr("index")]
    return aliases


def storage(plan: Plan, value: str, sizes: dict[str, int]) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of a value's buffer: a tensor as declared; a quantized activation as its
    packed bytes, one row of `row_bytes` per row of its source."""
    t = plan.value_type(value)
    if isinstance(t, QActType):
        return (t.source.concrete(sizes)[0], t.row_bytes), np.dtype(np.uint8)
    assert isinstance(t, TensorType)
    return t.concrete(sizes), t.dtype.np


def _nbytes(plan: Plan, value: str, sizes: dict[str, int]) -> int:
    shape, dtype = storage(plan, value, sizes)
    itemsize: int = np.dtype(dtype).itemsize
    return math.prod(shape) * itemsize


def plan_memory(plan: Plan, m: int, rows: str | None = None) -> MemoryPlan:
    """Arena offsets for the intermediates of `plan` at M=`m` (rows of the kind `rows`, see
    qir.codegen.lower.resolve_rows): best fit into the holes left by values whose last reader
    has run. A launch's outputs are placed before its dying inputs are freed, so no kernel
    writes over what it reads."""
    sizes = {"M": m}
    outputs = {v for _, v in plan.graph.outputs}
    in_state = state_aliases(plan)
    active = tuple(i for i, launch in enumerate(plan.launches) if launch.runs_for(m, rows))
    launches = [plan.launches[i] for i in active]
    last_read: dict[str, int] = {}
    for i, launch in enumerate(launches):
        for a in launch.args:
            if a.kind == "value":
                last_read[a.ref] = i
    holes: list[list[int]] = []  # [offset, size], sorted by offset, never adjacent
    live: dict[str, tuple[int, int]] = {}
    offsets: dict[str, int] = {}
    top = unshared = output_bytes = 0
    for i, launch in enumerate(launches):
        for v in launch.outputs:
            if v in in_state:
                continue
            nbytes = _nbytes(plan, v, sizes)
            if v in outputs:
                output_bytes += nbytes
                continue
            size = -(-nbytes // ALIGN) * ALIGN
            unshared += size
            offsets[v], top = _take(holes, size, top)
            live[v] = (offsets[v], size)
        for v in [v for v in live if last_read.get(v, i) <= i]:
            _give(holes, *live.pop(v))
    return MemoryPlan(m, active, offsets, top, output_bytes, unshared)


def _take(holes: list[list[int]], size: int, top: int) -> tuple[int, int]:
    """An offset for `size` bytes and the new arena end: the smallest hole that fits, else the
    end of the arena (extending a hole that touches it)."""
    fits = [h for h in holes if h[1] >= size]
    if fits:
        h = min(fits, key=lambda h: h[1])
        offset = h[0]
        h[0] += size
        h[1] -= size
        if h[1] == 0:
            holes.remove(h)
        return offset, top
    if holes and holes[-1][0] + holes[-1][1] == top:
        offset = holes.pop()[0]
        return offset, offset + size
    return top, top + size


def _give(holes: list[list[int]], offset: int, size: int) -> None:
    bisect.insort(holes, [offset, size])
    merged: list[list[int]] = []
    for h in holes:
        if merged and merged[-1][0] + merged[-1][1] == h[0]:
            merged[-1][1] += h[1]
        else:
            merged.append(h)
    holes[:] = merged
