"""Building graphs in code. Every call type-checks at once, so a shape or dtype mismatch is
reported at the call that caused it, naming both operands."""

from __future__ import annotations

from dataclasses import dataclass

from qir.dtypes import DType
from qir.graph import Graph, Node, check_name, make_attrs
from qir.ops import IRTypeError, activation_problem, spec
from qir.types import Dim, QWeight, TensorType, ValueType


@dataclass(frozen=True)
class Value:
    name: str
    type: ValueType

    def __str__(self) -> str:
        return f"%{self.name}"


class Builder:
    def __init__(self, name: str = "main") -> None:
        check_name(name, "graph")
        self.graph = Graph(name)

    def _fresh(self, name: str | None, op: str) -> str:
        if name is not None:
            if name in self.graph:
                raise ValueError(f"value name %{name} is already used in graph {self.graph.name}")
            return name
        i = len(self.graph)
        while f"{op}{i}" in self.graph:
            i += 1
        return f"{op}{i}"

    def _op(self, op: str, operands: tuple[Value, ...], name: str | None) -> Value:
        types = [o.type for o in operands]
        names = [o.name for o in operands]
        for o in operands:
            if self.graph.node(o.name).type != o.type:
                raise ValueError(f"{o} does not belong to graph {self.graph.name}")
        result = spec(op).infer(types, names, {})
        assert isinstance(result, TensorType)
        n = self.graph.add(self._fresh(name, op), Node(op, result), tuple(names))
        return Value(n, result)

    def input(self, name: str, shape: tuple[Dim, ...], dtype: DType) -> Value:
        """An activation input, shape ("M", features): M is bound by each run."""
        t = TensorType(tuple(shape), dtype)
        problem = activation_problem(t)
        if problem:
            raise IRTypeError(f"input %{name}: {t} {problem}")
        return Value(self.graph.add(self._fresh(name, "x"), Node("input", t)), t)

    def weight(
        self,
        key: str,
        weight: QWeight,
        name: str | None = None,
        act_rule: dict[str, float] | None = None,
    ) -> Value:
        """`act_rule`: the calibrated activation scale of a W4A4 weight
        (WeightFormat.act_quant_rule), kept on the node for W4A4 routing."""
        weight.format.check_shape(weight.out_features, weight.in_features)
        rule = {k: float(v) for k, v in (act_rule or {}).items()}
        node = Node("weight", weight, make_attrs(key=key, **rule))
        return Value(self.graph.add(self._fresh(name, "w"), node), weight)

    def qlinear(self, x: Value, w: Value, name: str | None = None) -> Value:
        return self._op("qlinear", (x, w), name)

    def silu(self, x: Value, name: str | None = None) -> Value:
        return self._op("silu", (x,), name)

    def mul(self, a: Value, b: Value, name: str | None = None) -> Value:
        return self._op("mul", (a, b), name)

    def add(self, a: Value, b: Value, name: str | None = None) -> Value:
        return self._op("add", (a, b), name)

    def output(self, name: str, value: Value) -> None:
        check_name(name, "output")
        if any(n == name for n, _ in self.graph.outputs):
            raise ValueError(f"output {name!r} is already defined")
        self.graph.outputs.append((name, value.name))
