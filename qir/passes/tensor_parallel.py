"""Tensor parallel: one rank's part of a block split across `ranks` ranks (Megatron-style).

- Attention is split by heads: q/k/v are column-parallel (rank r computes whole KV heads and
  their query heads; where there are fewer KV heads than ranks, a multiple of them, the ranks
  sharing a KV head split its query heads, so KV heads are replicated N/KV times), the KV caches
  hold the rank's KV heads, and o_proj is row-parallel: each rank's partial sum over its heads'
  inputs, then an `all_reduce`. Attention sinks (gpt-oss: a logit per query head) are cut to
  the rank's heads like q's rows; q/k/v's biases go with their rows, o's stays on rank 0.
- The MLP is split by intermediate features: gate/up column-parallel, down row-parallel, then an
  `all_reduce`.
- The lm_head is vocab-parallel: rank r computes logits of its V/N ids, an `all_gather` along
  the features puts the whole rows back (every rank then samples the same id from them).
- The embedding stays replicated: a lookup reads M rows of the table, not the table, so
  splitting it saves only its memory (V x hidden / N per rank) and would add a collective to
  every step's critical path (a masked lookup plus an all_reduce).

Parts need not be even. A row-parallel K part must start and end on what its format keeps
whole (a group, block or packed word: WeightFormat.column_unit; FP8's blocks of rows,
row_unit, for the column-parallel rows before it), and an exact cut matters more than equal
ones: the MLP's features are cut in units of down_proj's groups (and gate/up's row blocks), the
heads in units of the fewest KV heads (or, replicated, query heads) that end on one of
o_proj's groups, and of the U units rank r takes ceil(U/N) if r < U mod N, else floor(U/N), the
last unit possibly ragged (unit_range). A K part's format is the format's column_part (a GPTQ
act-order part keeps all the whole's groups). Refused, by every rank alike, where there are
fewer units than ranks.

The all_reduce comes right after the row-parallel qlinear, so every later op sees the whole
sum. A residual add that reads the sum directly, `r + all_reduce(p)`, becomes
`all_reduce(r + p)` on rank 0 and `all_reduce(p)` on the others: the residual is added once (by
rank 0, to its partial sum), and the residual epilogue pass folds it into rank 0's projection
as before, so no rank launches an add; on the other ranks there is no add to fold, which is
what keeps it from adding the residual N times. Where the sum goes elsewhere first (Gemma's
post-norm), the add stays after the all_reduce. The other fusions (merged q/k/v and gate/up,
SiLU, norm prologues, RoPE and head-norm folds) see the same patterns as before, on narrower
weights, and fire per rank.

A sharded weight node gets `shard = (source key, axis, start, stop, whole)`: rows ("out") or
inputs ("in") start..stop of the checkpoint weight `source`, whose size along that axis is
`whole`; its key becomes `source:axis<start>-<stop>` (the tied lm_head's shard of the
embedding table is then a weight of its own). A row-parallel weight's bias stays on rank 0
only, so it is added once. qir.models.shards cuts the buffers (WeightFormat.rows / columns,
exact or refused). The graph is renamed `<name>.rank<r>of<N>` so printed IR says whose it is.

Preconditions: the builder's unfused graph (run before the default pipeline); ranks at most the
KV heads or a multiple of them; a vocabulary divisible by the ranks.
- A MoE MLP is split like the dense one, inside every expert: each expert's gate/up by its
  intermediate features, its down by the same inputs, the router replicated (every rank routes
  alike), the combine of the rank's partial rows then an all_reduce (the residual in rank 0's
  combine). Not by expert: at decode a step reads its k chosen experts, and split by rows every
  rank reads 1/N of each of them whichever they are, where split by expert the ranks holding
  the chosen ones do all the work (and a rank holding none idles); it also needs no new op
  semantics or kernels. A shared expert (Qwen2-MoE), the residual of the routed combine, is
  split like the dense MLP and added into each rank's routed combine (its residual on rank 0).

Does not handle (refused in one line): fused or multi-output qlinears. Types downstream of what it narrows are re-inferred from the op table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from qir.errors import QirError
from qir.graph import Graph, Node, make_attrs
from qir.ops import Op, implement, layout, operands, spec
from qir.types import QExperts, QWeight, TensorType, TupleType

# Ops a projection's result passes through on its way to attention or kv_append: per-head
# norms (Qwen3, Gemma 3) and RoPE, which the split by heads leaves unchanged.
_PER_HEAD = (Op.ROPE, Op.RMS_NORM)
GATE_ACTS = (Op.SILU, Op.GELU_TANH)


class TensorParallelError(QirError, ValueError):
    """A block that cannot be split across the ranks asked for."""


def shard_key(source: str, axis: str, start: int, stop: int) -> str:
    return f"{source}:{axis}{start}-{stop}"


def unit_range(size: int, unit: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s part of `size` cut into whole units of `unit` (the last may be short):
    ceil(U/N) of the U units for the first U mod N ranks, floor(U/N) for the others."""
    each, extra = divmod(-(-size // unit), ranks)
    first = rank * each + min(rank, extra)
    return first * unit, min((first + each + (rank < extra)) * unit, size)


@dataclass(frozen=True)
class TensorParallel:
    ranks: int
    rank: int
    name: str = "tensor_parallel"

    def run(self, graph: Graph) -> int:
        """Rewrites `graph` into rank `rank`'s part; returns how many weights it sharded."""
        n, r = self.ranks, self.rank
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not 0 <= r < n:
            raise TensorParallelError(f"tensor_parallel: rank {r} of {n} ranks is out of range")
        if n == 1:
            return 0
        # Each op's rule (OpSpec.shard) recognises the split it roots from its node: attention
        # its heads, a qlinear an MLP's down, an expert qlinear a MoE's, sample the lm_head.
        # The rules touch disjoint weights, so the graph's order is as good as any.
        rooted = [(n, rule) for n, node in graph.items() if (rule := spec(node.op).shard)]
        fired = sum(rule(self, graph, n) for n, rule in rooted)
        _reinfer(graph)
        graph.name = f"{graph.name}.rank{r}of{n}"
        return fired

    # --- the three splits ----------------------------------------------------------------

    def _attention(self, graph: Graph, a: str) -> int:
        r = self.rank
        q_value, k_cache = operands(graph, a, "q") + operands(graph, a, "k_cache")
        cache = graph.node(k_cache).type
        assert isinstance(cache, TensorType)
        kv_heads, head_dim = cache.shape[1], cache.shape[2]
        assert isinstance(kv_heads, int) and isinstance(head_dim, int)
        q = _projection(graph, q_value, a)
        heads = _out(graph, q) // head_dim
        append = graph.operands(k_cache)[0]  # k_cache is `get` of the kv_append
        kv = [_projection(graph, value, append) for value in operands(graph, append, "k")]
        kv += [_projection(graph, value, append) for value in operands(graph, append, "v")]
        outs = [
            o
            for o in graph.users(a)
            if graph.node(o).op == Op.QLINEAR and graph.operands(o)[0] == a
        ]
        for o in outs:
            _plain(graph, o)
        parts = self._heads(graph, a, heads, kv_heads, head_dim, q, kv, outs)
        h0, h1, first, last = parts[r]
        fired = 4  # q, k, v and the caches
        self._split(graph, q, "out", h0 * head_dim, h1 * head_dim)
        at = layout(graph, a).at("sinks")
        if at is not None:  # gpt-oss: a logit per query head, the rank's heads' like q's rows
            self._split_param(graph, a, at, h0, h1)
            fired += 1
        for p in kv:
            self._split(graph, p, "out", first * head_dim, last * head_dim)
        # the caches hold the rank's KV heads
        for state in (*operands(graph, append, "k_cache"), *operands(graph, append, "v_cache")):
            t = graph.node(state).type
            assert isinstance(t, TensorType)
            shape = (t.shape[0], last - first, head_dim)
            graph.set_node(state, replace(graph.node(state), type=TensorType(shape, t.dtype)))
        for o in outs:
            self._split(graph, o, "in", h0 * head_dim, h1 * head_dim)
            self._residual_first(graph, self._after(graph, o, "all_reduce"))
            fired += 1
        return fired

    def _heads(
        self,
        graph: Graph,
        a: str,
        heads: int,
        kv_heads: int,
        head_dim: int,
        q: str,
        kv: list[str],
        outs: list[str],
    ) -> list[tuple[int, int, int, int]]:
        """Every rank's query heads h0..h1 and the KV heads first..last they read, so that its
        part of o_proj's inputs (and of q's rows) starts on what their formats keep whole (a
        group, a block): with at least as many KV heads as ranks, whole KV heads and their query
        heads, in units of the fewest KV heads whose query heads end on a group, ceil or floor of
        the units per rank; with fewer, each KV head replicated on ranks/KV ranks that share its
        query heads the same way. Refused where no such parts exist for every rank alike."""
        n = self.ranks
        per_kv = heads // kv_heads
        wide = math.lcm(
            _weight(graph, q).format.row_unit(),
            *(_weight(graph, o).format.column_unit(_weight(graph, o).in_features) for o in outs),
        )
        what = (
            f"whole heads on the groups of {wide} inputs of "
            + ", ".join(f"{_key(graph, o)} ({_weight(graph, o).format.spell()})" for o in outs)
            if wide > 1
            else "whole heads"
        )
        parts: list[tuple[int, int, int, int]] = []
        if kv_heads >= n:
            c = next(
                (c for c in range(1, kv_heads + 1) if c * per_kv * head_dim % wide == 0),
                kv_heads,
            )
            units = -(-kv_heads // c)
            if units < n:
                raise TensorParallelError(
                    f"tensor_parallel: %{a}'s {heads} heads over {kv_heads} KV heads make "
                    f"{units} part(s) of {what}, fewer than {n} ranks"
                )
            for rank in range(n):
                first, last = unit_range(kv_heads, c, n, rank)
                parts.append((first * per_kv, last * per_kv, first, last))
        else:
            m = n // kv_heads
            if n % kv_heads:
                raise TensorParallelError(
                    f"tensor_parallel: %{a} has {heads} heads and {kv_heads} KV heads; {n} ranks "
                    "must be at most the KV heads or a multiple of them"
                )
            h = next((h for h in range(1, per_kv + 1) if h * head_dim % wide == 0), per_kv)
            units = -(-per_kv // h)
            if units < m or (kv_heads > 1 and per_kv * head_dim % wide):
                raise TensorParallelError(
                    f"tensor_parallel: %{a}'s {per_kv} heads per KV head make {units} part(s) "
                    f"of {what} where {m} ranks share each of its {kv_heads} KV heads"
                )
            for rank in range(n):
                j = rank // m
                lo, hi = unit_range(per_kv, h, m, rank % m)
                parts.append((j * per_kv + lo, j * per_kv + hi, j, j + 1))
        rows = math.lcm(*(_weight(graph, p).format.row_unit() for p in kv))
        for _, _, first, last in parts:
            lo, hi = first * head_dim, last * head_dim
            if lo % rows and lo // rows != (hi - 1) // rows:
                raise TensorParallelError(
                    f"tensor_parallel: %{a}: a rank's KV heads {first}..{last} are rows {lo}..{hi} "
                    f"of {_key(graph, kv[0])}, which straddle its blocks of {rows} rows, so the "
                    "cut cannot be exact"
                )
        return parts

    def _mlp(self, graph: Graph, down: str) -> int:
        pair = _gate_up(graph, graph.operands(down)[0])
        if pair is None:
            return 0
        gate, up = pair
        for p in (gate, up, down):
            _plain(graph, p)
        lo, hi = self._features(graph, gate, up, down)
        self._split(graph, gate, "out", lo, hi)
        self._split(graph, up, "out", lo, hi)
        self._split(graph, down, "in", lo, hi)
        self._residual_first(graph, self._after(graph, down, "all_reduce"))
        return 3

    def _experts(self, graph: Graph, down: str) -> int:
        """A MoE MLP: every expert split by its intermediate features, as the dense MLP (the
        router replicated, so every rank routes alike); the combine of each rank's partial
        rows, then an all_reduce, the residual in rank 0's combine only."""
        h = graph.operands(down)[0]
        node = graph.node(down)
        if graph.node(h).op != Op.EXPERT_QLINEAR or graph.node(h).attr("epilogue") != "silu_mul":
            return 0
        epilogue = node.attr("epilogue")
        if epilogue not in ("combine", "combine_residual") or node.attr("kernel") is not None:
            raise TensorParallelError(
                f"tensor_parallel: %{down} is an expert qlinear without a combine epilogue; "
                "run the pass on the unfused block"
            )
        lo, hi = self._features(graph, (h, 1), (h, 2), down)
        self._split(graph, h, "out", lo, hi, at=1)
        self._split(graph, h, "out", lo, hi, at=2)
        self._split(graph, down, "in", lo, hi, at=1)
        shared = self._shared_expert(graph, down) if epilogue == "combine_residual" else 0
        if epilogue == "combine_residual" and self.rank != 0 and not shared:
            _drop_residual(graph, down)
        reduce = self._after(graph, down, "all_reduce")
        if epilogue == "combine":
            self._residual_first(graph, reduce)
        return 3 + shared

    def _shared_expert(self, graph: Graph, y: str) -> int:
        """A shared expert (Qwen2-MoE) as the residual of the routed combine `y`: its own
        combine of the residual and its sigmoid-gated MLP. Split like the dense MLP (gate/up by
        its features, its down by the same inputs), so each rank adds its part into its routed
        combine and the all_reduce after it sums the parts once; the residual stays in rank 0's.
        Returns the weights split (0 where `y`'s residual is no shared expert)."""
        s = graph.operands(y)[-1]
        node = graph.node(s)
        if node.op != Op.EXPERT_QLINEAR or node.attr("epilogue") != "combine_residual":
            return 0
        pair = _gate_up(graph, graph.operands(s)[0])
        if pair is None or node.attr("kernel") is not None:
            return 0
        gate, up = pair
        _plain(graph, gate)
        _plain(graph, up)
        lo, hi = self._features(graph, gate, up, s)
        self._split(graph, gate, "out", lo, hi)
        self._split(graph, up, "out", lo, hi)
        self._split(graph, s, "in", lo, hi, at=1)
        if self.rank != 0:
            _drop_residual(graph, s)
        return 3

    def _lm_head(self, graph: Graph, sample: str) -> int:
        n, r = self.ranks, self.rank
        value = graph.operands(sample)[0]
        # softcap is elementwise (it applies to each rank's part); adjust_logits takes the
        # gathered rows, as the draw does
        while graph.node(value).op in (Op.SOFTCAP, Op.ADJUST_LOGITS):
            value = graph.operands(value)[0]
        if graph.node(value).op != Op.QLINEAR:
            raise TensorParallelError(
                f"tensor_parallel: %{sample} samples %{value}, not an lm_head qlinear"
            )
        _plain(graph, value)
        vocab = _out(graph, value)
        if vocab % n:
            raise TensorParallelError(
                f"tensor_parallel: %{value} has a vocabulary of {vocab}, not divisible by {n} ranks"
            )
        self._split(graph, value, "out", r * vocab // n, (r + 1) * vocab // n)
        self._after(graph, value, "all_gather", axis=1)
        return 1

    # --- helpers -------------------------------------------------------------------------

    def _features(self, graph: Graph, gate: Use, up: Use, down: Use) -> tuple[int, int]:
        """This rank's range of the intermediate features that gate's and up's rows and down's
        inputs (each a qlinear, or an expert qlinear and its weight operand) cut alike: whole
        units, a unit being what all three formats hold whole (down's group, block or packed
        word, a block of rows), ceil(U/N) units for the first U mod N ranks and floor(U/N) for
        the others, so that no group is cut and the ranks need not be even; the last unit may
        be short (a ragged last group or block)."""
        n, r = self.ranks, self.rank
        rows = [_weight(graph, q) for q in (gate, up)]
        cols = _weight(graph, down)
        size = cols.in_features
        unit = math.lcm(*(w.format.row_unit() for w in rows), cols.format.column_unit(size))
        units = -(-size // unit)
        if units < n:
            raise TensorParallelError(
                f"tensor_parallel: {_key(graph, down)} has {size} inputs in {units} group(s) "
                f"of {unit} that no rank may cut ({cols.format.spell()}), fewer than {n} ranks"
            )
        return unit_range(size, unit, n, r)

    def _split(self, graph: Graph, q: str, axis: str, start: int, stop: int, at: int = 1) -> None:
        """Point q's weight operand `at` at the weight's rows (axis "out") or inputs ("in")
        start..stop (each expert's, for stacked experts): a new weight node, so a weight other
        nodes use (a tied embedding) stays whole for them."""
        w = graph.operands(q)[at]
        node = graph.node(w)
        t = node.type
        one = t.expert if isinstance(t, QExperts) else t
        assert isinstance(one, QWeight)
        source = node.attr("key")
        whole = one.out_features if axis == "out" else one.in_features
        if axis == "out":
            part_one = replace(one, out_features=stop - start)
        else:  # a row-parallel bias is added once, on rank 0
            fmt = one.format.column_part(one.in_features, start, stop)
            part_one = replace(
                one, format=fmt, in_features=stop - start, bias=one.bias and self.rank == 0
            )
        part = QExperts(part_one, t.count) if isinstance(t, QExperts) else part_one
        attrs = dict(node.attrs)
        attrs.update(
            key=shard_key(source, axis, start, stop), shard=(source, axis, start, stop, whole)
        )
        name = graph.fresh(f"{w}.{axis}{start}")
        graph.add(name, Node("weight", part, make_attrs(**attrs)), (), key=graph.order_key(w))
        ops = list(graph.operands(q))
        ops[at] = name
        graph.set_operands(q, tuple(ops))
        if not graph.use_count(w):
            graph.remove(w)

    def _split_param(self, graph: Graph, user: str, at: int, start: int, stop: int) -> None:
        """Point `user`'s operand `at`, a parameter vector (attention sinks), at its entries
        start..stop: a new weight node keyed by its shard, as `_split` does for a qweight."""
        w = graph.operands(user)[at]
        node = graph.node(w)
        t = node.type
        assert isinstance(t, TensorType) and len(t.shape) == 1
        source, whole = node.attr("key"), t.shape[0]
        attrs = dict(node.attrs)
        attrs.update(
            key=shard_key(source, "out", start, stop), shard=(source, "out", start, stop, whole)
        )
        name = graph.fresh(f"{w}.out{start}")
        part = Node("weight", TensorType((stop - start,), t.dtype), make_attrs(**attrs))
        graph.add(name, part, (), key=graph.order_key(w))
        ops = list(graph.operands(user))
        ops[at] = name
        graph.set_operands(user, tuple(ops))
        if not graph.use_count(w):
            graph.remove(w)

    def _residual_first(self, graph: Graph, reduce: str) -> None:
        """`add(r, all_reduce(p))` -> `all_reduce(add(r, p))` on rank 0 and `all_reduce(p)` on
        the others: the residual joins rank 0's partial sum, so it is added once, and on rank 0
        the residual epilogue folds it into the projection's launch (no add launch per rank).
        Where the sum goes elsewhere first (Gemma's post-norm), the add stays after it."""
        users = graph.users(reduce)
        if len(users) != 1 or graph.use_count(reduce) != 1 or graph.node(users[0]).op != Op.ADD:
            return
        add = users[0]
        (p,) = graph.operands(reduce)
        if self.rank == 0:
            operands = tuple(p if o == reduce else o for o in graph.operands(add))
            graph.set_operands(reduce, (add,))
            graph.set_operands(add, operands)
            for u in graph.users(add):
                if u != reduce:
                    graph.set_operands(
                        u, tuple(reduce if o == add else o for o in graph.operands(u))
                    )
            graph.outputs = [(n, reduce if v == add else v) for n, v in graph.outputs]
            return
        graph.replace_all_uses(add, reduce)
        graph.remove(add)

    def _after(self, graph: Graph, value: str, op: str, **attrs: int) -> str:
        """Insert `op` (a collective over the ranks) after `value`; its users read it instead."""
        t = graph.node(value).type
        result = spec(op).infer([t], [value], {"ranks": self.ranks, **attrs})
        name = graph.fresh(f"{value}.{op}")
        node = Node(op, result, make_attrs(ranks=self.ranks, **attrs))
        users = graph.users(value)
        graph.add(name, node, (value,), key=(*graph.order_key(value), 1))
        for u in users:
            graph.set_operands(u, tuple(name if o == value else o for o in graph.operands(u)))
        if any(v == value for _, v in graph.outputs):
            graph.outputs = [(o, name if v == value else v) for o, v in graph.outputs]
        return name


def _projection(graph: Graph, value: str, reader: str) -> str:
    """The qlinear whose result reaches `reader` through per-head ops only."""
    while graph.node(value).op in _PER_HEAD:
        value = graph.operands(value)[0]
    if graph.node(value).op != Op.QLINEAR:
        raise TensorParallelError(
            f"tensor_parallel: %{reader} reads %{value} ({graph.node(value).op}), not a q/k/v "
            "projection; run the pass on the unfused block"
        )
    _plain(graph, value)
    return value


def _gate_up(graph: Graph, h: str) -> tuple[str, str] | None:
    """The gate and up qlinears of h = act(gate) * up; None for any other h."""
    if graph.node(h).op != Op.MUL:
        return None
    act, up = graph.operands(h)
    if graph.node(act).op not in GATE_ACTS:
        return None
    gate = graph.operands(act)[0]
    if graph.node(gate).op != Op.QLINEAR or graph.node(up).op != Op.QLINEAR:
        return None
    return gate, up


Use = str | tuple[str, int]  # a qlinear (its weight operand 1), or (node, weight operand)


def _weight(graph: Graph, use: Use) -> QWeight:
    """The weight (one expert's, of stacked experts) a qlinear or expert qlinear reads."""
    q, at = (use, 1) if isinstance(use, str) else use
    t = graph.node(graph.operands(q)[at]).type
    one = t.expert if isinstance(t, QExperts) else t
    assert isinstance(one, QWeight)
    return one


def _key(graph: Graph, use: Use) -> str:
    q, at = (use, 1) if isinstance(use, str) else use
    return str(graph.node(graph.operands(q)[at]).attr("key"))


def _drop_residual(graph: Graph, combine: str) -> None:
    """An expert combine without its residual operand: rank 0's alone adds it."""
    graph.set_operands(combine, graph.operands(combine)[:-1])
    graph.set_node(combine, graph.node(combine).with_attrs(epilogue="combine"))


def _plain(graph: Graph, q: str) -> None:
    node = graph.node(q)
    fused = [k for k in ("prologue", "epilogue", "fused", "act_quant") if node.attr(k) is not None]
    if fused or len(graph.operands(q)) != 2:
        raise TensorParallelError(
            f"tensor_parallel: %{q} is a fused qlinear ({', '.join(fused) or 'several weights'}); "
            "run the pass on the unfused block"
        )


def _out(graph: Graph, q: str) -> int:
    t = graph.node(graph.operands(q)[1]).type
    assert isinstance(t, QWeight)
    return t.out_features


def _reinfer(graph: Graph) -> None:
    """Every computed value's type again from its operands' (narrowed weights and caches)."""
    for name, node in graph.items():
        ops = graph.operands(name)
        if not ops:
            continue
        types = [graph.node(o).type for o in ops]
        t = spec(node.op).infer(types, list(ops), dict(node.attrs))
        if t != node.type:
            assert isinstance(t, TensorType | TupleType)
            graph.set_node(name, replace(node, type=t))


# The splits' roots, attached to the op table as the interpreter and lowering attach theirs.
implement("attention", shard=TensorParallel._attention)
implement("qlinear", shard=TensorParallel._mlp)
implement("expert_qlinear", shard=TensorParallel._experts)
implement("sample", shard=TensorParallel._lm_head)
