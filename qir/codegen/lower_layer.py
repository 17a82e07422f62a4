"""Lowering of the layer ops (rms_norm, rope, kv_append, attention, embedding, sample): each returns
its launches and the temps they pass between them (see Plan.temps).

Attention takes two kernel families by what a run's rows are (qir.codegen.plan.ROWS): rows of
many sequences (a decode batch) the split-K decode kernel (every cache split in its own block,
then a combine launch reading their partials from a temp), rows of one sequence (a prefill) the
tiled kernel. Both read positions (and block tables) from device buffers, so a captured decode
step replays at any position."""

from __future__ import annotations

from collections.abc import Callable

from qir.codegen.layer_kernels import (
    PREFILL_ROWS,
    AttentionSpec,
    CacheShape,
    HeadNorm,
    RopeSpec,
    adjust_logits_kernel,
    attention_combine_kernel,
    attention_prefill_kernel,
    attention_split_kernel,
    embedding_kernel,
    kv_append_kernel,
    logprobs_kernel,
    rms_norm_kernel,
    rope_kernel,
    sample_kernel,
)
from qir.codegen.plan import ALL_M, Arg, Launch, results
from qir.dtypes import F32
from qir.graph import Graph
from qir.ops import W4A4_MAX_M, Op, layout
from qir.types import QWeight, TensorType

Lowered = tuple[list[Launch], dict[str, TensorType]]


def _tensor(graph: Graph, name: str) -> TensorType:
    t = graph.node(name).type
    assert isinstance(t, TensorType)
    return t


def _int(d: object) -> int:
    assert isinstance(d, int)
    return d


def _cache(graph: Graph, op: str) -> CacheShape:
    """The cache a kv_append or attention reads, paged where it takes a block table."""
    operands, segments = graph.operands(op), layout(graph, op)
    t = _tensor(graph, operands[segments["k_cache"]][0])
    at = segments.at("pages")
    pages = _tensor(graph, operands[at]).shape[1] if at is not None else 0
    page = graph.node(op).attr("page_size") or 0
    window = graph.node(op).attr("window") or 0
    return CacheShape(
        t.dtype, _int(t.shape[0]), _int(t.shape[1]), _int(t.shape[2]), page, _int(pages), window
    )


def _only_as_norm_source(graph: Graph, name: str) -> bool:
    """Whether every reader of this rms_norm is a quantize_act that computes the norm itself
    (norm_act_quant): then it only runs where they fall back to 16 bits."""
    users = graph.users(name)
    return (
        bool(users)
        and all(v != name for _, v in graph.outputs)
        and all(graph.node(u).op == Op.QUANTIZE_ACT and graph.operands(u)[0] == name for u in users)
    )


def lower_rms_norm(graph: Graph, name: str) -> Lowered:
    x, w = graph.operands(name)
    t, wt = _tensor(graph, name), _tensor(graph, w)
    n = _int(wt.shape[0])
    groups = _int(t.shape[1]) // n  # a per-head norm: a block per group
    kernel = rms_norm_kernel(t.dtype, wt.dtype, n, graph.node(name).attr("eps"), groups)
    args = (Arg("value", x), Arg("weight", w, "weight"), Arg("value", name), Arg("M"))
    when = (W4A4_MAX_M + 1, ALL_M[1]) if _only_as_norm_source(graph, name) else ALL_M
    return [Launch(kernel, groups, 1, args, (name,), (name,), when)], {}


def lower_norm_residual(graph: Graph, name: str) -> Lowered:
    x, w, r = graph.operands(name)
    t, wt = _tensor(graph, name), _tensor(graph, w)
    n = _int(wt.shape[0])
    groups = _int(t.shape[1]) // n
    eps = graph.node(name).attr("eps")
    kernel = rms_norm_kernel(t.dtype, wt.dtype, n, eps, groups, residual=True)
    args = (
        Arg("value", x),
        Arg("weight", w, "weight"),
        Arg("value", r),
        Arg("value", name),
        Arg("M"),
    )
    return [
        Launch(kernel, groups, 1, args, (name,), (name, *graph.node(name).attr("fused", ())))
    ], {}


def _cache_args(graph: Graph, name: str) -> tuple[HeadNorm | None, tuple[Arg, ...]]:
    """A kv_append's or attention's head-norm prologue, if any, and its operands as kernel
    arguments in order (the values; the block table; the norm's weight)."""
    node = graph.node(name)
    segments = layout(graph, name)
    at = segments.at("norm")
    # the parameter vectors (kv_append has no sinks)
    params = {segments.at(s) for s in ("norm", "sinks") if s in segments.spans} - {None}
    operands = graph.operands(name)
    args = tuple(
        Arg("weight", o, "weight") if i in params else Arg("value", o)
        for i, o in enumerate(operands)
    )
    if at is None:
        return None, args
    return HeadNorm(_tensor(graph, operands[at]).dtype, node.attr("norm_eps")), args


def lower_rope(graph: Graph, name: str) -> Lowered:
    x, pos = graph.operands(name)
    t = _tensor(graph, name)
    r = RopeSpec.of(dict(graph.node(name).attrs))
    assert r is not None
    heads = _int(t.shape[1]) // dict(r.attrs)["head_dim"]
    args = (Arg("value", x), Arg("value", pos), Arg("value", name), Arg("M"))
    return [Launch(rope_kernel(t.dtype, heads, r), 1, 1, args, (name,), (name,))], {}


def lower_kv_append(graph: Graph, name: str) -> Lowered:
    norm, operands = _cache_args(graph, name)
    rope = RopeSpec.of(dict(graph.node(name).attrs))
    kernel = kv_append_kernel(_cache(graph, name), rope, norm)
    # The caches are written in place: the args are the states, the gets alias them.
    args = (*operands, Arg("M"))
    return [Launch(kernel, 1, 1, args, graph.users(name), (name,))], {}


def lower_attention(graph: Graph, name: str) -> Lowered:
    node = graph.node(name)
    cache = _cache(graph, name)
    heads = _int(_tensor(graph, name).shape[1]) // cache.head_dim
    norm, reads = _cache_args(graph, name)
    sinks = layout(graph, name).at("sinks") is not None
    spec = AttentionSpec(
        cache,
        heads,
        node.attr("scale"),
        RopeSpec.of(dict(node.attrs)),
        norm,
        softcap=node.attr("softcap"),
        sinks=sinks,
    )
    # the sinks (the last operand) go to the combine and the prefill kernels, not the splits
    split_reads, sink_args = (reads[:-1], reads[-1:]) if sinks else (reads, ())
    part = graph.fresh(f"{name}.partials")
    launches = [
        Launch(
            attention_split_kernel(spec),
            cache.kv_heads * spec.splits,
            1,
            (*split_reads, Arg("value", part), Arg("M")),
            (part,),
            (name,),
            ALL_M,
            "many",
        ),
        Launch(
            attention_combine_kernel(spec),
            heads,
            1,
            (Arg("value", part), *sink_args, Arg("value", name), Arg("M")),
            (name,),
            (name,),
            ALL_M,
            "many",
        ),
        Launch(
            attention_prefill_kernel(spec),
            heads,
            PREFILL_ROWS,
            (*reads, Arg("value", name), Arg("M")),
            (name,),
            (name,),
            ALL_M,
            "one",
        ),
    ]
    return launches, {part: TensorType(("M", spec.partial_floats), F32)}


def lower_embedding(graph: Graph, name: str) -> Lowered:
    ids, table = graph.operands(name)
    w = graph.node(table).type
    assert isinstance(w, QWeight)
    scale = graph.node(name).attr("scale")
    kernel, grid_x, buffers = embedding_kernel(w, _tensor(graph, name).dtype, scale)
    args = (
        Arg("value", ids),
        *(Arg("weight", table, b) for b in buffers),
        Arg("value", name),
        Arg("M"),
    )
    return [Launch(kernel, grid_x, 1, args, (name,), (name,))], {}


def lower_sample(graph: Graph, name: str) -> Lowered:
    logits = graph.operands(name)[0]
    t = _tensor(graph, logits)
    kernel = sample_kernel(t.dtype, _int(t.shape[1]))
    args = (*(Arg("value", a) for a in graph.operands(name)), Arg("value", name), Arg("M"))
    return [Launch(kernel, 1, 1, args, (name,), (name,))], {}


def lower_adjust_logits(graph: Graph, name: str) -> Lowered:
    operands = graph.operands(name)
    t, entries = _tensor(graph, operands[0]), _tensor(graph, operands[2])
    kernel = adjust_logits_kernel(t.dtype, _int(t.shape[1]), _int(entries.shape[1]))
    args = (*(Arg("value", a) for a in operands), Arg("value", name), Arg("M"))
    return [Launch(kernel, 1, 1, args, (name,), (name,))], {}


def lower_logprobs(graph: Graph, name: str) -> Lowered:
    operands = graph.operands(name)
    t = _tensor(graph, operands[0])
    temps: dict[str, TensorType] = {}
    ids, values = results(graph, name, temps)
    kernel = logprobs_kernel(t.dtype, _int(t.shape[1]), graph.node(name).attr("k"))
    args = (*(Arg("value", a) for a in operands), Arg("value", ids), Arg("value", values), Arg("M"))
    return [Launch(kernel, 1, 1, args, (ids, values), (name,))], temps


LAYER_LOWERINGS: dict[str, Callable[[Graph, str], Lowered]] = {
    "rms_norm": lower_rms_norm,
    "norm_residual": lower_norm_residual,
    "rope": lower_rope,
    "kv_append": lower_kv_append,
    "attention": lower_attention,
    "embedding": lower_embedding,
    "sample": lower_sample,
    "adjust_logits": lower_adjust_logits,
    "logprobs": lower_logprobs,
}
