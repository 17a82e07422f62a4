"""The IR graph: networkx holds the structure, frozen `Node` payloads hold op, attributes and type.

Values are named by the node that produces them (`%gate`). An edge operand -> user carries the
operand index `idx`; a MultiDiGraph so that `mul %a, %a` keeps both uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from qir.types import ValueType

AttrValue = int | float | str | bool | tuple[Any, ...]
# Value, output and graph names: what the printer writes and the parser reads back.
_NAME = re.compile(r"[\w.]+")


def check_name(name: str, what: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{what} name {name!r}: use letters, digits, '_' and '.' only")


@dataclass(frozen=True)
class Node:
    op: str
    type: ValueType
    attrs: tuple[tuple[str, AttrValue], ...] = ()

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def with_attrs(self, **changes: AttrValue) -> Node:
        merged = dict(self.attrs)
        merged.update(changes)
        return replace(self, attrs=tuple(sorted(merged.items())))


def make_attrs(**kw: AttrValue) -> tuple[tuple[str, AttrValue], ...]:
    return tuple(sorted(kw.items()))


@dataclass
class Graph:
    name: str = "main"
    g: nx.MultiDiGraph = field(default_factory=nx.MultiDiGraph)
    # (output name, value name), in the order the block returns them.
    outputs: list[tuple[str, str]] = field(default_factory=list)

    # --- structure -------------------------------------------------------------------------
    def add(self, name: str, node: Node, operands: tuple[str, ...] = ()) -> str:
        if name in self.g:
            raise ValueError(f"value %{name} is already defined in graph {self.name}")
        for o in operands:
            if o not in self.g:
                raise ValueError(f"operand %{o} of %{name} is not defined in graph {self.name}")
        check_name(name, "value")
        # A counter that never repeats (node counts do, after removals): definition order
        # breaks ties in printing and in users(), so it must be unique.
        seq = self.g.graph.get("next_seq", 0)
        self.g.graph["next_seq"] = seq + 1
        self.g.add_node(name, node=node, seq=seq)
        for i, o in enumerate(operands):
            self.g.add_edge(o, name, idx=i)
        return name

    def node(self, name: str) -> Node:
        payload: Node = self.g.nodes[name]["node"]
        return payload

    def set_node(self, name: str, node: Node) -> None:
        self.g.nodes[name]["node"] = node

    def operands(self, name: str) -> tuple[str, ...]:
        edges: list[tuple[str, str, int]] = sorted(
            self.g.in_edges(name, data="idx"), key=lambda e: e[2]
        )
        return tuple(src for src, _, _ in edges)

    def set_operands(self, name: str, operands: tuple[str, ...]) -> None:
        self.g.remove_edges_from(list(self.g.in_edges(name, keys=True)))
        for i, o in enumerate(operands):
            self.g.add_edge(o, name, idx=i)

    def users(self, name: str) -> tuple[str, ...]:
        """Distinct consumers, in program order; an output reference is not a user."""
        return tuple(sorted(set(self.g.successors(name)), key=self._seq))

    def use_count(self, name: str) -> int:
        """Operand uses plus output references."""
        return self.g.out_degree(name) + sum(1 for _, v in self.outputs if v == name)

    def replace_all_uses(self, old: str, new: str) -> None:
        uses: list[tuple[str, str, int, int]] = list(self.g.out_edges(old, keys=True, data="idx"))
        for _, user, key, idx in uses:
            self.g.remove_edge(old, user, key)
            self.g.add_edge(new, user, idx=idx)
        self.outputs = [(n, new if v == old else v) for n, v in self.outputs]

    def remove(self, name: str) -> None:
        if self.use_count(name):
            raise ValueError(f"cannot remove %{name}: it still has uses")
        self.g.remove_node(name)

    def __contains__(self, name: object) -> bool:
        return name in self.g

    def __len__(self) -> int:
        return self.g.number_of_nodes()

    # --- order -----------------------------------------------------------------------------
    def _seq(self, name: str) -> int:
        seq: int = self.g.nodes[name]["seq"]
        return seq

    def order(self) -> list[str]:
        """Topological order, ties broken by definition order, so printing is deterministic."""
        return list(nx.lexicographical_topological_sort(self.g, key=self._seq))

    def items(self) -> Iterator[tuple[str, Node]]:
        for name in self.order():
            yield name, self.node(name)

    def of_op(self, op: str) -> list[str]:
        return [n for n, node in self.items() if node.op == op]

    @property
    def inputs(self) -> list[str]:
        return self.of_op("input")

    @property
    def weights(self) -> list[str]:
        return self.of_op("weight")

    def fresh(self, base: str) -> str:
        if base not in self.g:
            return base
        i = 1
        while f"{base}.{i}" in self.g:
            i += 1
        return f"{base}.{i}"

    def copy(self) -> Graph:
        return Graph(self.name, self.g.copy(), list(self.outputs))

    def weight_keys(self) -> Mapping[str, str]:
        """value name -> the weight's key (its checkpoint module or user-given name)."""
        return {n: self.node(n).attr("key") for n in self.weights}
