"""The op registry (issue 34): an op is its OpSpec. A toy op, y = x * c, is added through the
registry alone (its spec with type inference, numpy reference and a kernel of its own) and runs
through verify, the interpreter, lowering and the host backend; and no if/elif over op names is
left in the modules that dispatch through the spec."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qir
from qir import ops
from qir.builder import Builder
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.lower import lower
from qir.codegen.plan import Arg, Launch
from qir.codegen.render import common_header
from qir.dtypes import F16
from qir.errors import Unsupported
from qir.graph import Graph, Node
from qir.interpret import Run, interpret
from qir.ops import IRTypeError, OpSpec
from qir.types import TensorType, ValueType
from qir.verify import verify
from tests.requires import requires

N = 96
THREADS = 128


def _infer(types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]) -> ValueType:
    (t,) = types
    if not isinstance(t, TensorType) or t.rank != 2:
        raise IRTypeError(f"scale: %{names[0]}: {t} must be an [M, N] activation")
    if not isinstance(attrs.get("c"), float):
        raise IRTypeError("scale: attribute c must be a float")
    return t


def _reference(run: Run, name: str, node: Node, args: list[Any]) -> np.ndarray:
    assert isinstance(node.type, TensorType)
    return (args[0].astype(np.float32) * np.float32(node.attr("c"))).astype(node.type.dtype.np)


def _lower(graph: Graph, name: str, *_: object) -> tuple[list[Launch], dict[str, TensorType]]:
    node = graph.node(name)
    assert isinstance(node.type, TensorType)
    (x,) = graph.operands(name)
    c = f"{float(node.attr('c'))!r}f"
    kname = f"toy_scale_n{N}"
    source = f"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "qir_common.cuh"

extern "C" __global__ void __launch_bounds__({THREADS}) {kname}(
    const __half* __restrict__ x, __half* __restrict__ y, int M) {{
  const int col = blockIdx.x * {THREADS} + threadIdx.x;
  const int m = blockIdx.y;
  if (col >= {N} || m >= M) return;
  const size_t i = (size_t)m * {N} + col;
  y[i] = qir_from_float<__half>(qir_to_float(x[i]) * {c});
}}
"""
    params = (
        KernelParam("x", "const __half* __restrict__", "buffer"),
        KernelParam("y", "__half* __restrict__", "buffer"),
        KernelParam("M", "int", "int"),
    )
    kernel = Kernel(kname, source, params, (THREADS, 1, 1), (common_header(),), collectives=False)
    args = (Arg("value", x), Arg("value", name), Arg("M"))
    return [Launch(kernel, -(-N // THREADS), 1, args, (name,), (name,))], {}


@pytest.fixture
def toy_op() -> Iterator[str]:
    ops.register(
        OpSpec("toy_scale", 1, _infer, frozenset({"c"}), reference=_reference, lower=_lower)
    )
    try:
        yield "toy_scale"
    finally:
        del ops.OPS["toy_scale"]


def _graph(op: str, c: float = 1.5) -> Graph:
    b = Builder("toy")
    x = b.input("x", ("M", N), F16)
    b.output("y", b.add(x, b.op(op, x, name="s", c=c), name="y"))
    return b.graph


def test_toy_op_verifies_and_interprets(toy_op: str) -> None:
    graph = _graph(toy_op)
    verify(graph)
    x = np.random.default_rng(0).standard_normal((5, N), np.float32).astype(np.float16)
    s = (x.astype(np.float32) * np.float32(1.5)).astype(np.float16)
    want = (x.astype(np.float32) + s.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(interpret(graph, {"x": x}, {})["y"], want)


def test_toy_op_types_are_checked(toy_op: str) -> None:
    with pytest.raises(IRTypeError, match="attribute c must be a float"):
        _graph(toy_op, c=2)  # type: ignore[arg-type]


def test_toy_op_lowers_to_its_kernel(toy_op: str) -> None:
    plan = lower(_graph(toy_op))
    assert [la.kernel.name for la in plan.launches] == [f"toy_scale_n{N}", f"ew_add_f16_n{N}"]


@requires("gxx")
def test_toy_op_runs_on_the_host_backend(toy_op: str) -> None:
    graph = _graph(toy_op)
    block = qir.compile(graph, {}, backend="host", passes="none")
    for m in (1, 7):
        x = np.random.default_rng(m).standard_normal((m, N), np.float32).astype(np.float16)
        want = interpret(graph, {"x": x}, {})["y"]
        np.testing.assert_array_equal(np.asarray(block({"x": x})["y"]), want)


def test_an_op_is_defined_once(toy_op: str) -> None:
    with pytest.raises(IRTypeError, match="already defined"):
        ops.register(OpSpec(toy_op, 1, _infer))


def test_an_op_without_a_lowering_is_unsupported() -> None:
    ops.register(OpSpec("toy_nolower", 1, _infer, frozenset({"c"}), reference=_reference))
    try:
        with pytest.raises(Unsupported, match="no kernel for %s = toy_nolower"):
            lower(_graph("toy_nolower"))
    finally:
        del ops.OPS["toy_nolower"]


ROOT = Path(__file__).resolve().parent.parent
DISPATCHERS = ("qir/interpret.py", "qir/codegen/lower.py")
BY_NAME = re.compile(r"""\b(if|elif)\b[^\n]*\.op (==|in) [\("']""")


@pytest.mark.parametrize("path", DISPATCHERS)
def test_no_if_elif_over_op_names(path: str) -> None:
    hits = [
        f"{path}:{i}: {line.strip()}"
        for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if BY_NAME.search(line)
    ]
    assert not hits, "\n".join(hits)
