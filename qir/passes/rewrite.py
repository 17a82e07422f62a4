"""The one rewrite engine: patterns with named captures, use-count constraints and a `check`
predicate; a driver that applies a rule set to a fixpoint. Passes change graphs only through a
`Rewriter`, which keeps definitions in place (users and outputs follow) and sweeps the nodes a
rewrite left without uses.

    Pat("qlinear", (Pat(name="h", op="mul", one_use=True,
                        operands=(Pat("silu", (Pat(name="g"),), one_use=True), Pat(name="u"))),
                    Pat(name="w")))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qir.graph import Graph, Node

MAX_REWRITES = 10_000


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
    """The mutations a rule may make."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._touched: set[str] = set()

    def insert(self, name_hint: str, node: Node, operands: Sequence[str]) -> str:
        return self.graph.add(self.graph.fresh(name_hint), node, tuple(operands))

    def redefine(self, value: str, node: Node, operands: Sequence[str]) -> None:
        """Give an existing value a new definition; its users and output references stay."""
        self._touched.update(self.graph.operands(value))
        self.graph.set_node(value, node)
        self.graph.set_operands(value, tuple(operands))

    def replace(self, old: str, new: str) -> None:
        """Point every use of `old`, output references included, at `new`; `old` is swept."""
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
                and self.graph.node(v).op not in ("input", "weight")
            ):
                work.extend(self.graph.operands(v))
                self.graph.g.remove_node(v)
        self._touched.clear()


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    # Returns False when, on a closer look, it declines (nothing was changed).
    rewrite: Callable[[Rewriter, Match], bool]


def apply_rules(graph: Graph, rules: Sequence[Rule]) -> int:
    """Apply rules until none fires; returns how many rewrites happened."""
    fired = 0
    rw = Rewriter(graph)
    changed = True
    while changed:
        changed = False
        for value in graph.order():
            for rule in rules:
                m = match(graph, rule.pattern, value)
                if m is not None and rule.rewrite(rw, m):
                    rw.sweep()
                    fired += 1
                    changed = True
                    break
            if changed:
                break
        if fired > MAX_REWRITES:
            raise RuntimeError(f"rewrite rules {[r.name for r in rules]} did not reach a fixpoint")
    return fired
