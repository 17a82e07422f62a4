"""Merge parallel qlinears: several plain qlinears reading the same input with weights of one
in_features (gate/up; q/k/v) become one multi-output qlinear that reads the input once; each
original value becomes a `get` of it, so users and block outputs are untouched. Weights of
different formats merge too (a GGUF's Q4_K q/k and Q6_K v): the GEMV runs each format's
weights as a part of one launch (codegen.gemv.GemvSpec.parts), the GEMM decodes each weight's
tiles by its own format's fragment in one launch.

Preconditions: a verified graph. Scale-safe by construction: every weight keeps its own
buffers, so per-tensor scales (NVFP4 global scales, FP8) stay per output segment; nothing is
merged by max().
Where a group holds a gate/up pair (`mul(silu(g), u)`, each used only there) beside other
projections, the pair is merged apart from the rest, so silu_epilogue folds it as usual.
Does not handle: qlinears that already carry a prologue or epilogue, or already merged ones
(merging happens first in the pipeline); weights of different widths; weights that may take
4-bit activations beside weights of another format, or W4A4 weights calibrated for different
activation scales (not merged: one launch reads one quantized input).
"""

from __future__ import annotations

from qir.graph import Graph, Node, make_attrs
from qir.ops import ACT_SCALE_ATTRS, GATE_ACTS, Op
from qir.passes.rewrite import Match, Pat, Rewriter, Rule, RulePass
from qir.types import QWeight, TensorType, TupleType


def _plain_qlinear_users(graph: Graph, x: str) -> list[str]:
    users = []
    for u in graph.users(x):
        node = graph.node(u)
        if node.op == Op.QLINEAR and not node.attrs and graph.operands(u)[0] == x:
            users.append(u)
    return users


def _groups(graph: Graph, x: str) -> list[list[str]]:
    by_key: dict[tuple[object, ...], list[str]] = {}
    for u in _plain_qlinear_users(graph, x):
        weight = graph.node(graph.operands(u)[1])
        w = weight.type
        assert isinstance(w, QWeight)
        # Weights calibrated for different activation scales cannot share one quantized input.
        rule = tuple((k, v) for k, v in weight.attrs if k in ACT_SCALE_ATTRS)
        # Formats mix in a launch of 16-bit activations only: one that may take 4-bit ones
        # (NVFP4, which route_w4a4 may route) keeps to its own.
        fmt = w.format if w.format.act_quant_scheme() is not None else None
        by_key.setdefault((fmt, w.in_features, rule), []).append(u)
    return [part for g in by_key.values() for part in _apart(graph, g) if len(part) > 1]


def _sole_user(graph: Graph, value: str) -> str | None:
    users = graph.users(value)
    return users[0] if len(users) == 1 and graph.use_count(value) == 1 else None


def _gated_partner(graph: Graph, u: str) -> str | None:
    """The qlinear v where u's only use is `mul(act(u), v)` (either order), act a gate
    activation with that one use and v used only there: a gate/up pair."""
    act = _sole_user(graph, u)
    if act is None or graph.node(act).op not in GATE_ACTS:
        return None
    mul = _sole_user(graph, act)
    if mul is None or graph.node(mul).op != Op.MUL:
        return None
    others = [o for o in graph.operands(mul) if o != act]
    if len(others) != 1 or _sole_user(graph, others[0]) != mul:
        return None
    return others[0]


def _apart(graph: Graph, group: list[str]) -> list[list[str]]:
    """A group with a gate/up pair and other projections (Qwen2-MoE: its router, the shared
    expert's gate and its gate/up read one input): each pair merged apart, so silu_epilogue
    still folds it, and the rest together."""
    if len(group) <= 2:
        return [group]
    pairs: list[list[str]] = []
    taken: set[str] = set()
    for u in group:
        v = _gated_partner(graph, u)
        if v is not None and v in group and u not in taken and v not in taken:
            pairs.append(sorted((u, v), key=group.index))
            taken.update((u, v))
    return [*pairs, [u for u in group if u not in taken]] if pairs else [group]


def _has_group(graph: Graph, x: str) -> bool:
    # the rule is tried at every node: most have fewer than two users
    return len(graph.user_set(x)) > 1 and bool(_groups(graph, x))


def _merge(rw: Rewriter, m: Match) -> bool:
    graph = rw.graph
    group = _groups(graph, m.root)[0]
    weights = [graph.operands(u)[1] for u in group]
    types = tuple(t for u in group if isinstance(t := graph.node(u).type, TensorType))
    merged = rw.insert(
        "_".join(group),
        Node("qlinear", TupleType(types), make_attrs(fused=tuple(group))),
        [m.root, *weights],
    )
    for i, u in enumerate(group):
        rw.redefine(u, Node("get", types[i], make_attrs(index=i)), [merged])
    return True


RULES = (Rule("merge_parallel", Pat(check=_has_group), _merge),)


MERGE_PARALLEL = RulePass("merge_parallel", RULES)
