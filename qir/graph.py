"""The IR graph: networkx holds the structure, frozen `Node` payloads hold op, attributes and type.

Values are named by the node that produces them (`%gate`). An edge operand -> user carries the
operand index `idx`; a MultiDiGraph so that `mul %a, %a` keeps both uses.

Program order is the topological order with ties broken by each node's order key: its definition
order, or, for a node a rewrite made, the key of the node the rewrite was rooted at (see `add`).
Passes on an 80-layer model query the order, users and use counts thousands of times, so the
graph caches the order (until its structure changes) and the outputs' references: change the
structure through these methods, not through `g` directly.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter
from collections.abc import Iterable, Iterator, KeysView, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from qir.errors import QirError
from qir.types import ValueType

AttrValue = int | float | str | bool | tuple[Any, ...]
# Ties in program order are broken by these, compared as tuples: (seq,) for a node defined
# directly, (epoch, key of the rewrite's root, n) for the n-th node a rewrite rooted there made.
OrderKey = tuple[Any, ...]
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


class CycleError(QirError, ValueError):
    """A graph whose values depend on themselves (a parsed or rewritten block)."""


class _Outputs(list[tuple[str, str]]):
    """The block's (output name, value) list; it counts how often each value is referenced,
    recounting only after a change (use_count asks for every pattern a rewrite driver tries)."""

    _refs: Counter[str] | None = None

    def refs(self) -> Counter[str]:
        if self._refs is None:
            self._refs = Counter(v for _, v in self)
        return self._refs


def _mutator(name: str) -> Any:
    method = getattr(list, name)

    def changed(self: _Outputs, *args: Any) -> Any:
        self._refs = None
        return method(self, *args)

    changed.__name__ = name
    return changed


for _name in (
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "clear",
    "sort",
    "reverse",
    "__setitem__",
    "__delitem__",
    "__iadd__",
    "__imul__",
):
    setattr(_Outputs, _name, _mutator(_name))
del _name


@dataclass
class Graph:
    name: str = "main"
    g: nx.MultiDiGraph[str] = field(default_factory=nx.MultiDiGraph)
    # (output name, value name), in the order the block returns them.
    outputs: list[tuple[str, str]] = field(default_factory=list)
    _order: list[str] | None = field(default=None, init=False, repr=False, compare=False)
    # Values whose definition or operand types changed since verify last passed (None: all).
    _unverified: set[str] | None = field(default=None, init=False, repr=False, compare=False)
    # networkx's own dicts, read directly: its views are built per call, which made verify and
    # the rewrite driver several times slower. They follow `g` when it is replaced.
    _nodes: dict[str, dict[str, Any]] = field(init=False, repr=False, compare=False)
    _succ: dict[str, dict[str, dict[int, dict[str, Any]]]] = field(
        init=False, repr=False, compare=False
    )

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "outputs" and not isinstance(value, _Outputs):
            value = _Outputs(value)
        elif key == "g":
            super().__setattr__("_nodes", value._node)
            super().__setattr__("_succ", value._succ)
        super().__setattr__(key, value)

    def _changed(self, *redefined: str) -> None:
        self._order = None
        if self._unverified is not None:
            self._unverified.update(redefined)

    def unverified(self) -> set[str] | None:
        """The values verify must check again: those defined, redefined or re-pointed, and the
        users of a value whose type changed, since `verified()` (None: every value)."""
        return self._unverified

    def verified(self) -> None:
        self._unverified = set()

    # --- structure -------------------------------------------------------------------------
    def add(
        self, name: str, node: Node, operands: tuple[str, ...] = (), key: OrderKey | None = None
    ) -> str:
        """Define %name. `key` (default: the next definition number) breaks ties in program
        order; a rewrite passes one derived from its root, so what a pass prints does not depend
        on the order in which its rewrites ran."""
        if name in self.g:
            raise ValueError(f"value %{name} is already defined in graph {self.name}")
        for o in operands:
            if o not in self.g:
                raise ValueError(f"operand %{o} of %{name} is not defined in graph {self.name}")
        check_name(name, "value")
        key = key if key is not None else (self.next_seq(),)
        self.g.add_node(name, node=node, key=key, operands=tuple(operands))
        for i, o in enumerate(operands):
            self.g.add_edge(o, name, idx=i)
        self._changed(name)
        return name

    def next_seq(self) -> int:
        """A number never handed out before in this graph (node counts repeat after removals,
        and keys must be unique)."""
        seq: int = self.g.graph.get("next_seq", 0)
        self.g.graph["next_seq"] = seq + 1
        return seq

    def order_key(self, name: str) -> OrderKey:
        key: OrderKey = self._nodes[name]["key"]
        return key

    def node(self, name: str) -> Node:
        payload: Node = self._nodes[name]["node"]
        return payload

    def set_node(self, name: str, node: Node) -> None:
        self._nodes[name]["node"] = node
        if self._unverified is not None:
            self._unverified.add(name)
            self._unverified.update(self._succ[name])  # their types are inferred from its type

    def operands(self, name: str) -> tuple[str, ...]:
        # The edges hold the same (with their index); the tuple saves sorting them per call.
        operands: tuple[str, ...] = self._nodes[name]["operands"]
        return operands

    def set_operands(self, name: str, operands: tuple[str, ...]) -> None:
        data = self._nodes[name]
        self.g.remove_edges_from([(o, name) for o in data["operands"]])  # one edge per use
        self.g.add_edges_from([(o, name, {"idx": i}) for i, o in enumerate(operands)])
        data["operands"] = tuple(operands)
        self._changed(name)

    def users(self, name: str) -> tuple[str, ...]:
        """Distinct consumers by order key (definition order, for nodes no rewrite made); an
        output reference is not a user."""
        return tuple(sorted(self._succ[name], key=self.order_key))

    def user_set(self, name: str) -> KeysView[str]:
        """Distinct consumers in no particular order (no sorting: for walks that visit all)."""
        return self._succ[name].keys()

    def use_count(self, name: str) -> int:
        """Operand uses plus output references."""
        outputs = self.outputs
        assert isinstance(outputs, _Outputs)
        return sum(map(len, self._succ[name].values())) + outputs.refs()[name]

    def replace_all_uses(self, old: str, new: str) -> None:
        uses: list[tuple[str, str, int, int]] = list(self.g.out_edges(old, keys=True, data="idx"))
        for _, user, key, idx in uses:
            self.g.remove_edge(old, user, key)
            self.g.add_edge(new, user, idx=idx)
        users = {u for _, u, _, _ in uses}
        for user in users:
            data = self._nodes[user]
            data["operands"] = tuple(new if o == old else o for o in data["operands"])
        outputs = self.outputs
        assert isinstance(outputs, _Outputs)
        if outputs.refs()[old]:
            self.outputs = [(n, new if v == old else v) for n, v in outputs]
        self._changed(*users)

    def remove(self, name: str) -> None:
        if self.use_count(name):
            raise ValueError(f"cannot remove %{name}: it still has uses")
        self.g.remove_node(name)
        self._changed()

    def remove_all(self, names: Iterable[str]) -> None:
        """Remove values used only by each other (what DCE found dead)."""
        doomed = set(names)
        if not doomed:
            return
        for name in doomed:
            users = set(self.g.successors(name)) - doomed
            outputs = self.outputs
            assert isinstance(outputs, _Outputs)
            if users or outputs.refs()[name]:
                raise ValueError(f"cannot remove %{name}: it still has uses")
        self.g.remove_nodes_from(doomed)
        self._changed()

    def __contains__(self, name: object) -> bool:
        return name in self.g

    def __len__(self) -> int:
        return self.g.number_of_nodes()

    # --- order -----------------------------------------------------------------------------
    def order(self) -> list[str]:
        """Topological order, ties broken by order key, so printing is deterministic. Cached
        until the structure changes; a fresh list each call, the caller may keep it."""
        if self._order is None or len(self._order) != len(self.g):
            self._order = self._sort()
        return list(self._order)

    def _sort(self) -> list[str]:
        """Kahn's algorithm with the ready values in a heap by order key (what networkx's
        lexicographical_topological_sort does), over distinct operands. Keys are ranked once
        (a C sort), so the heap compares ints; when that ranking is itself topological (a
        graph no rewrite has reordered) it is the answer."""
        nodes = self._nodes
        by_key = sorted(nodes, key=lambda n: nodes[n]["key"])
        rank = {n: i for i, n in enumerate(by_key)}
        if all(rank[o] < rank[n] for n in by_key for o in nodes[n]["operands"]):
            return by_key
        pending = {n: len(set(data["operands"])) for n, data in nodes.items()}
        ready = [rank[n] for n, d in pending.items() if d == 0]
        heapq.heapify(ready)
        out = []
        succ = self._succ
        while ready:
            n = by_key[heapq.heappop(ready)]
            out.append(n)
            for user in succ[n]:
                pending[user] -= 1
                if pending[user] == 0:
                    heapq.heappush(ready, rank[user])
        if len(out) != len(pending):
            raise CycleError(f"graph {self.name} has a cycle")
        return out

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
        g = Graph(self.name, self.g.copy(), list(self.outputs))
        if self._order is not None:
            g._order = list(self._order)
        if self._unverified is not None:
            g._unverified = set(self._unverified)
        return g

    def weight_keys(self) -> Mapping[str, str]:
        """value name -> the weight's key (its checkpoint module or user-given name)."""
        return {n: self.node(n).attr("key") for n in self.weights}
