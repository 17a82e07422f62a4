"""The op registry (issue 34): an op is its OpSpec. A toy op, y = x * c, is added through the
registry alone (its spec with named operand segments, type inference, numpy reference, a kernel
of its own and a tensor-parallel rule) and runs through verify, the interpreter, lowering, the
host backend and tensor_parallel; the built-in ops' segments follow their attributes; and no
if/elif over op names, nor any of the layout helpers the segments replaced, is left in the
modules that dispatch through the spec."""

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
from qir.ops import VARIADIC, IRTypeError, OpSpec
from qir.passes.tensor_parallel import TensorParallel
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
    x = args[ops.layout(run.graph, name).at("x") or 0]
    return (x.astype(np.float32) * np.float32(node.attr("c"))).astype(node.type.dtype.np)


def _lower(graph: Graph, name: str, *_: object) -> tuple[list[Launch], dict[str, TensorType]]:
    node = graph.node(name)
    assert isinstance(node.type, TensorType)
    x = ops.operand(graph, name, "x")
    assert x is not None
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


SHARDED: list[tuple[int, str]] = []


def _shard(tp: TensorParallel, graph: Graph, name: str) -> int:
    """A rule that shards nothing but says where it ran (a scale by a constant is replicated)."""
    SHARDED.append((tp.rank, name))
    return 0


@pytest.fixture
def toy_op() -> Iterator[str]:
    ops.register(
        OpSpec(
            "toy_scale",
            1,
            _infer,
            frozenset({"c"}),
            segments=(("x", 1),),
            reference=_reference,
            lower=_lower,
            shard=_shard,
        )
    )
    SHARDED.clear()
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


def test_toy_op_names_its_operands(toy_op: str) -> None:
    graph = _graph(toy_op)
    assert ops.operands(graph, "s", "x") == ("x",)
    with pytest.raises(IRTypeError, match="toy_scale has no operand segment 'w'; known: x"):
        ops.layout(graph, "s")["w"]


def test_toy_op_takes_its_tensor_parallel_rule(toy_op: str) -> None:
    graph = _graph(toy_op)
    assert TensorParallel(2, 1).run(graph) == 0
    assert SHARDED == [(1, "s")]


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


@pytest.mark.parametrize(
    ("op", "attrs", "n", "want"),
    [
        ("qlinear", {}, 3, {"inputs": (0, 1), "weights": (1, 3), "residual": (3, 3)}),
        (
            "qlinear",
            {"prologue": "rms_norm", "epilogue": "residual"},
            4,
            {"inputs": (0, 2), "weights": (2, 3), "residual": (3, 4)},
        ),
        (
            "qlinear",
            {"prologue": "norm_residual"},
            6,
            {"inputs": (0, 4), "weights": (4, 6), "residual": (6, 6)},
        ),
        (
            "expert_qlinear",
            {"epilogue": "combine_residual"},
            5,
            {"x": (0, 1), "norm": (1, 1), "weights": (1, 2), "ids": (2, 3)}
            | {"router_weights": (3, 4), "residual": (4, 5)},
        ),
        (
            "expert_qlinear",
            {"prologue": "rms_norm", "epilogue": "silu_mul"},
            5,
            {"x": (0, 1), "norm": (1, 2), "weights": (2, 4), "ids": (4, 5)}
            | {"router_weights": (5, 5), "residual": (5, 5)},
        ),
        (
            "attention",
            {"page_size": 16, "sinks": True},
            6,
            {"q": (0, 1), "k_cache": (1, 2), "v_cache": (2, 3), "positions": (3, 4)}
            | {"pages": (4, 5), "norm": (5, 5), "sinks": (5, 6)},
        ),
        (
            "kv_append",
            {"norm_eps": 1e-6},
            6,
            {"k_cache": (0, 1), "v_cache": (1, 2), "k": (2, 3), "v": (3, 4)}
            | {"positions": (4, 5), "pages": (5, 5), "norm": (5, 6)},
        ),
    ],
)
def test_segments_follow_the_attributes(
    op: str, attrs: dict[str, Any], n: int, want: dict[str, tuple[int, int]]
) -> None:
    layout = ops.spec(op).layout(n, attrs)
    assert {k: (s.start, s.stop) for k, s in layout.spans.items()} == want


def test_the_variadic_segment_takes_what_the_others_leave() -> None:
    sizes = (("a", 1), ("b", 0), ("rest", VARIADIC), ("c", 2))
    layout = ops.layout_of("toy", sizes, 6)
    assert [(layout[k].start, layout[k].stop) for k in ("a", "b", "rest", "c")] == [
        (0, 1),
        (1, 1),
        (1, 4),
        (4, 6),
    ]
    assert layout.at("a") == 0 and layout.at("b") is None


ROOT = Path(__file__).resolve().parent.parent
DISPATCHERS = ("qir/interpret.py", "qir/codegen/lower.py", "qir/passes/tensor_parallel.py")
BY_NAME = re.compile(r"""\b(if|elif)\b[^\n]*\.op (==|in) [\("']""")


@pytest.mark.parametrize("path", DISPATCHERS)
def test_no_if_elif_over_op_names(path: str) -> None:
    hits = [
        f"{path}:{i}: {line.strip()}"
        for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if BY_NAME.search(line)
    ]
    assert not hits, "\n".join(hits)


# Where a pass, the verifier, draw or audit still asks what a node is (a rewrite's pattern, the
# neighbours a split recognises), it names the op by its Op member, not a string.
SPELLED = re.compile(r"""(\.op (==|!=|in|not in) [\(]?["']|of_op\(["']|\bPat\(\s*["'])""")
BY_MEMBER = (
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "qir/passes").glob("*.py"))),
    "qir/verify.py",
    "qir/interpret.py",
    "qir/draw.py",
    "qir/audit.py",
    "qir/codegen/lower_layer.py",
)


@pytest.mark.parametrize("path", BY_MEMBER)
def test_op_names_are_op_members(path: str) -> None:
    hits = [
        f"{path}:{i}: {line.strip()}"
        for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if SPELLED.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_the_op_enum_is_the_built_in_table() -> None:
    assert ops.Op.QLINEAR == "qlinear" and f"{ops.Op.QLINEAR}" == "qlinear"
    builtin = {k for k in ops.OPS if isinstance(k, ops.Op)}
    assert builtin == set(ops.Op)


def test_tensor_parallel_walks_no_op_names() -> None:
    """Its splits are the ops' shard rules, found through the spec."""
    text = (ROOT / "qir/passes/tensor_parallel.py").read_text()
    assert "of_op(" not in text
    assert re.search(r"spec\(node\.op\)\.shard", text)


# The helpers every consumer had to remember before the ops named their operand segments
LAYOUT_HELPERS = re.compile(r"\b(qlinear_layout|expert_layout|cache_operands|sinks_operand)\b")


def test_no_layout_helper_remains() -> None:
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "qir").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if LAYOUT_HELPERS.search(line)
    ]
    assert not hits, "\n".join(hits)
