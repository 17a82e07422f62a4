"""The op table. Each spec infers its result type from operand types and attributes and raises
`IRTypeError` naming the operands on a mismatch; the builder calls it when a node is made and
the verifier calls it again on every node, so the table is the one source of legality."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from qir import dtypes, moe
from qir.errors import QirError
from qir.graph import Graph
from qir.rope import ATTRS as ROPE_ATTRS
from qir.rope import rope_problem
from qir.types import QActType, QExperts, QWeight, TensorType, TupleType, ValueType


class IRTypeError(QirError, TypeError):
    """An op got operands of the wrong shape, dtype or kind."""


class Op(StrEnum):
    """The built-in ops. A member is its name (Op.QLINEAR == "qlinear"), so the IR text and a
    node's op stay strings and an op `register`ed later is keyed by its name alone."""

    INPUT = "input"
    WEIGHT = "weight"
    QLINEAR = "qlinear"
    QUANTIZE_ACT = "quantize_act"
    GET = "get"
    SILU = "silu"
    GELU_TANH = "gelu_tanh"
    SOFTCAP = "softcap"
    MUL = "mul"
    ADD = "add"
    STATE = "state"
    RMS_NORM = "rms_norm"
    NORM_RESIDUAL = "norm_residual"
    ROPE = "rope"
    KV_APPEND = "kv_append"
    ATTENTION = "attention"
    EMBEDDING = "embedding"
    SAMPLE = "sample"
    ADJUST_LOGITS = "adjust_logits"
    LOGPROBS = "logprobs"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    ROUTE = "route"
    EXPERT_QLINEAR = "expert_qlinear"


Infer = Callable[[Sequence[ValueType], Sequence[str], Mapping[str, Any]], ValueType]


VARIADIC = -1

# An op's named operand segments in order, each (name, count): a count of 0 leaves an optional
# segment out, and one segment of VARIADIC count takes what the others leave (MLIR's operand
# segments). Where the roles depend on attributes (a prologue's extra inputs, a paged cache's
# block table) the op declares a function of its attributes.
SegmentSizes = Sequence[tuple[str, int]]
Segments = SegmentSizes | Callable[[Mapping[str, Any]], SegmentSizes]


@dataclass(frozen=True)
class Layout:
    """Where each named operand segment of one node sits among its operands."""

    op: str
    spans: Mapping[str, slice]

    def __getitem__(self, segment: str) -> slice:
        try:
            return self.spans[segment]
        except KeyError:
            raise IRTypeError(
                f"{self.op} has no operand segment {segment!r}; known: {', '.join(self.spans)}"
            ) from None

    def at(self, segment: str) -> int | None:
        """The index of a segment of at most one operand; None where it is left out."""
        span = self[segment]
        assert span.stop - span.start <= 1, f"{self.op}: {segment} is not a single operand"
        return span.start if span.stop > span.start else None

    @property
    def size(self) -> int:
        """The operands the segments take (where none is variadic, the op's operand count)."""
        return max((s.stop for s in self.spans.values()), default=0)


def layout_of(op: str, sizes: SegmentSizes, n_operands: int) -> Layout:
    """The segments laid out over n_operands: those before the variadic one from the front, those
    after it from the back."""
    counts = [n for _, n in sizes]
    variadic = counts.index(VARIADIC) if VARIADIC in counts else len(counts)
    spans: dict[str, slice] = {}
    at = 0
    for name, n in sizes[:variadic]:
        spans[name] = slice(at, at + n)
        at += n
    end = n_operands
    for name, n in reversed(sizes[variadic + 1 :]):
        spans[name] = slice(end - n, end)
        end -= n
    if variadic < len(sizes):
        spans[sizes[variadic][0]] = slice(at, end)
    return Layout(op, {name: spans[name] for name, _ in sizes})


@dataclass(frozen=True)
class OpSpec:
    """One op: its arity, named operand segments, attribute schema and type inference here, and
    the ways it runs, which the interpreter (`reference`), lowering (`lower`) and the
    tensor-parallel split (`shard`) dispatch through instead of keying on its name. A built-in
    op's reference, lowering and shard rule are attached with `implement` by the modules that
    hold them (qir.interpret, qir.codegen.lower, qir.passes.tensor_parallel), which this module
    must not import; a new op brings them on the spec it `register`s."""

    name: str
    arity: int
    infer: Infer
    attrs: frozenset[str] = frozenset()
    elementwise: bool = False
    # Its operands' roles by name (see Segments); without, one variadic segment "operands"
    segments: Segments = (("operands", VARIADIC),)
    # (run: qir.interpret.Run, name, node, args) -> the node's value
    reference: Callable[..., Any] | None = None
    # (graph, name, temps so far, m_tile, target) -> (launches, new temps): qir.codegen.lower
    lower: Callable[..., Any] | None = None
    # (qir.passes.tensor_parallel.TensorParallel, graph, name) -> the weights it sharded for the
    # rank, splitting what the node roots (0: nothing); ops without a rule are replicated
    shard: Callable[..., int] | None = None

    def layout(self, n_operands: int, attrs: Mapping[str, Any]) -> Layout:
        """Where this op's named operand segments sit for a node of these operands and attrs."""
        sizes = self.segments(attrs) if callable(self.segments) else self.segments
        return layout_of(self.name, sizes, n_operands)


def layout(graph: Graph, name: str) -> Layout:
    """Node `name`'s operand segments."""
    node = graph.node(name)
    return spec(node.op).layout(len(graph.operands(name)), dict(node.attrs))


def operands(graph: Graph, name: str, segment: str) -> tuple[str, ...]:
    """The values in one named operand segment of node `name` (empty where it is left out)."""
    return tuple(graph.operands(name)[layout(graph, name)[segment]])


def operand(graph: Graph, name: str, segment: str) -> str | None:
    """The value of a single-operand segment of node `name`, or None where it is left out."""
    at = layout(graph, name).at(segment)
    return None if at is None else graph.operands(name)[at]


def _desc(name: str, t: ValueType) -> str:
    return f"%{name}: {t}"


def _tensor(op: str, names: Sequence[str], types: Sequence[ValueType], i: int) -> TensorType:
    t = types[i]
    if not isinstance(t, TensorType):
        raise IRTypeError(f"{op}: operand {i} ({_desc(names[i], t)}) must be an activation tensor")
    return t


# The batch dim of every activation: blocks are compiled once for any number of rows, which a
# run binds (a concrete batch size in the IR would silently disagree with the kernels' M).
BATCH = "M"


def activation_problem(t: ValueType) -> str | None:
    """Why `t` is not an activation [M, features] of an activation dtype, or None."""
    if not isinstance(t, TensorType):
        return "must be an activation tensor"
    if t.dtype not in dtypes.ACTIVATION:
        return f"must be one of {', '.join(d.name for d in dtypes.ACTIVATION)}"
    if t.rank != 2 or t.shape[0] != BATCH or not isinstance(t.shape[1], int) or t.shape[1] < 1:
        return f"must be 2-D [{BATCH}, features] with the batch dim spelled {BATCH}"
    return None


def _activation(op: str, names: Sequence[str], types: Sequence[ValueType], i: int) -> TensorType:
    return _checked(op, names, types, i, activation_problem)


def _checked(
    op: str,
    names: Sequence[str],
    types: Sequence[ValueType],
    i: int,
    problem_of: Callable[[ValueType], str | None],
) -> TensorType:
    t = types[i]
    problem = problem_of(t)
    if problem:
        raise IRTypeError(f"{op}: operand {i} ({_desc(names[i], t)}) {problem}")
    assert isinstance(t, TensorType)
    return t


# Besides activations, a layer's values are of three more kinds, each with its own rule so that
# none of them can reach a qlinear: token ids and positions (one int32 per row), parameter
# tensors (a norm's weight), and KV caches (state that outlives a run).
INDEX_DTYPE = dtypes.I32


def index_problem(t: ValueType) -> str | None:
    """Why `t` is not a per-row index vector i32[M] (token ids, positions), or None."""
    if not isinstance(t, TensorType) or t.dtype != INDEX_DTYPE or t.shape != (BATCH,):
        return f"must be {INDEX_DTYPE.name}[{BATCH}] (one index per row)"
    return None


def table_problem(t: ValueType) -> str | None:
    """Why `t` is not a block table i32[M, pages] (each row's KV-cache pages), or None."""
    if not (
        isinstance(t, TensorType)
        and t.dtype == INDEX_DTYPE
        and t.rank == 2
        and t.shape[0] == BATCH
        and isinstance(t.shape[1], int)
        and t.shape[1] >= 1
    ):
        return f"must be a block table {INDEX_DTYPE.name}[{BATCH}, pages] (each row's cache pages)"
    return None


def input_problem(t: ValueType) -> str | None:
    """Why `t` cannot be a block input (an activation, an index vector or a block table), or
    None."""
    if isinstance(t, TensorType) and t.dtype == INDEX_DTYPE:
        return table_problem(t) if t.rank == 2 else index_problem(t)
    return activation_problem(t)


def param_problem(t: ValueType) -> str | None:
    """Why `t` is not an unquantized parameter vector [features] (a norm weight), or None."""
    if not isinstance(t, TensorType) or t.dtype not in dtypes.ACTIVATION:
        return f"must be a parameter tensor of {', '.join(d.name for d in dtypes.ACTIVATION)}"
    if t.rank != 1 or not isinstance(t.shape[0], int) or t.shape[0] < 1:
        return "must be 1-D [features]"
    return None


def cache_problem(t: ValueType) -> str | None:
    """Why `t` is not a KV cache [capacity, kv_heads, head_dim] of an activation dtype, or None."""
    if not isinstance(t, TensorType) or t.dtype not in dtypes.ACTIVATION:
        return f"must be a KV cache of {', '.join(d.name for d in dtypes.ACTIVATION)}"
    if t.rank != 3 or not all(isinstance(d, int) and d >= 1 for d in t.shape):
        return "must be 3-D [capacity, kv_heads, head_dim] with concrete sizes"
    return None


def _infer_leaf(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    raise AssertionError("leaf types are given, not inferred")


PROLOGUES = ("silu_mul", "rms_norm", "norm_residual")
EPILOGUES = ("residual", "silu_mul", "softcap")
# The activation a silu_mul prologue or epilogue applies to the gate (a qlinear's `act`; absent:
# silu): the elementwise op it stands for.
GATE_ACTS = ("silu", "gelu_tanh")


def _qlinear_segments(attrs: Mapping[str, Any]) -> SegmentSizes:
    """A qlinear's operands: its inputs, its weights, then its epilogue's.

    inputs: x, or (g, u) with prologue silu_mul (the kernel reads silu(g) * u as its input, or
    act(g) * u with the node's `act`: GATE_ACTS), or
    (x, w) with prologue rms_norm (it reads rms_norm(x, w) with the node's eps), or
    (x, pw, r, w) with prologue norm_residual (it reads rms_norm(h, w), h = r + rms_norm(x, pw)
    with eps res_eps, the norm_residual op; the node's last result is h, which it stores too);
    weights: one or more (several = one multi-output node reading its input once; with
    epilogue silu_mul exactly two, gate and up, and one result silu(x Wg^T) * (x Wu^T));
    then the residual r with epilogue residual (y = r + x W^T). Epilogue softcap (one weight,
    attribute cap): y = tanh(x W^T / cap) * cap, the projection rounded first.
    """
    prologue = attrs.get("prologue")
    n_in = 4 if prologue == "norm_residual" else 2 if prologue in PROLOGUES else 1
    residual = 1 if attrs.get("epilogue") == "residual" else 0
    return (("inputs", n_in), ("weights", VARIADIC), ("residual", residual))


def _check_takes_act(op: str, scheme: str, name: str, w: QWeight | QExperts, what: str) -> None:
    """4-bit activations need weights whose kernels consume that scheme, and K in whole
    64-element tiles."""
    if w.format.act_quant_scheme() != scheme:
        raise IRTypeError(
            f"{op}: {scheme} activations need {what} that take them, not {_desc(name, w)}"
        )
    if w.in_features % 64:
        raise IRTypeError(f"{op}: {scheme} activations need K % 64 == 0, got {w.in_features}")


def _infer_qlinear(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    if attrs.get("prologue") != "norm_residual":
        if attrs.get("res_eps") is not None:
            raise IRTypeError("qlinear: res_eps is the norm_residual prologue's")
        return _infer_projections(types, names, attrs)
    # rms_norm(h, w) read as the rms_norm prologue reads its x, and h itself the last result
    if len(types) < 5:
        raise IRTypeError("qlinear prologue norm_residual: takes x, pw, r, w, then weights")
    h = _infer_norm_residual(types[:3], names[:3], {"eps": attrs.get("res_eps")})
    assert isinstance(h, TensorType)
    inner = {**attrs, "prologue": "rms_norm"}
    ys = _infer_projections([h, *types[3:]], [names[0], *names[3:]], inner)
    return TupleType((*(ys.elements if isinstance(ys, TupleType) else (ys,)), h))


def _infer_projections(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    prologue, epilogue = attrs.get("prologue"), attrs.get("epilogue")
    if prologue is not None and prologue not in PROLOGUES:
        raise IRTypeError(f"qlinear: unknown prologue {prologue!r}; known: {', '.join(PROLOGUES)}")
    if epilogue is not None and epilogue not in EPILOGUES:
        raise IRTypeError(f"qlinear: unknown epilogue {epilogue!r}; known: {', '.join(EPILOGUES)}")
    act = attrs.get("act")
    if act is not None:
        if act not in GATE_ACTS:
            raise IRTypeError(f"qlinear: unknown act {act!r}; known: {', '.join(GATE_ACTS)}")
        if "silu_mul" not in (prologue, epilogue):
            raise IRTypeError(f"qlinear: act {act!r} needs a silu_mul prologue or epilogue")
    segments = layout_of("qlinear", _qlinear_segments(attrs), len(types))
    ws = segments["weights"]
    if ws.stop - ws.start < 1:
        raise IRTypeError(f"qlinear: {len(types)} operands leave no weight")
    if isinstance(types[0], QActType):
        if prologue is not None:
            raise IRTypeError("qlinear: a pre-quantized input takes no prologue")
        x = types[0].source
    else:
        x = _activation("qlinear", names, types, 0)
    _check_kernel_label(attrs, x.dtype)
    if attrs.get("act_quant") is not None:
        if prologue != "silu_mul":
            raise IRTypeError("qlinear: act_quant quantizes a prologue's result; use quantize_act")
        _check_act_rule("qlinear", attrs, "act_quant")
    if prologue == "rms_norm":
        x = _infer_row_norm("qlinear", types[:2], names[:2], attrs)
    if prologue == "silu_mul":
        u = _activation("qlinear", names, types, 1)
        if u != x:
            raise IRTypeError(
                f"qlinear prologue silu_mul: {_desc(names[0], x)} and {_desc(names[1], u)} differ"
            )
    results = []
    for i in range(ws.start, ws.stop):
        w = types[i]
        if not isinstance(w, QWeight):
            raise IRTypeError(f"qlinear: operand {i} ({_desc(names[i], w)}) must be a weight")
        if x.shape[1] != w.in_features:
            raise IRTypeError(
                f"qlinear: input {_desc(names[0], x)} has {x.shape[1]} features but weight "
                f"{_desc(names[i], w)} has in_features {w.in_features}"
            )
        results.append(TensorType((x.shape[0], w.out_features), x.dtype))
    # 4-bit activations: a quantize_act input, or act_quant in the prologue
    scheme = types[0].scheme if isinstance(types[0], QActType) else attrs.get("act_quant")
    # Weights of several formats share a launch as parts of it (codegen.gemv.GemvSpec.parts),
    # with 16-bit activations.
    first = types[ws.start]
    assert isinstance(first, QWeight)
    for i in range(ws.start, ws.stop):
        w = types[i]
        assert isinstance(w, QWeight)
        if w.format != first.format and scheme is not None:
            raise IRTypeError(
                f"qlinear: weights of different formats ({_desc(names[ws.start], first)} and "
                f"{_desc(names[i], w)}) share a launch only with 16-bit activations"
            )
    if scheme is not None:
        w0 = types[ws.start]
        assert isinstance(w0, QWeight)
        _check_takes_act("qlinear", scheme, names[ws.start], w0, "weights")
    if epilogue == "silu_mul":
        if prologue == "silu_mul":
            raise IRTypeError("qlinear epilogue silu_mul: takes no silu_mul prologue")
        if len(results) != 2 or results[0] != results[1]:
            shapes = ", ".join(str(r) for r in results)
            raise IRTypeError(
                f"qlinear epilogue silu_mul: needs two weights (gate, up) of one shape, got {shapes}"
            )
        return results[0]
    if epilogue == "softcap":
        cap = attrs.get("cap")
        if len(results) != 1 or prologue == "silu_mul":
            raise IRTypeError("qlinear epilogue softcap: needs exactly one weight, no silu_mul")
        if not isinstance(cap, float) or not cap > 0:
            raise IRTypeError(
                f"qlinear epilogue softcap: cap must be a positive float, got {cap!r}"
            )
        return results[0]
    if attrs.get("cap") is not None:
        raise IRTypeError("qlinear: cap is the softcap epilogue's")
    if epilogue == "residual":
        if len(results) != 1:
            raise IRTypeError("qlinear epilogue residual: needs exactly one weight")
        at = segments["residual"].start
        r = _activation("qlinear", names, types, at)
        if r != results[0]:
            raise IRTypeError(
                f"qlinear epilogue residual: {_desc(names[at], r)} does not match "
                f"the result {results[0]}"
            )
    return results[0] if len(results) == 1 else TupleType(tuple(results))


# Kernel families a qlinear's `kernel` label may name (see passes/select_kernels.py): the GEMV at
# every M, the GEMM at every M, or the GEMV below `gemm_from_m` rows and the GEMM from there.
KERNEL_LABELS = ("gemv", "gemm", "gemv|gemm")


def _check_kernel_label(attrs: Mapping[str, Any], act: dtypes.DType) -> None:
    kernel, first = attrs.get("kernel"), attrs.get("gemm_from_m")
    if kernel is not None and kernel not in KERNEL_LABELS:
        raise IRTypeError(f"qlinear: unknown kernel {kernel!r}; known: {', '.join(KERNEL_LABELS)}")
    if kernel not in (None, "gemv") and act == dtypes.F32:
        raise IRTypeError(f"qlinear: kernel {kernel!r} takes f16 or bf16 activations, not f32")
    if (first is not None) != (kernel in ("gemm", "gemv|gemm")):
        raise IRTypeError('qlinear: gemm_from_m goes with kernel "gemm" or "gemv|gemm"')
    if first is not None and (
        isinstance(first, bool)
        or not isinstance(first, int)
        or first < 1
        or (first > 1) != (kernel == "gemv|gemm")
    ):
        raise IRTypeError(
            f'qlinear: gemm_from_m={first!r} must be an int, 1 for kernel "gemm", above 1 for '
            '"gemv|gemm"'
        )


ACT_SCHEMES = ("nvfp4",)
# The calibrated scale attributes a quantization rule may carry (see WeightFormat.act_quant_rule).
ACT_SCALE_ATTRS = frozenset({"input_scale", "input_global_scale"})
# W4A4 kernels take batches of at most this many rows; larger M runs the 16-bit path.
W4A4_MAX_M = 64


def _check_act_rule(op: str, attrs: Mapping[str, Any], key: str) -> None:
    scheme = attrs.get(key)
    if scheme not in ACT_SCHEMES:
        raise IRTypeError(
            f"{op}: unknown activation scheme {scheme!r}; known: {', '.join(ACT_SCHEMES)}"
        )
    scales = [a for a in ACT_SCALE_ATTRS if a in attrs]
    if len(scales) > 1:
        raise IRTypeError(f"{op}: give at most one of {sorted(ACT_SCALE_ATTRS)}")
    for a in scales:
        if not isinstance(attrs[a], float) or not attrs[a] > 0:
            raise IRTypeError(f"{op}: {a} must be a positive float, got {attrs[a]!r}")


def _infer_quantize_act(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(x) -> x quantized; or, with an RMSNorm prologue (attribute eps), (xn, x, w) -> xn
    quantized, computed from x and w in the same launch: xn = rms_norm(x, w) is the 16-bit
    value it stands for (what batches above W4A4_MAX_M read instead)."""
    x = _activation("quantize_act", names, types, 0)
    if len(types) not in (1, 3) or (len(types) == 3) != ("eps" in attrs):
        raise IRTypeError("quantize_act: takes (x), or (xn, x, w) with an rms_norm eps")
    if len(types) == 3 and _infer_row_norm("quantize_act", types[1:], names[1:], attrs) != x:
        raise IRTypeError(
            f"quantize_act: rms_norm({_desc(names[1], types[1])}) does not match "
            f"{_desc(names[0], x)}"
        )
    _check_act_rule("quantize_act", attrs, "scheme")
    k = x.shape[1]
    if not isinstance(k, int) or k % 64:
        raise IRTypeError(f"quantize_act: {_desc(names[0], x)} needs features divisible by 64")
    return QActType(attrs["scheme"], x)


def _infer_get(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    t = types[0]
    if not isinstance(t, TupleType):
        raise IRTypeError(f"get: operand {_desc(names[0], t)} is not a tuple")
    i = attrs.get("index")
    if not isinstance(i, int) or not 0 <= i < len(t.elements):
        raise IRTypeError(f"get: index {i!r} out of range for {_desc(names[0], t)}")
    return t.elements[i]


def _infer_unary(op: str) -> Infer:
    def infer(
        types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
    ) -> ValueType:
        return _activation(op, names, types, 0)

    return infer


def _infer_softcap(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    cap = attrs.get("cap")
    if not isinstance(cap, float) or not cap > 0:
        raise IRTypeError(f"softcap: cap must be a positive float, got {cap!r}")
    return _activation("softcap", names, types, 0)


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


def _ranks(op: str, attrs: Mapping[str, Any]) -> int:
    n = attrs.get("ranks")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise IRTypeError(f"{op}: ranks must be a positive int, got {n!r}")
    return n


def _infer_all_reduce(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(x) -> the sum of every rank's x (qir.collectives: float32, in rank order, rounded once)."""
    _ranks("all_reduce", attrs)
    return _activation("all_reduce", names, types, 0)


def _infer_all_gather(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(x) -> every rank's x concatenated along `axis` in rank order (vocab-parallel logits)."""
    n = _ranks("all_gather", attrs)
    x = _activation("all_gather", names, types, 0)
    axis = attrs.get("axis")
    if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < x.rank:
        raise IRTypeError(f"all_gather: axis {axis!r} out of range for {_desc(names[0], x)}")
    dim = x.shape[axis]
    if not isinstance(dim, int):
        raise IRTypeError(f"all_gather: axis {axis} of {_desc(names[0], x)} is symbolic")
    shape = list(x.shape)
    shape[axis] = dim * n
    return TensorType(tuple(shape), x.dtype)


def _infer_rms_norm(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(x [M, N], w [D]) -> x normed over each group of D features (D = N: whole rows; D a
    divisor of N: per head, as Qwen3's q/k norms)."""
    x = _activation("rms_norm", names, types, 0)
    w = _checked("rms_norm", names, types, 1, param_problem)
    n, d = x.shape[1], w.shape[0]
    assert isinstance(n, int) and isinstance(d, int)
    if n % d:
        raise IRTypeError(
            f"rms_norm: weight {_desc(names[1], w)} does not match the features of "
            f"{_desc(names[0], x)} (or a whole number of groups of them)"
        )
    eps = attrs.get("eps")
    if not isinstance(eps, float) or not eps > 0:
        raise IRTypeError(f"rms_norm: eps must be a positive float, got {eps!r}")
    return x


def _infer_norm_residual(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(x, w, r) -> r + rms_norm(x, w), the norm rounded before the add (Gemma's post-norms)."""
    x = _infer_rms_norm(types[:2], names[:2], attrs)
    r = _activation("norm_residual", names, types, 2)
    if r != x:
        raise IRTypeError(
            f"norm_residual: {_desc(names[2], r)} and {_desc(names[0], x)} differ "
            "(shapes and dtypes must match)"
        )
    return x


def _infer_row_norm(
    op: str, types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> TensorType:
    """An rms_norm prologue of whole rows (what the qlinear and quantize_act kernels compute)."""
    x = _infer_rms_norm(types, names, attrs)
    assert isinstance(x, TensorType) and isinstance(types[1], TensorType)
    if types[1].shape[0] != x.shape[1]:
        raise IRTypeError(f"{op}: an rms_norm prologue normalises whole rows, not groups")
    return x


def _kv_append_segments(attrs: Mapping[str, Any]) -> SegmentSizes:
    """kv_append's fixed operands, then the block table (with attribute page_size) and the
    head-norm weight (with norm_eps)."""
    return (
        ("k_cache", 1),
        ("v_cache", 1),
        ("k", 1),
        ("v", 1),
        ("positions", 1),
        ("pages", 1 if attrs.get("page_size") is not None else 0),
        ("norm", 1 if attrs.get("norm_eps") is not None else 0),
    )


def _attention_segments(attrs: Mapping[str, Any]) -> SegmentSizes:
    """attention's fixed operands, then the block table (with attribute page_size), the
    head-norm weight (with norm_eps) and the sinks (with sinks true)."""
    return (
        ("q", 1),
        ("k_cache", 1),
        ("v_cache", 1),
        ("positions", 1),
        ("pages", 1 if attrs.get("page_size") is not None else 0),
        ("norm", 1 if attrs.get("norm_eps") is not None else 0),
        ("sinks", 1 if attrs.get("sinks") else 0),
    )


CACHE_SEGMENTS: dict[str, Callable[[Mapping[str, Any]], SegmentSizes]] = {
    Op.KV_APPEND: _kv_append_segments,
    Op.ATTENTION: _attention_segments,
}


def _cache_layout(op: str, types: Sequence[ValueType], attrs: Mapping[str, Any]) -> Layout:
    """A kv_append's or attention's segments, its operand count checked against them."""
    segments = layout_of(op, CACHE_SEGMENTS[op](attrs), len(types))
    if len(types) != segments.size:
        raise IRTypeError(
            f"{op}: takes {segments.size} operands (a block table with page_size, a head-norm "
            f"weight with norm_eps{', sinks with sinks' if op == 'attention' else ''}), got "
            f"{len(types)}"
        )
    return segments


def _head_norm(
    op: str,
    names: Sequence[str],
    types: Sequence[ValueType],
    attrs: Mapping[str, Any],
    segments: Layout,
    head_dim: int,
) -> None:
    """The per-head RMSNorm prologue of attention (q) and kv_append (k): a weight [head_dim]
    (segment norm), with attribute norm_eps."""
    at = segments.at("norm")
    if at is None:
        return
    w = _checked(op, names, types, at, param_problem)
    if w.shape != (head_dim,):
        raise IRTypeError(f"{op}: head-norm weight {_desc(names[at], w)} must be [{head_dim}]")
    eps = attrs["norm_eps"]
    if not isinstance(eps, float) or not eps > 0:
        raise IRTypeError(f"{op}: norm_eps must be a positive float, got {eps!r}")


def _heads(op: str, name: str, x: TensorType, head_dim: int) -> int:
    width = x.shape[1]
    assert isinstance(width, int)
    if width % head_dim:
        raise IRTypeError(f"{op}: {_desc(name, x)} is not a whole number of heads of {head_dim}")
    return width // head_dim


def _infer_rope(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    x = _activation("rope", names, types, 0)
    _checked("rope", names, types, 1, index_problem)
    problem = rope_problem(attrs)
    if problem:
        raise IRTypeError(f"rope: {problem}")
    _heads("rope", names[0], x, attrs["head_dim"])
    return x


def _caches(
    op: str, names: Sequence[str], types: Sequence[ValueType], k_at: int, v_at: int
) -> TensorType:
    kc = _checked(op, names, types, k_at, cache_problem)
    vc = _checked(op, names, types, v_at, cache_problem)
    if kc != vc:
        raise IRTypeError(
            f"{op}: caches {_desc(names[k_at], kc)} and {_desc(names[v_at], vc)} differ"
        )
    return kc


def _check_paging(
    op: str,
    names: Sequence[str],
    types: Sequence[ValueType],
    cache: TensorType,
    segments: Layout,
    attrs: Mapping[str, Any],
) -> None:
    """A paged op's block table (segment pages) and page_size, against its cache: without a
    table the cache holds one sequence, position p at row p; with one it is a pool of pages of
    page_size rows, and row m's position p sits at row table[m, p // page_size] * page_size
    + p % page_size. A row at position -1 is padding: nothing is written or read for it."""
    page, at = attrs.get("page_size"), segments.at("pages")
    if page is None or at is None:
        return
    _checked(op, names, types, at, table_problem)
    capacity = cache.shape[0]
    assert isinstance(capacity, int)
    if isinstance(page, bool) or not isinstance(page, int) or page < 1 or capacity % page:
        raise IRTypeError(
            f"{op}: page_size must be an int >= 1 dividing the cache's {capacity} rows, "
            f"got {page!r}"
        )


def cache_room(cache: TensorType, table: ValueType | None, attrs: Mapping[str, Any]) -> int:
    """The positions a sequence's cache holds: the cache's rows, or through a block table its
    pages times page_size."""
    if table is None:
        rows = cache.shape[0]
        assert isinstance(rows, int)
        return rows
    assert isinstance(table, TensorType) and isinstance(table.shape[1], int)
    return int(table.shape[1]) * int(attrs["page_size"])


def _check_window(
    op: str,
    types: Sequence[ValueType],
    cache: TensorType,
    segments: Layout,
    attrs: Mapping[str, Any],
) -> None:
    """A sliding window (attribute window = W): attention reads positions p - W + 1..p, and a
    sequence's cache is a ring: position p sits at p % room (cache_room), so it holds the last
    `room` positions and W <= room."""
    w = attrs.get("window")
    if w is None:
        return
    pages = segments.at("pages")
    room = cache_room(cache, None if pages is None else types[pages], attrs)
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= room:
        raise IRTypeError(
            f"{op}: window must be an int from 1 to the {room} positions a sequence's cache "
            f"holds, got {w!r}"
        )


def _infer_kv_append(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(k_cache, v_cache, k, v, positions[, pages][, k_norm]) -> the two caches with row m of k
    and v written at positions[m] (through the block table `pages`, see _check_paging). A rope
    prologue (its attributes) rotates k as it is written; a head-norm prologue (k_norm
    [head_dim], norm_eps) normalises each head of k first. With a window (a sliding layer's)
    the cache is a ring (_check_window)."""
    segments = _cache_layout("kv_append", types, attrs)
    cache = _caches("kv_append", names, types, 0, 1)
    _check_paging("kv_append", names, types, cache, segments, attrs)
    _check_window("kv_append", types, cache, segments, attrs)
    _, kv_heads, head_dim = cache.shape
    assert isinstance(kv_heads, int) and isinstance(head_dim, int)
    _head_norm("kv_append", names, types, attrs, segments, head_dim)
    for i in (2, 3):
        t = _activation("kv_append", names, types, i)
        if t.shape[1] != kv_heads * head_dim or t.dtype != cache.dtype:
            raise IRTypeError(
                f"kv_append: {_desc(names[i], t)} does not fit a row of {_desc(names[0], cache)}"
            )
    _checked("kv_append", names, types, 4, index_problem)
    if "rope_type" in attrs or "theta" in attrs:
        problem = rope_problem(attrs)
        if problem or attrs["head_dim"] != head_dim:
            raise IRTypeError(f"kv_append rope prologue: {problem or 'head_dim differs'}")
    return TupleType((cache, cache))


def _infer_attention(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(q, k_cache, v_cache, positions[, pages][, q_norm]): row m attends to its positions
    0..positions[m] (causal; through the block table `pages`, see _check_paging), query head h
    to kv head h // (heads / kv_heads) (grouped-query). A rope prologue (its attributes) rotates
    q as it is read; a head-norm prologue (q_norm [head_dim], norm_eps) normalises each head of
    q first. With a window W, row m reads positions positions[m] - W + 1..positions[m] of a
    ring (_check_window). With `softcap` (Gemma 2's attn_logit_softcapping) each scaled score s
    becomes tanh(s / softcap) * softcap before the softmax. With sinks (f32[heads], attribute sinks), head h's softmax has one
    more logit, sinks[h], in its denominator and none of the values (gpt-oss)."""
    segments = _cache_layout("attention", types, attrs)
    q = _activation("attention", names, types, 0)
    cache = _caches("attention", names, types, 1, 2)
    _check_paging("attention", names, types, cache, segments, attrs)
    _check_window("attention", types, cache, segments, attrs)
    _checked("attention", names, types, 3, index_problem)
    _, kv_heads, head_dim = cache.shape
    assert isinstance(kv_heads, int) and isinstance(head_dim, int)
    _head_norm("attention", names, types, attrs, segments, head_dim)
    heads = _heads("attention", names[0], q, head_dim)
    if heads % kv_heads or q.dtype != cache.dtype:
        raise IRTypeError(
            f"attention: {_desc(names[0], q)} needs a multiple of the {kv_heads} kv heads of "
            f"{_desc(names[1], cache)}, in its dtype"
        )
    scale = attrs.get("scale")
    if not isinstance(scale, float) or not scale > 0:
        raise IRTypeError(f"attention: scale must be a positive float, got {scale!r}")
    cap = attrs.get("softcap")
    if cap is not None and (not isinstance(cap, float) or not cap > 0):
        raise IRTypeError(f"attention: softcap must be a positive float, got {cap!r}")
    if attrs.get("sinks") not in (None, True):
        raise IRTypeError(
            f"attention: sinks must be true (with a sinks operand), got {attrs['sinks']!r}"
        )
    at = segments.at("sinks")
    if at is not None:
        sinks = types[at]
        if sinks != TensorType((heads,), dtypes.F32):
            raise IRTypeError(
                f"attention: sinks {_desc(names[at], sinks)} must be f32[{heads}] (a logit per "
                "query head)"
            )
    if "rope_type" in attrs or "theta" in attrs:
        problem = rope_problem(attrs)
        if problem or attrs["head_dim"] != head_dim:
            raise IRTypeError(f"attention rope prologue: {problem or 'head_dim differs'}")
    return q


def _infer_embedding(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(ids, table [vocab, features]) -> the rows of the (dequantized) table, in `dtype`; with
    `scale` (Gemma: sqrt(hidden), already rounded to `dtype`) each rounded row times it, rounded
    again."""
    _checked("embedding", names, types, 0, index_problem)
    table = types[1]
    if not isinstance(table, QWeight) or table.bias:
        raise IRTypeError(
            f"embedding: operand 1 ({_desc(names[1], table)}) must be a weight without a bias"
        )
    dt = attrs.get("dtype")
    if dt not in [d.name for d in dtypes.ACTIVATION]:
        raise IRTypeError(
            f"embedding: dtype must be one of {', '.join(d.name for d in dtypes.ACTIVATION)}, "
            f"got {dt!r}"
        )
    scale = attrs.get("scale")
    if scale is not None and (not isinstance(scale, float) or not scale > 0):
        raise IRTypeError(f"embedding: scale must be a positive float, got {scale!r}")
    return TensorType((BATCH, table.in_features), dtypes.by_name(dt))


# The columns of a sample op's params input, and the largest vocabulary (see qir.sampling).
SAMPLING_PARAMS = 4
MAX_VOCAB_BITS = 23
# The columns of an adjust_logits op's penalties input, and the most top tokens a logprobs op
# reports per row (OpenAI's top_logprobs limit, vLLM's default max_logprobs) (qir.logits).
PENALTY_PARAMS = 3
MAX_TOP_LOGPROBS = 20


def _rows_of(dtype: dtypes.DType, cols: int | None, what: str) -> Callable[[ValueType], str | None]:
    """A problem_of for dtype[M, cols] (cols None: any fixed width)."""

    def problem(t: ValueType) -> str | None:
        if (
            isinstance(t, TensorType)
            and t.dtype == dtype
            and t.rank == 2
            and t.shape[0] == BATCH
            and isinstance(t.shape[1], int)
            and t.shape[1] >= 1
            and (cols is None or t.shape[1] == cols)
        ):
            return None
        return f"must be {dtype.name}[{BATCH}, {cols or 'n'}] ({what})"

    return problem


def _vocab(op: str, names: Sequence[str], types: Sequence[ValueType]) -> int:
    """The vocabulary of operand 0, logits [M, vocab], checked against MAX_VOCAB_BITS."""
    logits = _activation(op, names, types, 0)
    vocab = logits.shape[1]
    assert isinstance(vocab, int)
    if vocab > 2**MAX_VOCAB_BITS:
        raise IRTypeError(
            f"{op}: {_desc(names[0], logits)} has more than 2^{MAX_VOCAB_BITS} ids (the "
            "masses' sums would overflow 64 bits)"
        )
    return vocab


def _infer_sample(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(logits [M, vocab], params f32[M, 4], seed i32[M, 2], positions i32[M]) -> i32[M]: a
    token id per row drawn from its logits under its (temperature, top_k, top_p, min_p), with
    the row's 64-bit seed (low word, high word) and position keying the random draw
    (qir.sampling)."""
    _vocab("sample", names, types)
    what = "temperature, top_k, top_p, min_p per row"
    _checked("sample", names, types, 1, _rows_of(dtypes.F32, SAMPLING_PARAMS, what))
    _checked("sample", names, types, 2, _rows_of(INDEX_DTYPE, 2, "a 64-bit seed per row"))
    _checked("sample", names, types, 3, index_problem)
    return TensorType((BATCH,), INDEX_DTYPE)


def _infer_adjust_logits(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(logits [M, vocab], penalties f32[M, 3], tokens i32[M, C], counts i32[M, C], bias
    f32[M, C], allow i32[M, ceil(vocab / 32)]) -> f32[M, vocab]: each row's logits with the
    tokens its bitmask leaves out at -inf, then its entries' bias, repetition, frequency and
    presence penalties applied (qir.logits)."""
    vocab = _vocab("adjust_logits", names, types)
    what = "repetition, frequency, presence penalties per row"
    _checked("adjust_logits", names, types, 1, _rows_of(dtypes.F32, PENALTY_PARAMS, what))
    entries = _checked(
        "adjust_logits", names, types, 2, _rows_of(INDEX_DTYPE, None, "token entries per row")
    ).shape[1]
    assert isinstance(entries, int)
    _checked("adjust_logits", names, types, 3, _rows_of(INDEX_DTYPE, entries, "a count per entry"))
    _checked("adjust_logits", names, types, 4, _rows_of(dtypes.F32, entries, "a bias per entry"))
    words = -(-vocab // 32)
    _checked("adjust_logits", names, types, 5, _rows_of(INDEX_DTYPE, words, "a bit per token"))
    return TensorType((BATCH, vocab), dtypes.F32)


def _infer_logprobs(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(logits [M, vocab], next i32[M], targets i32[M]) -> (ids i32[M, k + 1], logprobs
    f32[M, k + 1]): per row, the log-softmax of its target (targets[m], or next[m] where
    targets[m] is -1) in column 0 and its k most likely tokens after it (qir.logits)."""
    vocab = _vocab("logprobs", names, types)
    for i in (1, 2):
        _checked("logprobs", names, types, i, index_problem)
    k, most = attrs.get("k"), min(vocab, MAX_TOP_LOGPROBS)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most:
        raise IRTypeError(f"logprobs: k must be an int in 0..{most}, got {k!r}")
    return TupleType(
        (TensorType((BATCH, k + 1), INDEX_DTYPE), TensorType((BATCH, k + 1), dtypes.F32))
    )


# ---- Mixtures of experts (qir.moe holds the maths) -------------------------------------------


def slots_problem(t: ValueType, dtype: dtypes.DType) -> str | None:
    """Why `t` is not a per-slot value dtype[M, k] (a router's ids or weights), or None."""
    if not (
        isinstance(t, TensorType)
        and t.dtype == dtype
        and t.rank == 2
        and t.shape[0] == BATCH
        and isinstance(t.shape[1], int)
        and t.shape[1] >= 1
    ):
        return f"must be {dtype.name}[{BATCH}, k] (one per chosen expert of each row)"
    return None


def _infer_route(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(logits [M, E]) -> (ids i32[M, k], weights f32[M, k]): each row's k experts under `rule`
    (qir.moe.RULES)."""
    logits = _activation("route", names, types, 0)
    experts, k, rule = logits.shape[1], attrs.get("k"), attrs.get("rule")
    assert isinstance(experts, int)
    if rule not in moe.RULES:
        raise IRTypeError(f"route: unknown rule {rule!r}; known: {', '.join(moe.RULES)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise IRTypeError(
            f"route: k={k!r} experts per row must be an int in 1..{experts} (the experts of "
            f"{_desc(names[0], logits)})"
        )
    return TupleType((TensorType((BATCH, k), INDEX_DTYPE), TensorType((BATCH, k), dtypes.F32)))


def _expert_segments(attrs: Mapping[str, Any]) -> SegmentSizes:
    """An expert qlinear's operands: x (and the norm's weight with prologue rms_norm), the
    stacked weights (gate and up with epilogue silu_mul), the router's ids, and with a combine
    epilogue the router's weights (and the residual with combine_residual)."""
    epilogue = attrs.get("epilogue")
    return (
        ("x", 1),
        ("norm", 1 if attrs.get("prologue") == "rms_norm" else 0),
        ("weights", VARIADIC),
        ("ids", 1),
        ("router_weights", 1 if epilogue in ("combine", "combine_residual") else 0),
        ("residual", 1 if epilogue == "combine_residual" else 0),
    )


def _infer_expert_qlinear(
    types: Sequence[ValueType], names: Sequence[str], attrs: Mapping[str, Any]
) -> ValueType:
    """(x[, nw], W[, W_up], ids[, weights[, r]]): for each row m and slot j, x[m] (or x[m, j]
    for an input of one row per slot, [M, k, K]) times expert ids[m, j] of the stacked weights.
    Result [M, k, N], one row per slot; with epilogue silu_mul (gate and up) silu(g) * u; with
    "combine" [M, N], the slots' rows summed weighted by `weights` f32[M, k] (qir.moe);
    "combine_residual" adds r [M, N]. With prologue rms_norm (attribute eps; an input of one
    row per token, no combine) the rows read are rms_norm(x, nw), as qlinear's prologue."""
    op = "expert_qlinear"
    epilogue = attrs.get("epilogue")
    if epilogue is not None and epilogue not in moe.EPILOGUES:
        raise IRTypeError(f"{op}: unknown epilogue {epilogue!r}; known: {', '.join(moe.EPILOGUES)}")
    prologue = attrs.get("prologue")
    if prologue is not None:
        if prologue != "rms_norm":
            raise IRTypeError(f"{op}: unknown prologue {prologue!r}; known: rms_norm")
        if epilogue in ("combine", "combine_residual"):
            raise IRTypeError(f"{op}: the rms_norm prologue takes no combine epilogue")
        _infer_row_norm(op, types[:2], names[:2], attrs)  # x [M, K] and nw [K]
    elif attrs.get("eps") is not None:
        raise IRTypeError(f"{op}: eps is the rms_norm prologue's")
    x = types[0]
    if not (
        isinstance(x, TensorType)
        and x.dtype in dtypes.ACTIVATION
        and x.rank in (2, 3)
        and x.shape[0] == BATCH
        and all(isinstance(d, int) and d >= 1 for d in x.shape[1:])
    ):
        raise IRTypeError(
            f"{op}: operand 0 ({_desc(names[0], x)}) must be an activation [{BATCH}, K], or "
            f"[{BATCH}, k, K] with a row per slot"
        )
    _check_kernel_label(attrs, x.dtype)
    act = attrs.get("act")
    if act is not None and (epilogue != "silu_mul" or act not in moe.GATE_ACTS):
        raise IRTypeError(
            f"{op}: act {act!r} needs epilogue silu_mul and one of {', '.join(moe.GATE_ACTS)}"
        )
    for key in ("limit", "alpha"):
        v = attrs.get(key)
        if (act == "swiglu_clamp") != (v is not None):
            raise IRTypeError(f"{op}: {key} goes with act swiglu_clamp (and it needs one)")
        if v is not None and (not isinstance(v, float) or not v > 0):
            raise IRTypeError(f"{op}: {key} must be a positive float, got {v!r}")
    want = 2 if epilogue == "silu_mul" else 1
    segments = layout_of(op, _expert_segments(attrs), len(types))
    ws, at = segments["weights"], segments["ids"].start
    rw, residual = segments.at("router_weights"), segments.at("residual")
    if ws.stop - ws.start != want or any(
        not isinstance(types[i], QExperts) for i in range(ws.start, ws.stop)
    ):
        raise IRTypeError(
            f"{op}: epilogue {epilogue} takes {len(types) - (ws.stop - ws.start) + want} "
            f"operands (input, {want} stacked expert weight(s)"
            + (" (gate, up)" if want == 2 else "")
            + ", ids"
            + (", weights" if rw is not None else "")
            + (", residual" if residual is not None else "")
            + f"), got {len(types)}"
        )
    ids = _checked(op, names, types, at, lambda t: slots_problem(t, INDEX_DTYPE))
    k = ids.shape[1]
    first = types[ws.start]
    assert isinstance(first, QExperts)
    for i in range(ws.start, ws.stop):
        w = types[i]
        assert isinstance(w, QExperts)
        if w != first:
            raise IRTypeError(
                f"{op}: experts {_desc(names[ws.start], first)} and {_desc(names[i], w)} differ "
                "(one launch takes one format, shape and expert count)"
            )
    if x.shape[-1] != first.in_features:
        raise IRTypeError(
            f"{op}: input {_desc(names[0], x)} has {x.shape[-1]} features but experts "
            f"{_desc(names[ws.start], first)} have in_features {first.in_features}"
        )
    if x.rank == 3 and x.shape[1] != k:
        raise IRTypeError(
            f"{op}: input {_desc(names[0], x)} has a row per slot but ids {_desc(names[at], ids)} "
            f"choose {k} experts per row"
        )
    scheme = attrs.get("act_quant")
    if scheme is not None:
        # W4A4 experts: each (row, slot)'s input quantized with its expert's calibrated scale
        # (the experts' input_scale buffer) or, where they calibrated none, a per-row one.
        _check_act_rule(op, attrs, "act_quant")
        _check_takes_act(op, scheme, names[ws.start], first, "experts")
    per_slot = TensorType((BATCH, k, first.out_features), x.dtype)
    if rw is None:
        return per_slot
    if types[rw] != TensorType((BATCH, k), dtypes.F32):
        raise IRTypeError(
            f"{op}: operand {rw} ({_desc(names[rw], types[rw])}) must be the "
            f"router's weights f32[{BATCH}, {k}]"
        )
    out = TensorType((BATCH, first.out_features), x.dtype)
    if residual is not None:
        r = _activation(op, names, types, residual)
        if r != out:
            raise IRTypeError(
                f"{op} epilogue combine_residual: {_desc(names[residual], r)} does not match the "
                f"result {out}"
            )
    return out


# The segments of the one- and two-operand ops
_X = (("x", 1),)
_AB = (("a", 1), ("b", 1))


def _quantize_act_segments(attrs: Mapping[str, Any]) -> SegmentSizes:
    """x, or with an rms_norm prologue (attribute eps) xn and the norm's operands x and w."""
    return (("x", 1), ("norm_inputs", 2 if "eps" in attrs else 0))


# Keyed by name: a built-in op's key is its Op member, equal to the string.
OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec(Op.INPUT, 0, _infer_leaf, segments=()),
        # A weight may carry its calibrated activation scale (W4A4 checkpoints), and the part of
        # a checkpoint weight a tensor-parallel rank holds (passes/tensor_parallel: shard).
        OpSpec(
            Op.WEIGHT, 0, _infer_leaf, frozenset({"key", "shard"}) | ACT_SCALE_ATTRS, segments=()
        ),
        OpSpec(
            Op.QLINEAR,
            VARIADIC,
            _infer_qlinear,
            frozenset(
                {
                    "prologue",
                    "epilogue",
                    "act",
                    "cap",
                    "kernel",
                    "gemm_from_m",
                    "fused",
                    "act_quant",
                    "eps",
                    "res_eps",
                }
            )
            | ACT_SCALE_ATTRS,
            segments=_qlinear_segments,
        ),
        OpSpec(
            Op.QUANTIZE_ACT,
            VARIADIC,
            _infer_quantize_act,
            frozenset({"scheme", "eps"}) | ACT_SCALE_ATTRS,
            segments=_quantize_act_segments,
        ),
        OpSpec(Op.GET, 1, _infer_get, frozenset({"index"}), segments=_X),
        OpSpec(Op.SILU, 1, _infer_unary("silu"), elementwise=True, segments=_X),
        # gelu with the tanh approximation (transformers' gelu_pytorch_tanh, Gemma's MLP)
        OpSpec(Op.GELU_TANH, 1, _infer_unary("gelu_tanh"), elementwise=True, segments=_X),
        # tanh(x / cap) * cap (Gemma's final logit soft-capping)
        OpSpec(Op.SOFTCAP, 1, _infer_softcap, frozenset({"cap"}), elementwise=True, segments=_X),
        OpSpec(Op.MUL, 2, _infer_binary("mul"), elementwise=True, segments=_AB),
        OpSpec(Op.ADD, 2, _infer_binary("add"), elementwise=True, segments=_AB),
        # A KV cache: persistent state named by `key`, written only by one kv_append.
        OpSpec(Op.STATE, 0, _infer_leaf, frozenset({"key"}), segments=()),
        OpSpec(Op.RMS_NORM, 2, _infer_rms_norm, frozenset({"eps"}), segments=(("x", 1), ("w", 1))),
        # r + rms_norm(x, w): a norm before a residual add, one kernel (passes/norm_residual)
        OpSpec(
            Op.NORM_RESIDUAL,
            3,
            _infer_norm_residual,
            frozenset({"eps", "fused"}),
            segments=(("x", 1), ("w", 1), ("residual", 1)),
        ),
        OpSpec(Op.ROPE, 2, _infer_rope, ROPE_ATTRS, segments=(("x", 1), ("positions", 1))),
        OpSpec(
            Op.KV_APPEND,
            VARIADIC,
            _infer_kv_append,
            ROPE_ATTRS | {"page_size", "norm_eps", "window"},
            segments=_kv_append_segments,
        ),
        OpSpec(
            Op.ATTENTION,
            VARIADIC,
            _infer_attention,
            frozenset({"scale", "page_size", "norm_eps", "window", "softcap", "sinks"})
            | ROPE_ATTRS,
            segments=_attention_segments,
        ),
        OpSpec(
            Op.EMBEDDING,
            2,
            _infer_embedding,
            frozenset({"dtype", "scale"}),
            segments=(("ids", 1), ("table", 1)),
        ),
        OpSpec(
            Op.SAMPLE,
            4,
            _infer_sample,
            segments=(("logits", 1), ("params", 1), ("seed", 1), ("positions", 1)),
        ),
        OpSpec(
            Op.ADJUST_LOGITS,
            6,
            _infer_adjust_logits,
            segments=(
                ("logits", 1),
                ("penalties", 1),
                ("tokens", 1),
                ("counts", 1),
                ("bias", 1),
                ("allow", 1),
            ),
        ),
        OpSpec(
            Op.LOGPROBS,
            3,
            _infer_logprobs,
            frozenset({"k"}),
            segments=(("logits", 1), ("next", 1), ("targets", 1)),
        ),
        # Collectives across the ranks of a tensor-parallel group (qir.collectives)
        OpSpec(Op.ALL_REDUCE, 1, _infer_all_reduce, frozenset({"ranks"}), segments=_X),
        OpSpec(Op.ALL_GATHER, 1, _infer_all_gather, frozenset({"axis", "ranks"}), segments=_X),
        OpSpec(Op.ROUTE, 1, _infer_route, frozenset({"k", "rule"}), segments=(("logits", 1),)),
        OpSpec(
            Op.EXPERT_QLINEAR,
            VARIADIC,
            _infer_expert_qlinear,
            frozenset(
                {
                    "epilogue",
                    "kernel",
                    "gemm_from_m",
                    "act",
                    "limit",
                    "alpha",
                    "prologue",
                    "eps",
                    "fused",
                    "act_quant",
                }
            ),
            segments=_expert_segments,
        ),
    )
}


def register(op: OpSpec) -> None:
    """Add an op to the IR: verify, the builder, the interpreter and lowering then take it."""
    if op.name in OPS:
        raise IRTypeError(f"op {op.name!r} is already defined")
    OPS[op.name] = op


def implement(
    op: str,
    *,
    reference: Callable[..., Any] | None = None,
    lower: Callable[..., Any] | None = None,
    shard: Callable[..., int] | None = None,
) -> None:
    """Attach a defined op's interpreter reference, lowering or tensor-parallel rule (see
    OpSpec)."""
    was = spec(op)
    OPS[op] = replace(
        was,
        reference=reference or was.reference,
        lower=lower or was.lower,
        shard=shard or was.shard,
    )


def spec(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise IRTypeError(f"unknown op {op!r}; known: {', '.join(OPS)}") from None
