"""Lowering: one kernel launch per compute node of a (passed) graph, per batch-size range.

The plan names, for each launch, the rendered kernel, how its grid grows with M, which batch
sizes it serves and where each argument comes from (a value, a weight buffer, a constant, or M
itself), so an executor only binds memory. A qlinear's launches split the batch sizes: W4A4
takes M <= 64 and a 16-bit twin the rest; a table format (IQ4_NL, IQ4_XS) at f16 takes M = 1
through integer activations (gemv.int_act_fits) and f16 pairs from M = 2; within each, the GEMV family runs below the node's
`gemm_from_m` label (select_kernels) and the GEMM family from there, one launch per tile bucket
of the GEMM's table. A node without a label (no select_kernels pass) runs the GEMV only.

The plan is for one target (qir.target): it decides the FP4 decode of E2M1 weights and whether
W4A4 GEMMs run on the block-scaled FP4 MMA, where that GEMM quantizes its 16-bit input itself
(the quantize_act launch then runs only for the batch sizes its other readers serve)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import lru_cache

from qir.codegen import elementwise, fragments, gemm, gemv, quantize_act
from qir.codegen.collectives import collective_kernel
from qir.codegen.elementwise import EXPRESSIONS, elementwise_grid_x
from qir.codegen.gemm import GemmSpec, bucket_ranges
from qir.codegen.gemv import GemvSpec, for_target, int_act_fits
from qir.codegen.lower_layer import LAYER_LOWERINGS
from qir.codegen.lower_moe import MOE_LOWERINGS

# The plan types live in qir.codegen.plan (below every lowering module); the names are re-exported
# here, where the callers of lower() have always found them.
from qir.codegen.plan import (
    ALL_M,
    DEFAULT_M_TILE,
    MAX_GRID_Y,
    Arg,
    Launch,
    Plan,
)
from qir.codegen.quantize_act import QuantizeActSpec, act_quant_mode
from qir.errors import Unsupported
from qir.graph import AttrValue, Graph
from qir.ops import ACT_SCALE_ATTRS, W4A4_MAX_M, implement, layout, spec
from qir.target import DEFAULT, Target
from qir.types import QActType, QWeight, TensorType, TupleType

# The layers of a model repeat a few specialisations: each is rendered once per process (specs are
# frozen, so a spec is its own key; Kernels are frozen, so launches may share one).
RENDERED = 512
gemv_kernel = lru_cache(RENDERED)(gemv.gemv_kernel)
quantize_act_kernel = lru_cache(RENDERED)(quantize_act.quantize_act_kernel)
elementwise_kernel = lru_cache(RENDERED)(elementwise.elementwise_kernel)
fragment_for = lru_cache(RENDERED)(fragments.fragment_for)
gemm_kernel = lru_cache(RENDERED)(gemm.gemm_kernel)


def _lower_qlinear(graph: Graph, name: str, m_tile: int, target: Target) -> list[Launch]:
    """A launch per family and batch-size range (see the module docstring); a W4A4 node also
    gets 16-bit twins for batches above W4A4_MAX_M."""
    node = graph.node(name)
    attrs = dict(node.attrs)
    operands = graph.operands(name)
    segments = layout(graph, name)
    ins, ws, extras = segments["inputs"], segments["weights"], segments["residual"]
    weights = tuple(t for w in operands[ws] if isinstance(t := graph.node(w).type, QWeight))
    if isinstance(node.type, TupleType):
        by_index = {graph.node(u).attr("index"): u for u in graph.users(name)}
        # A norm_residual prologue's h (the last result) is stored only where something reads it.
        n = len(node.type.elements)
        if node.attr("prologue") == "norm_residual" and n - 1 not in by_index:
            n -= 1
        if sorted(by_index) != list(range(n)):
            raise Unsupported(f"%{name}: every result of a multi-output qlinear needs a get")
        outputs = tuple(by_index[i] for i in range(n))
        act = node.type.elements[0].dtype
    else:
        assert isinstance(node.type, TensorType)
        outputs, act = (name,), node.type.dtype
    prologue = node.attr("prologue") == "silu_mul"
    epilogue = node.attr("epilogue") or ""
    inputs = list(operands[ins])
    pre_quantized = isinstance(graph.node(inputs[0]).type, QActType)
    a4 = pre_quantized or node.attr("act_quant") is not None
    # The target where it changes a weight's code (E2M1 on an arch that converts it).
    specialised = next(
        filter(
            None, (for_target(target, w.format, w.out_features, w.in_features) for w in weights)
        ),
        None,
    )
    covers = (name, *node.attr("fused", ()))
    in_f = weights[0].in_features

    first_gemm = node.attr("gemm_from_m")
    gemm_from = first_gemm if isinstance(first_gemm, int) else ALL_M[1] + 1

    def args_of(ins_args: list[Arg], extra: list[Arg]) -> tuple[Arg, ...]:
        """The launch's arguments: inputs, every weight's buffers, outputs, extras, M."""
        return (
            *ins_args,
            *(
                Arg("weight", operands[ws][j], b)
                for j in range(len(weights))
                for b in (
                    *fragment_for(weights[j].format, weights[j].out_features, in_f).buffers,
                    *(("bias",) if weights[j].bias else ()),
                )
            ),
            *(Arg("value", o) for o in outputs),
            *(Arg("value", v) for v in operands[extras]),
            *extra,
            Arg("M"),
        )

    def launches(
        spec: GemvSpec, ins_args: list[Arg], extra: list[Arg], when: tuple[int, int]
    ) -> list[Launch]:
        """The GEMV below gemm_from, the GEMM per tile bucket from there, within `when`."""
        args = args_of(ins_args, extra)
        lo, hi = when
        out = []
        if lo < gemm_from:
            gemv_when = (lo, min(hi, gemm_from - 1))
            out.append(
                Launch(
                    gemv_kernel(spec), spec.grid_x, spec.m_tile, args, outputs, covers, gemv_when
                )
            )
        for bucket in bucket_ranges(max(lo, gemm_from), hi):
            g, g_args = GemmSpec.of(spec, bucket[1]), args
            if target.block_scaled_fp4_mma and spec.a4 and pre_quantized:
                # Blackwell's block-scaled MMA quantizes the 16-bit input itself, as the
                # quantize_act it replaces would (its mode and calibrated scale).
                q_attrs = dict(graph.node(inputs[0]).attrs)
                g = replace(g, native=True, a4_mode=act_quant_mode(q_attrs), target=target)
                g_args = args_of(x16, _scale_args(q_attrs))
            out.append(Launch(gemm_kernel(g), g.grid_x, g.tile.bm, g_args, outputs, covers, bucket))
        return out

    # The 16-bit path reads what quantize_act would have quantized.
    x16 = [Arg("value", v) for v in ([graph.operands(inputs[0])[0]] if pre_quantized else inputs)]
    norm = res_norm = None
    if node.attr("prologue") in ("rms_norm", "norm_residual"):
        nw, eps = graph.node(inputs[-1]).type, node.attr("eps")
        assert isinstance(nw, TensorType) and isinstance(eps, float)
        norm = (nw.dtype, eps)
        x16 = [Arg("value", inputs[0]), Arg("weight", inputs[-1], "weight")]
    if node.attr("prologue") == "norm_residual":
        # x, pw, res, nw; h is the last output
        pw, res_eps = graph.node(inputs[1]).type, node.attr("res_eps")
        assert isinstance(pw, TensorType) and isinstance(res_eps, float)
        assert isinstance(node.type, TupleType)
        res_norm = (pw.dtype, res_eps, len(outputs) == len(node.type.elements))
        x16 = [
            Arg("value", inputs[0]),
            Arg("weight", inputs[1], "weight"),
            Arg("value", inputs[2]),
            Arg("weight", inputs[3], "weight"),
        ]
    gate_act = str(node.attr("act", "silu"))
    plain = GemvSpec(
        weights,
        act,
        m_tile,
        prologue=prologue,
        epilogue=epilogue,
        norm=norm,
        target=specialised,
        gate_act=gate_act,
        cap=node.attr("cap"),
        res_norm=res_norm,
    )
    if not a4:
        one_row = replace(plain, m_tile=1)
        if gemm_from > 1 and int_act_fits(one_row):
            # Decode's row in integers (gemv.int_act_fits): the one row only, so that a batch of
            # more rows never pads into it or out of it (other numerics). Without a GEMV at
            # M = 1 (gemm_from_m 1) nothing splits.
            return [
                *launches(replace(one_row, int_act=True), x16, [], (1, 1)),
                *launches(plain, x16, [], (2, ALL_M[1])),
            ]
        return launches(plain, x16, [], ALL_M)
    mode = act_quant_mode(attrs) if prologue else "dynamic"
    quant = GemvSpec(
        weights,
        act,
        m_tile,
        prologue,
        epilogue,
        a4=True,
        a4_mode=mode,
        target=specialised,
        gate_act=gate_act,
        cap=node.attr("cap"),
    )
    scale = _scale_args(attrs) if prologue else []
    return [
        *launches(quant, [Arg("value", v) for v in inputs], scale, (1, W4A4_MAX_M)),
        *launches(plain, x16, [], (W4A4_MAX_M + 1, ALL_M[1])),
    ]


def _scale_args(attrs: Mapping[str, AttrValue]) -> list[Arg]:
    """The calibrated activation scale of a rule, if any, as a constant kernel argument."""
    args = []
    for key in ACT_SCALE_ATTRS & attrs.keys():
        value = attrs[key]
        assert isinstance(value, float)
        args.append(Arg("const", value=value))
    return args


def _lower_quantize_act(graph: Graph, name: str) -> Launch:
    node = graph.node(name)
    assert isinstance(node.type, QActType)
    attrs = dict(node.attrs)
    operands = graph.operands(name)
    # With an RMSNorm prologue the kernel reads x and the norm's weight (operands 1, 2).
    norm = graph.node(operands[2]).type if len(operands) == 3 else None
    assert norm is None or isinstance(norm, TensorType)
    spec = QuantizeActSpec(
        node.type, act_quant_mode(attrs), (norm.dtype, node.attr("eps")) if norm else None
    )
    scale = _scale_args(attrs)
    ins = (Arg("value", operands[1]), Arg("weight", operands[2], "weight")) if norm else ()
    args = (*(ins or (Arg("value", operands[0]),)), Arg("value", name), *scale, Arg("M"))
    return Launch(quantize_act_kernel(spec), 1, 1, args, (name,), (name,), (1, W4A4_MAX_M))


def lower(graph: Graph, m_tile: int = DEFAULT_M_TILE, target: Target = DEFAULT) -> Plan:
    """The plan of a passed graph for `target` (the host backend runs any target's kernels: it
    emulates the instructions they use)."""
    launches = []
    temps: dict[str, TensorType] = {}
    for name, node in graph.items():
        lowering = spec(node.op).lower
        if lowering is None:
            raise Unsupported(f"no kernel for %{name} = {node.op}")
        # Given the temps so far: launches of one router's ids share its grouping.
        new_launches, new_temps = lowering(graph, name, temps, m_tile, target)
        launches.extend(new_launches)
        temps.update(new_temps)
    return Plan(graph, _quantize_when_read(launches), temps, target)


def _lower_collective(graph: Graph, name: str) -> Launch:
    node = graph.node(name)
    x = graph.operands(name)[0]
    t = graph.node(x).type
    assert isinstance(t, TensorType) and isinstance(t.shape[1], int)
    kernel = collective_kernel(
        node.op, t.dtype, t.shape[1], node.attr("ranks"), node.attr("axis", 0)
    )
    args = (Arg("value", x), Arg("value", name), Arg("M"))
    # one call per run whatever M is: grid.y stays 1
    return Launch(kernel, 1, MAX_GRID_Y, args, (name,), (name,))


def _quantize_when_read(launches: list[Launch]) -> tuple[Launch, ...]:
    """quantize_act launches narrowed to the batch sizes at which a launch reads their codes (a
    block-scaled FP4 GEMM reads the 16-bit input instead)."""
    readers: dict[Arg, set[int]] = {}  # the launches (indices) each argument is passed to
    for i, r in enumerate(launches):
        for a in r.args:
            readers.setdefault(a, set()).add(i)
    out = []
    for i, la in enumerate(launches):
        if la.kernel.name.startswith("quantize_act_"):
            (codes,) = la.outputs
            ranges = [launches[j].when for j in readers.get(Arg("value", codes), set()) - {i}]
            if ranges:
                la = replace(la, when=(min(lo for lo, _ in ranges), max(hi for _, hi in ranges)))
        out.append(la)
    return tuple(out)


Lowered = tuple[list[Launch], dict[str, TensorType]]
# (graph, name, the temps so far, m_tile, target): OpSpec.lower
Lowering = Callable[[Graph, str, dict[str, TensorType], int, Target], Lowered]
MoeLowering = Callable[[Graph, str, Mapping[str, TensorType], Target], Lowered]
LayerLowering = Callable[[Graph, str], Lowered]


def _no_launch(graph: Graph, name: str, *_: object) -> Lowered:
    """Leaves, and projections of a multi-output launch's results."""
    return [], {}


def _elementwise(graph: Graph, name: str, *_: object) -> Lowered:
    node = graph.node(name)
    out = node.type
    assert isinstance(out, TensorType)
    n = out.shape[1]
    assert isinstance(n, int)
    args = (*(Arg("value", o) for o in graph.operands(name)), Arg("value", name), Arg("M"))
    kernel = elementwise_kernel(node.op, out.dtype, n, node.attr("cap"))
    return [Launch(kernel, elementwise_grid_x(n), 1, args, (name,), (name,))], {}


def _moe(fn: MoeLowering) -> Lowering:
    return lambda graph, name, temps, _, target: fn(graph, name, temps, target)


def _layer(fn: LayerLowering) -> Lowering:
    return lambda graph, name, *_: fn(graph, name)


LOWERINGS: dict[str, Lowering] = {
    **dict.fromkeys(("input", "weight", "get", "state"), _no_launch),
    "qlinear": lambda g, name, _, m_tile, target: (_lower_qlinear(g, name, m_tile, target), {}),
    "quantize_act": lambda g, name, *_: ([_lower_quantize_act(g, name)], {}),
    **{op: _moe(fn) for op, fn in MOE_LOWERINGS.items()},
    **{op: _layer(fn) for op, fn in LAYER_LOWERINGS.items()},
    **dict.fromkeys(
        ("all_reduce", "all_gather"), lambda g, name, *_: ([_lower_collective(g, name)], {})
    ),
    **dict.fromkeys(EXPRESSIONS, _elementwise),
}
for _op, _lowering in LOWERINGS.items():
    implement(_op, lower=_lowering)
