"""The op table. Each spec infers its result type from operand types and attributes and raises
`IRTypeError` naming the operands on a mismatch; the builder calls it when a node is made and
the verifier calls it again on every node, so the table is the one source of legality."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qir import dtypes
from qir.errors import QirError
from qir.types import QWeight, TensorType, ValueType


class IRTypeError(QirError, TypeError):
    """An op got operands of the wrong shape, dtype or kind."""


Infer = Callable[[Sequence[ValueType], Sequence[str], Mapping[str, Any]], ValueType]


@dataclass(frozen=True)
class OpSpec:
    name: str
    arity: int
    infer: Infer
    attrs: frozenset[str] = frozenset()
    elementwise: bool = False


def _desc(name: str, t: ValueType) -> str:
    return f"%{name}: {t}"


def _tensor(op: str, names: Sequence[str], types: Sequence[ValueType], i: int) -> TensorType:
    t = types[i]
    if not isinstance(t, TensorType):
        raise IRTypeError(f"{op}: operand {i} ({_desc(names[i], t)}) must be an activation tensor")
    return t


def _activation(op: str, names: Sequence[str], types: Sequence[ValueType], i: int) -> TensorType:
    t = _tensor(op, names, types, i)
    if t.dtype not in dtypes.ACTIVATION:
        raise IRTypeError(
            f"{op}: operand {i} ({_desc(names[i], t)}) must be one of "
            f"{', '.join(d.name for d in dtypes.ACTIVATION)}"
        )
    if t.rank != 2:
        raise IRTypeError(f"{op}: operand {i} ({_desc(names[i], t)}) must be 2-D [M, features]")
    return t


def _infer_leaf(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    raise AssertionError("leaf types are given, not inferred")


def _infer_qlinear(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    x = _activation("qlinear", names, types, 0)
    w = types[1]
    if not isinstance(w, QWeight):
        raise IRTypeError(f"qlinear: operand 1 ({_desc(names[1], w)}) must be a weight")
    if x.shape[1] != w.in_features:
        raise IRTypeError(
            f"qlinear: input {_desc(names[0], x)} has {x.shape[1]} features but weight "
            f"{_desc(names[1], w)} has in_features {w.in_features}"
        )
    return TensorType((x.shape[0], w.out_features), x.dtype)


def _infer_unary(op: str) -> Infer:
    def infer(
        types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
    ) -> ValueType:
        return _activation(op, names, types, 0)

    return infer


def _infer_binary(op: str) -> Infer:
    def infer(
        types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
    ) -> ValueType:
        a = _activation(op, names, types, 0)
        b = _activation(op, names, types, 1)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise IRTypeError(
                f"{op}: operands differ: {_desc(names[0], a)} vs {_desc(names[1], b)} "
                "(shapes and dtypes must match)"
            )
        return a

    return infer


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("input", 0, _infer_leaf),
        OpSpec("weight", 0, _infer_leaf, frozenset({"key"})),
        OpSpec("qlinear", 2, _infer_qlinear),
        OpSpec("silu", 1, _infer_unary("silu"), elementwise=True),
        OpSpec("mul", 2, _infer_binary("mul"), elementwise=True),
        OpSpec("add", 2, _infer_binary("add"), elementwise=True),
    )
}


def spec(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise IRTypeError(f"unknown op {op!r}; known: {', '.join(OPS)}") from None
