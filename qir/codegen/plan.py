"""The plan types lowering produces and an executor binds: Arg, Launch, Plan, and the batch-size
and row conventions they share. Below every lowering module (lower, lower_layer, lower_moe,
moe_gemm), so those import downward and never each other in a circle."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from qir.codegen.kernel import Kernel
from qir.errors import UsageError
from qir.graph import Graph
from qir.ops import operand
from qir.target import DEFAULT, Target
from qir.types import QActType, QExperts, QWeight, TensorType, ValueType

# Rows of x one GEMV launch handles; grid.y covers the rest.
DEFAULT_M_TILE = 8


ALL_M = (1, 2**31 - 1)
MAX_GRID_Y = 65535  # CUDA's gridDim.y limit: rows of M go there

# What the rows of a run are, where a kernel family depends on it (attention): "many" rows of
# any sequences each (a decode batch), or rows of "one" sequence (a prefill; a paged cache's
# rows of one sequence per tile). A run that does not say: "many" up to AUTO_MANY_ROWS rows
# (decode), "one" above (prefill), which is what a single sequence's runs are.
ROWS = ("many", "one")
AUTO_MANY_ROWS = 4


def resolve_rows(m: int, rows: str | None) -> str:
    """A run's rows: the given kind, or the one its size implies."""
    if rows is None:
        return "many" if m <= AUTO_MANY_ROWS else "one"
    if rows not in ROWS:
        raise UsageError(f"rows must be one of {', '.join(ROWS)}, got {rows!r}")
    return rows


@dataclass(frozen=True)
class Arg:
    kind: Literal["value", "weight", "const", "M"]
    ref: str = ""  # value name, or the weight node's name
    buffer: str = ""  # for weights: which of the format's buffers
    value: float = 0.0  # for const: passed as a one-element float32 buffer


@dataclass(frozen=True)
class Launch:
    kernel: Kernel
    grid_x: int
    m_tile: int  # grid.y = ceil(M / m_tile)
    args: tuple[Arg, ...]
    outputs: tuple[str, ...]  # the values this launch writes
    nodes: tuple[str, ...]  # IR nodes it covers
    when: tuple[int, int] = ALL_M  # the batch sizes M (inclusive) this launch runs for
    rows: str = ""  # the runs' rows it serves (ROWS), "" for any
    # grid.y = ceil(M * rows_per_m / m_tile) + extra_y: a launch over each row's k expert slots
    # (rows_per_m = k), plus blocks that exist whatever M is (an expert-major launch: 0, 1).
    rows_per_m: int = 1
    extra_y: int = 0

    def runs_for(self, m: int, rows: str | None = None) -> bool:
        """Whether a run of `m` rows (of the kind `rows`, see resolve_rows) launches it."""
        return self.when[0] <= m <= self.when[1] and self.rows in ("", resolve_rows(m, rows))

    def grid(self, m: int) -> tuple[int, int, int]:
        y = -(-m * self.rows_per_m // self.m_tile) + self.extra_y
        if y > MAX_GRID_Y:
            raise UsageError(
                f"M={m} is too many rows for {self.kernel.name}: at most {MAX_GRID_Y * self.m_tile}"
            )
        return (self.grid_x, y, 1)


@dataclass(frozen=True)
class Plan:
    graph: Graph
    launches: tuple[Launch, ...]
    # Buffers that launches pass between them and that are no IR value (a split attention's
    # partial results): planned in the arena like intermediates, by name.
    temps: Mapping[str, TensorType] = field(default_factory=dict)
    target: Target = DEFAULT  # the GPU the kernels are for

    def value_type(self, name: str) -> ValueType:
        """The type of a value argument: a temp's, else the IR value's."""
        return self.temps[name] if name in self.temps else self.graph.node(name).type

    def bytes_moved(self, launch: Launch, m: int) -> int:
        """Bytes a launch reads and writes in DRAM for a batch of m rows, counting each buffer
        once: the roofline of a memory-bound GEMV, and what fusion saves."""
        sizes = {"M": m}
        total = 0
        for a in launch.args:
            if a.kind == "value":
                total += value_bytes(self.value_type(a.ref), sizes)
            elif a.kind == "weight":
                w = self.graph.node(a.ref).type
                if isinstance(w, TensorType):  # a parameter vector: one buffer
                    total += value_bytes(w, sizes)
                    continue
                if isinstance(w, QExperts):  # at most the experts m rows can choose
                    one = value_bytes(w.expert_buffers()[a.buffer], sizes)
                    total += one * min(w.count, m * experts_per_row(self.graph, a.ref))
                    continue
                assert isinstance(w, QWeight)
                t = w.buffers()[a.buffer]
                total += value_bytes(t, sizes)
            elif a.kind == "const":
                total += 4
        return total


def experts_per_row(graph: Graph, weight: str) -> int:
    """k: the experts each row chooses, for stacked experts `weight` (its readers' ids)."""
    for user in graph.users(weight):
        at = operand(graph, user, "ids")
        assert at is not None
        ids = graph.node(at).type
        if isinstance(ids, TensorType) and isinstance(ids.shape[1], int):
            return ids.shape[1]
    return 1


def value_bytes(t: object, sizes: dict[str, int]) -> int:
    if isinstance(t, QActType):
        return t.concrete_rows(sizes) * t.row_bytes
    assert isinstance(t, TensorType)
    n = 1
    for d in t.concrete(sizes):
        n *= d
    return n * t.dtype.itemsize


def results(graph: Graph, name: str, temps: dict[str, TensorType]) -> tuple[str, ...]:
    """The values a multi-output node writes: its gets, or a temp where a result has none."""
    node = graph.node(name)
    by_index = {graph.node(u).attr("index"): u for u in graph.users(name)}
    out = []
    for i, t in enumerate(node.type.elements):  # type: ignore[union-attr]
        if i not in by_index:
            by_index[i] = graph.fresh(f"{name}.{i}")
            temps[by_index[i]] = t
        out.append(by_index[i])
    return tuple(out)
