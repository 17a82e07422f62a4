"""The one rewrite engine: patterns with named captures, use-count constraints and a `check`
predicate; a driver that applies a rule set to a fixpoint. Passes change graphs only through a
`Rewriter`, which keeps definitions in place (users and outputs follow) and sweeps the nodes a
rewrite left without uses.

The driver is a worklist: it visits the nodes once in program order and, after a rewrite, only
the nodes whose match could have changed, so a pass costs time in proportion to the graph plus
its rewrites, not their product. Which nodes those are follows from what a rule may look at: a
pattern reads the nodes it matches (at most its depth in users below the root) and their use
counts; a `check` reads its node, the node's operands and users, the users of those operands
and the operands of those users. The driver re-visits every node that could read a node a rewrite
made, redefined, re-pointed or swept (or whose uses changed), in program order of the graph the
pass started from, and visits nothing else again: a rule that looks further must not be used.

    Pat(Op.QLINEAR, (Pat(name="h", op=Op.MUL, one_use=True,
                         operands=(Pat(Op.SILU, (Pat(name="g"),), one_use=True), Pat(name="u"))),
                     Pat(name="w")))
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qir.graph import Graph, Node, OrderKey
from qir.ops import Op

# A rule set that keeps firing (two rules undoing each other) is a bug: stop after this many
# rewrites per node of the graph.
REWRITES_PER_NODE = 10


@dataclass(frozen=True)
class Pat:
    op: str | None = None  # None: any op
    operands: tuple[Pat, ...] | None = None  # None: any operands; else matched one by one
    name: str | None = None  # capture the value under this name
    one_use: bool = False  # the value has exactly one use, and is not a block output
    check: Callable[[Graph, str], bool] | None = None


@dataclass
class Match:
    root: str
    captures: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> str:
        return self.captures[name]


def match(graph: Graph, pat: Pat, value: str, m: Match | None = None) -> Match | None:
    m = m if m is not None else Match(value)
    node = graph.node(value)
    if pat.op is not None and node.op != pat.op:
        return None
    if pat.one_use and graph.use_count(value) != 1:
        return None
    # One name captured twice must be one value.
    if pat.name is not None and m.captures.setdefault(pat.name, value) != value:
        return None
    if pat.operands is not None:
        operands = graph.operands(value)
        if len(operands) != len(pat.operands):
            return None
        for sub, o in zip(pat.operands, operands, strict=True):
            if match(graph, sub, o, m) is None:
                return None
    if pat.check is not None and not pat.check(graph, value):
        return None
    return m


class Rewriter:
    """The mutations a rule may make. It records what they changed, for the driver."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.root: str | None = None  # the node the current rewrite matched at (set by the driver)
        # Nodes this rewriter makes sort after every node defined before it; among themselves
        # by their root's key, not by when they were made (see Graph.add).
        self._epoch = graph.next_seq()
        self._made: dict[OrderKey, int] = {}
        self._touched: set[str] = set()  # may have lost their last use: swept if so
        self.changed: set[str] = set()  # made, redefined, re-pointed, or their uses changed

    def insert(self, name_hint: str, node: Node, operands: Sequence[str]) -> str:
        key = None
        if self.root is not None:
            root_key = self.graph.order_key(self.root)
            self._made[root_key] = n = self._made.get(root_key, 0) + 1
            key = (self._epoch, root_key, n)
        name = self.graph.add(self.graph.fresh(name_hint), node, tuple(operands), key)
        self.changed.add(name)
        self.changed.update(operands)
        return name

    def redefine(self, value: str, node: Node, operands: Sequence[str]) -> None:
        """Give an existing value a new definition; its users and output references stay."""
        old = self.graph.operands(value)
        self._touched.update(old)
        self.changed.update(old)
        self.changed.update(operands)
        self.changed.add(value)
        self.graph.set_node(value, node)
        self.graph.set_operands(value, tuple(operands))

    def replace(self, old: str, new: str) -> None:
        """Point every use of `old`, output references included, at `new`; `old` is swept."""
        self.changed.update(self.graph.users(old))
        self.changed.update((old, new))
        self.graph.replace_all_uses(old, new)
        self._touched.add(old)

    def sweep(self) -> None:
        """Erase nodes left without uses by this rewrite (and what only they used)."""
        work = list(self._touched)
        while work:
            v = work.pop()
            if (
                v in self.graph
                and self.graph.use_count(v) == 0
                and self.graph.node(v).op not in (Op.INPUT, Op.WEIGHT)
            ):
                operands = self.graph.operands(v)
                work.extend(operands)
                self.changed.update(operands)
                self.graph.remove(v)
        self._touched.clear()


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    # Returns False when, on a closer look, it declines (nothing was changed).
    rewrite: Callable[[Rewriter, Match], bool]


def depth(pat: Pat) -> int:
    """How many operand steps below its root a pattern reaches."""
    return max((1 + depth(o) for o in pat.operands or ()), default=0)


def readers(graph: Graph, changed: Iterable[str], reach: int) -> set[str]:
    """Every node whose match (patterns of depth <= reach, checks as the module says) can read
    one of `changed`."""
    near: set[str] = set()
    for n in changed:
        if n not in graph:
            continue
        near.add(n)
        for o in graph.operands(n):  # an operand, and its other users
            near.add(o)
            near.update(graph.user_set(o))
        for u in graph.user_set(n):  # a user, and its other operands
            near.add(u)
            near.update(graph.operands(u))
    found, level = set(near), near
    for _ in range(reach):
        level = {u for n in level for u in graph.user_set(n)} - found
        found |= level
    return found


def apply_rules(graph: Graph, rules: Sequence[Rule]) -> int:
    """Apply rules until none fires; returns how many rewrites happened.

    Visits nodes in program order and tries the rules in order at each; after a rewrite, the
    nodes that could now match differently are visited again, earliest first: before the next
    node in program order if they come before it (a node the rewrite made ranks right after the
    root it was made at)."""
    rw = Rewriter(graph)
    reach = max((depth(r.pattern) for r in rules), default=0)
    order = graph.order()
    rank: dict[str, tuple[int, Any]] = {n: (i, ()) for i, n in enumerate(order)}
    # Nodes at order[i:] are still to visit; `again` holds (rank, node) of others to revisit.
    again: list[tuple[tuple[int, Any], str]] = []
    queued: set[str] = set()
    limit = REWRITES_PER_NODE * max(len(graph), 1000)
    fired, i = 0, 0
    while i < len(order) or again:
        if again and (i == len(order) or again[0][0] < (i, ())):
            _, value = heapq.heappop(again)
            queued.discard(value)
        else:
            value, i = order[i], i + 1
        if value not in graph:
            continue  # swept after it was queued
        rw.root = value
        for rule in rules:
            m = match(graph, rule.pattern, value)
            if m is None or not rule.rewrite(rw, m):
                continue
            rw.sweep()
            fired += 1
            if fired > limit:
                raise RuntimeError(
                    f"rewrite rules {[r.name for r in rules]} did not reach a fixpoint"
                )
            for n in readers(graph, rw.changed | {value}, reach):
                if n not in rank:
                    rank[n] = (rank[value][0], graph.order_key(n))
                if n not in queued and rank[n] < (i, ()):
                    queued.add(n)
                    heapq.heappush(again, (rank[n], n))
            rw.changed.clear()
            break
    return fired


@dataclass(frozen=True)
class RulePass:
    """A pass whose body is applying its rules to a fixpoint (apply_rules)."""

    name: str
    rules: tuple[Rule, ...]

    def run(self, graph: Graph) -> int:
        return apply_rules(graph, self.rules)
