"""The numpy reference: evaluates any graph, fused or not.

Numerics mirror the kernels: weights are dequantized exactly in float32, products accumulate in
float32, and every op rounds its result to the value's dtype (so a f16 block rounds between ops
just as the kernels store f16 between launches)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qir.errors import QirError
from qir.formats import ACT_QUANTIZERS
from qir.graph import Graph, Node
from qir.ops import ACT_SCALE_ATTRS, W4A4_MAX_M, qlinear_layout
from qir.types import QWeight, TensorType, TupleType

Weights = Mapping[str, Mapping[str, np.ndarray]]


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
    """The kernel-layout buffers given for a weight node, checked against its format."""
    w = node.type
    assert isinstance(w, QWeight)
    key = node.attr("key")
    if key not in weights:
        raise BindError(f"weight {key!r} was not given")
    bufs = weights[key]
    w.format.check_buffers(bufs, w.out_features, w.in_features, where=key)
    return bufs


def dequantized(node: Node, weights: Weights) -> np.ndarray:
    w = node.type
    assert isinstance(w, QWeight)
    return w.format.dequantize(weight_buffers(node, weights), w.out_features, w.in_features)


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def silu(a: np.ndarray) -> np.ndarray:
    return a / (np.float32(1) + np.exp(-a))


_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "silu": silu,
    "mul": np.multiply,
    "add": np.add,
}


def quantize_act(scheme: str, x: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    rule = {k: v for k, v in attrs.items() if k in ACT_SCALE_ATTRS}
    return ACT_QUANTIZERS[scheme](_f32(x), **rule)


def _qlinear(node: Node, args: list[np.ndarray]) -> np.ndarray | tuple[np.ndarray, ...]:
    """Fused or not, the same numerics as the unfused ops: the prologue (or the silu_mul epilogue)
    rounds silu(g) and the product to the act dtype like separate silu/mul ops would, the
    residual epilogue adds the residual to the rounded projection."""
    attrs = dict(node.attrs)
    ins, ws, extras = qlinear_layout(len(args), attrs)
    m = args[0].shape[0]
    t = node.type.elements[0] if isinstance(node.type, TupleType) else node.type
    assert isinstance(t, TensorType)
    dt = t.dtype.np
    if attrs.get("prologue") == "silu_mul":
        g, u = args[ins]
        x = _silu_mul(g, u, dt)
        scheme = attrs.get("act_quant")
        if isinstance(scheme, str) and m <= W4A4_MAX_M:
            x = quantize_act(scheme, x, attrs)
    else:
        (x,) = args[ins]
    outs = [(_f32(x) @ w.T).astype(dt) for w in args[ws]]
    if attrs.get("epilogue") == "residual":
        (r,) = args[extras]
        outs = [(_f32(r) + _f32(outs[0])).astype(dt)]
    elif attrs.get("epilogue") == "silu_mul":
        outs = [_silu_mul(outs[0], outs[1], dt)]
    return tuple(outs) if isinstance(node.type, TupleType) else outs[0]


def _silu_mul(g: np.ndarray, u: np.ndarray, dt: Any) -> np.ndarray:
    """silu(g) * u rounded to the act dtype after the silu and after the product, as the
    separate silu and mul ops round."""
    return (silu(_f32(g)).astype(dt).astype(np.float32) * _f32(u)).astype(dt)


def evaluate(graph: Graph, inputs: Mapping[str, np.ndarray], weights: Weights) -> dict[str, Any]:
    """Every value of the graph (weights dequantized, tuples as tuples), by value name."""
    bind_inputs(graph, inputs)
    env: dict[str, Any] = {}
    for name, node in graph.items():
        args = [env[o] for o in graph.operands(name)]
        if node.op == "input":
            env[name] = inputs[name]
        elif node.op == "weight":
            env[name] = dequantized(node, weights)
        elif node.op == "qlinear":
            env[name] = _qlinear(node, args)
        elif node.op == "quantize_act":
            # Above W4A4_MAX_M rows the kernels run the 16-bit path, so the value is x itself.
            (x,) = args
            env[name] = (
                quantize_act(node.attr("scheme"), x, dict(node.attrs))
                if x.shape[0] <= W4A4_MAX_M
                else _f32(x)
            )
        elif node.op == "get":
            env[name] = args[0][node.attr("index")]
        else:
            assert isinstance(node.type, TensorType)
            result = _ELEMENTWISE[node.op](*(_f32(a) for a in args))
            env[name] = result.astype(node.type.dtype.np)
    return env


def interpret(
    graph: Graph, inputs: Mapping[str, np.ndarray], weights: Weights
) -> dict[str, np.ndarray]:
    """The block's outputs, by output name."""
    env = evaluate(graph, inputs, weights)
    return {out: env[value] for out, value in graph.outputs}
