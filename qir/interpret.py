"""The numpy reference: evaluates any graph, fused or not.

Numerics mirror the kernels: weights are dequantized exactly in float32, products accumulate in
float32, and every op rounds its result to the value's dtype (so a f16 block rounds between ops
just as the kernels store f16 between launches)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qir import collectives, logits, moe, rope, sampling
from qir.errors import QirError, Unsupported
from qir.formats import ACT_QUANTIZERS
from qir.graph import Graph, Node
from qir.ops import (
    ACT_SCALE_ATTRS,
    W4A4_MAX_M,
    Op,
    implement,
    layout,
    spec,
)
from qir.types import QExperts, QWeight, TensorType, TupleType

Weights = Mapping[str, Mapping[str, np.ndarray]]
# A weight node's dequantized value and its bias (evaluate's `kept`).
Kept = tuple[np.ndarray, np.ndarray | None]


class BindError(QirError, ValueError):
    """Inputs or weights given to a block do not match its declared types."""


def bind_inputs(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Check inputs against the graph's declared types; return the symbolic sizes (e.g. M)."""
    return check_inputs(declared_inputs(graph), inputs)


def declared_inputs(graph: Graph) -> dict[str, TensorType]:
    """The graph's inputs and their types, in order."""
    declared = {}
    for name in graph.inputs:
        t = graph.node(name).type
        assert isinstance(t, TensorType)
        declared[name] = t
    return declared


def check_inputs(
    declared: Mapping[str, TensorType], inputs: Mapping[str, np.ndarray]
) -> dict[str, int]:
    """`bind_inputs` against inputs listed once (a compiled block checks every run)."""
    sizes: dict[str, int] = {}
    for name, t in declared.items():
        if name not in inputs:
            raise BindError(
                f"input %{name} ({t}) was not given; given: {', '.join(inputs) or 'none'}"
            )
        a = inputs[name]
        if a.ndim != t.rank:
            raise BindError(f"input %{name}: shape {list(a.shape)}, expected {t}")
        if a.dtype != t.dtype.np:
            raise BindError(f"input %{name}: dtype {a.dtype}, expected {t.dtype.name} ({t})")
        for got, want in zip(a.shape, t.shape, strict=True):
            if isinstance(want, str):
                if sizes.setdefault(want, got) != got:
                    raise BindError(
                        f"input %{name}: {want}={got} but another input has {want}={sizes[want]}"
                    )
                if got < 1:
                    raise BindError(f"input %{name}: {want} must be at least 1, got {got}")
            elif got != want:
                raise BindError(f"input %{name}: shape {list(a.shape)}, expected {t}")
    unknown = set(inputs) - set(declared)
    if unknown:
        raise BindError(f"unknown inputs {sorted(unknown)}; the block takes {list(declared)}")
    return sizes


def weight_buffers(node: Node, weights: Weights) -> Mapping[str, np.ndarray]:
    """The kernel-layout buffers given for a weight node, checked against its format (a
    parameter tensor is one buffer, "weight", of its declared shape and dtype)."""
    w = node.type
    key = node.attr("key")
    if key not in weights:
        raise BindError(f"weight {key!r} was not given")
    bufs = weights[key]
    if isinstance(w, TensorType):
        a = bufs.get("weight")
        if a is None or a.shape != w.shape or a.dtype != w.dtype.np:
            got = "nothing" if a is None else f"{a.dtype} {list(a.shape)}"
            raise BindError(f"weight {key!r}: buffer 'weight' is {got}, expected {w}")
        return bufs
    if isinstance(w, QExperts):
        check_expert_buffers(w, bufs, key)
        return bufs
    assert isinstance(w, QWeight)
    w.format.check_buffers(bufs, w.out_features, w.in_features, where=key)
    if w.bias:
        b = bufs.get("bias")
        want = w.buffers()["bias"]
        if b is None or b.shape != want.shape or b.dtype != want.dtype.np:
            got = "nothing" if b is None else f"{b.dtype} {list(b.shape)}"
            raise BindError(f"weight {key!r}: buffer 'bias' is {got}, expected {want}")
        if not np.all(np.isfinite(b)):
            raise BindError(f"weight {key!r}: buffer 'bias' contains NaN or Inf")
    return bufs


def bias(node: Node, weights: Weights) -> np.ndarray | None:
    """The float32 bias a weight node carries, or None."""
    w = node.type
    if isinstance(w, QExperts):  # stacked: [E, out]
        w = w.expert
    if not isinstance(w, QWeight) or not w.bias:
        return None
    return np.asarray(weights[node.attr("key")]["bias"], np.float32)


def check_expert_buffers(w: QExperts, bufs: Mapping[str, np.ndarray], key: str) -> None:
    """Stacked expert buffers: each of the expert format's buffers with a leading dim of
    w.count, every expert's slice checked as one weight (naming `key`.<buffer>[e])."""
    for name, t in w.buffers().items():
        a = bufs.get(name)
        if a is None or a.shape != t.shape or a.dtype != t.dtype.np:
            got = "nothing" if a is None else f"{a.dtype} {list(a.shape)}"
            raise BindError(f"weight {key!r}: buffer {name!r} is {got}, expected {t}")
    for e in range(w.count):
        one = {n: bufs[n][e] for n in w.buffers()}
        w.format.check_buffers(one, w.out_features, w.in_features, where=f"{key}[{e}]")


def dequantized(node: Node, weights: Weights) -> np.ndarray:
    w = node.type
    if isinstance(w, TensorType):
        return _f32(weight_buffers(node, weights)["weight"])
    if isinstance(w, QExperts):
        bufs = weight_buffers(node, weights)
        return np.stack(
            [
                w.format.dequantize(
                    {n: bufs[n][e] for n in w.buffers()}, w.out_features, w.in_features
                )
                for e in range(w.count)
            ]
        )
    assert isinstance(w, QWeight)
    return w.format.dequantize(weight_buffers(node, weights), w.out_features, w.in_features)


def state_keys(graph: Graph) -> dict[str, TensorType]:
    """The graph's states (KV caches) by key, with their types."""
    out = {}
    for name in graph.of_op(Op.STATE):
        node = graph.node(name)
        assert isinstance(node.type, TensorType)
        out[node.attr("key")] = node.type
    return out


def empty_state(graph: Graph) -> dict[str, np.ndarray]:
    """Zeroed states for `graph` (an empty KV cache)."""
    return {k: np.zeros(t.concrete({}), t.dtype.np) for k, t in state_keys(graph).items()}


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def silu(a: np.ndarray) -> np.ndarray:
    result: np.ndarray = a / (np.float32(1) + np.exp(-a))
    return result


def gelu_tanh(a: np.ndarray) -> np.ndarray:
    """gelu's tanh approximation (torch's approximate="tanh"), float32."""
    c = np.float32(math.sqrt(2.0 / math.pi))
    inner = c * (a + np.float32(0.044715) * a * a * a)
    result: np.ndarray = np.float32(0.5) * a * (np.float32(1) + np.tanh(inner))
    return result


def softcap(a: np.ndarray, cap: float) -> np.ndarray:
    """tanh(a / cap) * cap in float32 (Gemma's logit soft-capping)."""
    c = np.float32(cap)
    return np.tanh(_f32(a) / c) * c


# The gate activations a qlinear's gate/up epilogue or prologue may apply (its `act` attribute).
GATE_ACTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"silu": silu, "gelu_tanh": gelu_tanh}

_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    **GATE_ACTS,
    "mul": np.multiply,
    "add": np.add,
}


def quantize_act(scheme: str, x: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    rule = {k: v for k, v in attrs.items() if k in ACT_SCALE_ATTRS}
    return ACT_QUANTIZERS[scheme](_f32(x), **rule)


def _qlinear(
    node: Node, args: list[np.ndarray], biases: list[np.ndarray | None]
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Fused or not, the same numerics as the unfused ops: the prologue (or the silu_mul epilogue)
    rounds silu(g) and the product to the act dtype like separate silu/mul ops would (an
    rms_norm prologue rounds the normalised row as rms_norm stores it), the residual epilogue
    adds the residual to the rounded projection. A weight's bias (`biases`, one per weight) joins
    its float32 sums before they round."""
    attrs = dict(node.attrs)
    if attrs.get("prologue") == "norm_residual":
        # h = r + rms_norm(x, pw) as norm_residual stores it, then the rms_norm prologue on h
        # (h is the node's last result)
        x, pw, r = args[:3]
        res_eps = attrs["res_eps"]
        assert isinstance(res_eps, float)
        h = (_f32(r) + _f32(rms_norm(x, pw, res_eps).astype(r.dtype))).astype(r.dtype)
        assert isinstance(node.type, TupleType)
        elements = node.type.elements[:-1]
        inner = Node(
            "qlinear",
            elements[0] if len(elements) == 1 else TupleType(elements),
            tuple((k, "rms_norm" if k == "prologue" else v) for k, v in node.attrs),
        )
        ys = _qlinear(inner, [h, *args[3:]], biases)
        return (*(ys if isinstance(ys, tuple) else (ys,)), h)
    segments = spec("qlinear").layout(len(args), attrs)
    ins, ws, extras = segments["inputs"], segments["weights"], segments["residual"]
    m = args[0].shape[0]
    t = node.type.elements[0] if isinstance(node.type, TupleType) else node.type
    assert isinstance(t, TensorType)
    dt = t.dtype.np
    gate = GATE_ACTS[str(attrs.get("act", "silu"))]
    if attrs.get("prologue") == "silu_mul":
        g, u = args[ins]
        x = _silu_mul(g, u, dt, gate)
        scheme = attrs.get("act_quant")
        if isinstance(scheme, str) and m <= W4A4_MAX_M:
            x = quantize_act(scheme, x, attrs)
    elif attrs.get("prologue") == "rms_norm":
        x, nw = args[ins]
        eps = attrs["eps"]
        assert isinstance(eps, float)
        x = rms_norm(x, nw, eps).astype(dt)
    else:
        (x,) = args[ins]
    outs = [
        (_f32(x) @ w.T + (np.float32(0) if b is None else b)).astype(dt)
        for w, b in zip(args[ws], biases, strict=True)
    ]
    if attrs.get("epilogue") == "residual":
        (r,) = args[extras]
        outs = [(_f32(r) + _f32(outs[0])).astype(dt)]
    elif attrs.get("epilogue") == "silu_mul":
        outs = [_silu_mul(outs[0], outs[1], dt, gate)]
    elif attrs.get("epilogue") == "softcap":
        cap = attrs["cap"]
        assert isinstance(cap, float)
        outs = [softcap(outs[0], cap).astype(dt)]
    return tuple(outs) if isinstance(node.type, TupleType) else outs[0]


def _silu_mul(
    g: np.ndarray, u: np.ndarray, dt: Any, gate: Callable[[np.ndarray], np.ndarray] = silu
) -> np.ndarray:
    """gate(g) * u (silu, or the node's act) rounded to the act dtype after the activation and
    after the product, as the separate activation and mul ops round."""
    result: np.ndarray = (gate(_f32(g)).astype(dt).astype(np.float32) * _f32(u)).astype(dt)
    return result


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """float32: x / sqrt(mean(x^2) + eps) * w, per row, or per group of len(w) features of a
    row (per head)."""
    x = _f32(x)
    g = x.reshape(*x.shape[:-1], -1, w.shape[-1])
    ms = np.mean(g * g, axis=-1, keepdims=True, dtype=np.float32)
    result: np.ndarray = (g / np.sqrt(ms + np.float32(eps)) * _f32(w)).reshape(x.shape)
    return result


def _check_span(node: Node, positions: np.ndarray, span: int, what: str) -> None:
    """Positions from -1 (padding) up: below span, or any with a window (a ring)."""
    top = positions.max() if node.attr("window") is None else -1
    if positions.size and (positions.min() < -1 or top >= span):
        raise BindError(
            f"{node.op}: positions {positions.min()}..{positions.max()} are outside {what}"
        )


def _slots(node: Node, positions: np.ndarray, span: int) -> np.ndarray:
    """Where positions sit among a sequence's `span` (a window's ring wraps them)."""
    return positions % span if node.attr("window") is not None else positions


def _pages(
    node: Node, args: list[np.ndarray], cache: np.ndarray, positions_at: int
) -> np.ndarray | None:
    """int64 [M, S]: where row m's positions 0..S-1 sit in a paged cache (S: the positions a
    block table holds): table[m, p // page_size] * page_size + p % page_size. None without a
    block table (segment pages), where position p is row p. Positions (the operand
    before the block table; -1 for a padding row) must fit, and so must the pages a row reads
    or writes; `positions_at`: the positions' operand (kv_append's 4, attention's 3)."""
    positions = args[positions_at]
    at = spec(node.op).layout(len(args), dict(node.attrs)).at("pages")
    if at is None:
        _check_span(node, positions, cache.shape[0], f"the KV cache of {cache.shape[0]} rows")
        return None
    table, page = args[at], node.attr("page_size")
    span = table.shape[1] * page
    _check_span(node, positions, span, f"the {span} a block table of {table.shape[1]} pages holds")
    pages = cache.shape[0] // page
    last = np.minimum(positions, span - 1)  # a ring's row past its span uses every page
    needed = (np.arange(table.shape[1])[None, :] <= last[:, None] // page) & (
        positions[:, None] >= 0
    )
    used = table[needed]
    if used.size and (used.min() < 0 or used.max() >= pages):
        raise BindError(
            f"{node.op}: block table pages {used.min()}..{used.max()} are outside the pool of "
            f"{pages} pages"
        )
    p = np.arange(span)
    rows: np.ndarray = np.clip(table, 0, pages - 1)[:, p // page] * page + p % page
    return rows


def kv_append(node: Node, args: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """New caches (copies) with row m of k and v at positions[m] (padding rows, at -1, write
    nothing); each head of k normed by a head-norm prologue, then rotated by a rope prologue
    (each rounded, as the ops would)."""
    kc, vc, k, v, positions = args[:5]
    attrs = dict(node.attrs)
    rows = _pages(node, args, kc, 4)
    norm = spec("kv_append").layout(len(args), attrs).at("norm")
    if norm is not None:
        k = rms_norm(k, args[norm], node.attr("norm_eps")).astype(kc.dtype)
    if "rope_type" in attrs:
        k = rope.rotate(k, positions, attrs).astype(kc.dtype)
    kc, vc = kc.copy(), vc.copy()
    real = positions >= 0
    slots = _slots(node, positions[real], kc.shape[0] if rows is None else rows.shape[1])
    at = slots if rows is None else rows[np.flatnonzero(real), slots]
    kc[at] = k[real].reshape(len(at), *kc.shape[1:])
    vc[at] = v[real].reshape(len(at), *vc.shape[1:])
    return kc, vc


def attention(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """float32 softmax(q k^T * scale) v per head, row m over its positions 0..positions[m]
    (zeros for a padding row, at -1); q through its prologues (head norm, rope) first; with
    `softcap` the scaled scores soft-capped before the softmax; sinks join each head's
    denominator."""
    q, kc, vc, positions = args[:4]
    attrs = dict(node.attrs)
    rows = _pages(node, args, kc, 3)
    m, (_, kv_heads, d) = q.shape[0], kc.shape
    segments = spec("attention").layout(len(args), attrs)
    norm = segments.at("norm")
    if norm is not None:
        q = rms_norm(q, args[norm], node.attr("norm_eps")).astype(q.dtype)
    if "rope_type" in attrs:
        q = rope.rotate(q, positions, attrs).astype(q.dtype)
    qh = _f32(q).reshape(m, kv_heads, -1, d)  # [M, kv_heads, group, D]
    out = np.zeros_like(qh)
    if rows is None:
        groups = [(np.arange(m), np.arange(kc.shape[0]))]
    else:  # rows sharing a block table (one sequence's) gather its keys once
        tables, which = np.unique(rows, axis=0, return_inverse=True)
        groups = [(np.flatnonzero(which.ravel() == i), t) for i, t in enumerate(tables)]
    scale = np.float32(node.attr("scale"))
    window, cap = node.attr("window"), node.attr("softcap")
    at = segments.at("sinks")
    # [1, kv_heads, group, 1], as the scores' heads
    sinks = None if at is None else _f32(args[at]).reshape(1, kv_heads, -1, 1)
    for members, where in groups:
        keys, values = _f32(kc[where]), _f32(vc[where])  # [S, kv_heads, D]
        scores = np.einsum("mkgd,ckd->mkgc", qh[members], keys) * scale
        if cap is not None:
            scores = softcap(scores, cap)
        pm, slot = positions[members, None], np.arange(len(where))[None, :]
        if window is None:
            visible = slot <= pm
        else:  # slot s holds position p - ((p - s) mod S): visible within the window
            _check_ring(positions[members], len(where), window)
            visible = (pm - slot) % len(where) < np.minimum(window, pm + 1)
        scores = np.where(visible[:, None, None, :], scores, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        if sinks is not None:  # one more logit per head in the denominator
            top = np.maximum(top, sinks)
        p = np.exp(scores - np.where(np.isfinite(top), top, 0))
        total = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total = total + np.where(pm[:, :, None, None] >= 0, np.exp(sinks - top), 0)
        p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
        out[members] = np.einsum("mkgc,ckd->mkgd", p, values)
    result: np.ndarray = out.reshape(m, -1)
    return result


def _check_ring(positions: np.ndarray, span: int, window: int) -> None:
    """One run's rows of a sequence write their keys before any reads the ring: the earliest
    row's window must not have been overwritten by the latest row's key."""
    real = positions[positions >= 0]
    if real.size and real.max() - real.min() + window > span:
        raise BindError(
            f"attention: positions {real.min()}..{real.max()} of one sequence in one run need "
            f"{real.max() - real.min() + window} positions of a ring of {span} (window "
            f"{window}): run at most {span - window + 1} at a time"
        )


def embedding(node: Node, args: list[np.ndarray]) -> np.ndarray:
    ids, table = args
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise BindError(
            f"embedding: token ids {ids.min()}..{ids.max()} are outside the vocabulary of "
            f"{table.shape[0]}"
        )
    rows: np.ndarray = table[ids]
    scale = node.attr("scale")
    if scale is not None:  # the gathered row rounds, then the product (as transformers' Gemma)
        dt = node.type.dtype.np if isinstance(node.type, TensorType) else np.float32
        rows = (_f32(rows.astype(dt)) * np.float32(scale)).astype(dt)
    return rows


def evaluate(
    graph: Graph,
    inputs: Mapping[str, np.ndarray],
    weights: Weights,
    state: MutableMapping[str, np.ndarray] | None = None,
    comm: collectives.Comm | None = None,
    kept: MutableMapping[str, Kept] | None = None,
) -> dict[str, Any]:
    """Every value of the graph (weights dequantized, tuples as tuples), by value name.

    `state`: the KV caches by key; a run reads them and stores the caches its kv_appends wrote
    back into the mapping (it is the block's state, not an input). Missing keys start empty
    (zeros); None: every state starts empty and nothing is kept. `comm`: this rank's end of
    its tensor-parallel group (qir.collectives), where the graph has collectives over ranks.
    `kept`: each weight node's dequantized value and bias by node name, from earlier runs of
    this graph on these weights (read-only arrays), filled in by this one: a caller that runs
    the same block again (a generation's steps) dequantizes each weight once."""
    bind_inputs(graph, inputs)
    env: dict[str, Any] = {}
    biases: dict[str, np.ndarray | None] = {}
    states = state if state is not None else {}
    declared = state_keys(graph)
    for key, value in states.items():
        if key in declared and value.shape != declared[key].concrete({}):
            raise BindError(f"state {key!r}: shape {list(value.shape)}, expected {declared[key]}")
    run = Run(graph, inputs, weights, env, biases, states, {}, comm, kept)
    for name, node in graph.items():
        reference = spec(node.op).reference
        if reference is None:
            raise Unsupported(f"%{name} = {node.op}: the op has no interpreter reference")
        env[name] = reference(run, name, node, [env[o] for o in graph.operands(name)])
    if state is not None:
        state.update(run.written)
    return env


def _group(run: Run, name: str, node: Node) -> collectives.Comm | None:
    """The communicator of a collective over the node's ranks; None over one rank (a no-op)."""
    ranks = node.attr("ranks")
    if ranks == 1:
        return None
    comm = run.comm
    if comm is None or comm.size != ranks:
        have = "no communicator" if comm is None else f"a group of {comm.size}"
        raise BindError(f"%{name}: {node.op} over {ranks} ranks, but the run has {have}")
    return comm


def _all_reduce(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    comm = _group(run, name, node)
    return (
        args[0] if comm is None else collectives.all_reduce(comm, args[0], f"%{name} = all_reduce")
    )


def _all_gather(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    comm = _group(run, name, node)
    if comm is None:
        result: np.ndarray = args[0]
        return result
    return collectives.all_gather(comm, args[0], node.attr("axis"), f"%{name} = all_gather")


ActScales = tuple[np.ndarray, str] | None


def expert_input_scales(graph: Graph, name: str, weights: Weights) -> ActScales:
    """The calibrated input scale of each expert of expert_qlinear `name` (W4A4: float32 [E] and
    the quantizer's keyword for it), or None where its format calibrated none. A gate/up pair
    quantizes its input once, so its gate and up experts' scales must be equal (they are where
    the producer calibrated both on that input)."""
    operands = graph.operands(name)
    types = [graph.node(o).type for o in operands]
    ws = layout(graph, name)["weights"]
    first = types[ws][0]
    assert isinstance(first, QExperts)
    attr = first.format.act_scale_attr()
    if attr is None:
        return None
    scales = [
        np.asarray(weight_buffers(graph.node(w), weights)["input_scale"], np.float32).reshape(-1)
        for w in operands[ws]
    ]
    for w, other in zip(operands[ws][1:], scales[1:], strict=True):
        if not np.array_equal(other, scales[0]):
            e = int(np.flatnonzero(other != scales[0])[0])
            raise BindError(
                f"%{name}: W4A4 experts %{operands[ws][0]} and %{w} differ in input_scale "
                f"(expert {e}: {scales[0][e]} and {other[e]}); a gate/up pair quantizes its "
                "input once (run it with --weight-quantization w4a16)"
            )
    return scales[0], attr


def expert_qlinear(
    node: Node,
    args: list[np.ndarray],
    biases: list[np.ndarray | None] | None = None,
    act_scales: ActScales = None,
) -> np.ndarray:
    """qir.moe's semantics: each slot's row through its expert (plus the expert's bias, in the
    float32 sums), rounded to the activation type as a qlinear's result (silu_mul: g, u, act(g)
    and the product each rounded, as qlinear's epilogue; swiglu_clamp rounds its gate and up
    factors so); combined in float32, rounded once, then the residual added and rounded
    again. An rms_norm prologue rounds the normalised rows as rms_norm stores them. With
    `act_quant` (at most W4A4_MAX_M rows) each slot's input is first quantized under its
    expert's scale (`act_scales`, as expert_input_scales gives them)."""
    epilogue = node.attr("epilogue")
    t = node.type
    assert isinstance(t, TensorType)
    dt = t.dtype.np
    if node.attr("prologue") == "rms_norm":
        eps = node.attr("eps")
        assert isinstance(eps, float)
        args = [rms_norm(args[0], args[1], eps).astype(dt), *args[2:]]
    n_w = 2 if epilogue == "silu_mul" else 1
    x, ws, ids = args[0], args[1 : 1 + n_w], args[1 + n_w]
    if ids.size and (ids.min() < 0 or ids.max() >= ws[0].shape[0]):
        raise BindError(
            f"expert_qlinear: expert ids {ids.min()}..{ids.max()} are outside the "
            f"{ws[0].shape[0]} experts"
        )
    xs = moe.per_slot(x, ids.shape[1])
    scheme = node.attr("act_quant")
    if scheme is not None and x.shape[0] <= W4A4_MAX_M:
        scales, attr = act_scales or (None, None)
        xs = moe.quantize_slots(xs, ids, ACT_QUANTIZERS[scheme], scales, attr)
    bs = biases or [None] * len(ws)
    ys = [moe.expert_matmul(xs, w, ids, b).astype(dt) for w, b in zip(ws, bs, strict=True)]
    if epilogue == "silu_mul":
        act = str(node.attr("act") or "silu")
        if act == "swiglu_clamp":
            limit, alpha = node.attr("limit"), node.attr("alpha")
            g = moe.swiglu_gate(_f32(ys[0]), limit, alpha).astype(dt)
            u = moe.swiglu_up(_f32(ys[1]), limit).astype(dt)
            result: np.ndarray = (_f32(g) * _f32(u)).astype(dt)
            return result
        return _silu_mul(ys[0], ys[1], dt, GATE_ACTS[act])
    if epilogue in ("combine", "combine_residual"):
        out = moe.combine(ys[0], args[2 + n_w]).astype(dt)
        if epilogue == "combine_residual":
            out = (_f32(args[3 + n_w]) + _f32(out)).astype(dt)
        return out
    return ys[0]


_LAYER_OPS: dict[str, Callable[[Node, list[np.ndarray]], np.ndarray]] = {
    "rms_norm": lambda node, args: rms_norm(args[0], args[1], node.attr("eps")),
    "norm_residual": lambda node, args: (
        _f32(args[2]) + _f32(rms_norm(args[0], args[1], node.attr("eps")).astype(args[2].dtype))
    ),
    "rope": lambda node, args: rope.rotate(args[0], args[1], dict(node.attrs)),
    "attention": attention,
    "embedding": embedding,
    "sample": lambda node, args: sampling.sample(*args),
    "adjust_logits": lambda node, args: logits.adjust_logits(*args),
}


@dataclass
class Run:
    """What an op's reference may read and write besides its operands' values: one evaluate."""

    graph: Graph
    inputs: Mapping[str, np.ndarray]
    weights: Weights
    env: dict[str, Any]
    biases: dict[str, np.ndarray | None]
    states: Mapping[str, np.ndarray]
    written: dict[str, np.ndarray]  # the caches kv_appends wrote, by state key
    comm: collectives.Comm | None
    kept: MutableMapping[str, Kept] | None  # evaluate's


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _weight(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    got = run.kept.get(name) if run.kept is not None else None
    if got is None:
        # dequantized checks the buffers, the bias's among them
        got = dequantized(node, run.weights), bias(node, run.weights)
        if run.kept is not None:  # read-only views (a dense weight may be the caller's array)
            got = _read_only(got[0]), None if got[1] is None else _read_only(got[1])
            run.kept[name] = got
    run.biases[name] = got[1]
    return got[0]


def _state(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    t = node.type
    assert isinstance(t, TensorType)
    return run.states.get(node.attr("key"), np.zeros(t.concrete({}), t.dtype.np))


def _kv_append(run: Run, name: str, node: Node, args: list[Any]) -> Any:
    out = kv_append(node, args)
    for i in (0, 1):
        run.written[run.graph.node(run.graph.operands(name)[i]).attr("key")] = out[i]
    return out


def _layer(fn: Callable[[Node, list[np.ndarray]], np.ndarray]) -> Callable[..., np.ndarray]:
    def reference(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
        assert isinstance(node.type, TensorType)
        return fn(node, args).astype(node.type.dtype.np)

    return reference


def _qlinear_ref(run: Run, name: str, node: Node, args: list[Any]) -> Any:
    ws = layout(run.graph, name)["weights"]
    return _qlinear(node, args, [run.biases[w] for w in run.graph.operands(name)[ws]])


def _quantize_act_ref(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    # Above W4A4_MAX_M rows the kernels run the 16-bit path, so the value is x itself. With an
    # RMSNorm prologue x is the rms_norm's result (operand 0), which the kernel forms from the
    # rms_norm's own operands, the same way.
    x = args[0]
    if x.shape[0] <= W4A4_MAX_M:
        return quantize_act(node.attr("scheme"), x, dict(node.attrs))
    return _f32(x)


def _expert_qlinear_ref(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    graph = run.graph
    ops = graph.operands(name)
    ws = layout(graph, name)["weights"]
    scales = expert_input_scales(graph, name, run.weights) if node.attr("act_quant") else None
    return expert_qlinear(node, args, [run.biases[w] for w in ops[ws]], scales)


def _softcap_ref(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    assert isinstance(node.type, TensorType)
    return softcap(args[0], node.attr("cap")).astype(node.type.dtype.np)


def _elementwise(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def reference(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
        assert isinstance(node.type, TensorType)
        return fn(*(_f32(a) for a in args)).astype(node.type.dtype.np)

    return reference


REFERENCES: dict[str, Callable[..., Any]] = {
    "input": lambda run, name, node, args: run.inputs[name],
    "weight": _weight,
    "state": _state,
    "kv_append": _kv_append,
    **{op: _layer(fn) for op, fn in _LAYER_OPS.items()},
    "qlinear": _qlinear_ref,
    "quantize_act": _quantize_act_ref,
    "route": lambda run, name, node, args: moe.route(args[0], node.attr("k"), node.attr("rule")),
    "logprobs": lambda run, name, node, args: logits.logprobs(
        args[0], args[1], args[2], node.attr("k")
    ),
    "expert_qlinear": _expert_qlinear_ref,
    "get": lambda run, name, node, args: args[0][node.attr("index")],
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "softcap": _softcap_ref,
    **{op: _elementwise(fn) for op, fn in _ELEMENTWISE.items()},
}
for _op, _reference in REFERENCES.items():
    implement(_op, reference=_reference)


def interpret(
    graph: Graph,
    inputs: Mapping[str, np.ndarray],
    weights: Weights,
    state: MutableMapping[str, np.ndarray] | None = None,
    comm: collectives.Comm | None = None,
    kept: MutableMapping[str, Kept] | None = None,
) -> dict[str, np.ndarray]:
    """The block's outputs, by output name (see `evaluate` for `state`, `comm` and `kept`)."""
    env = evaluate(graph, inputs, weights, state, comm, kept)
    return {out: env[value] for out, value in graph.outputs}
