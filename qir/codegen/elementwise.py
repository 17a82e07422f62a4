"""Elementwise kernels (silu, gelu_tanh, softcap, mul, add) over [M, N] activations, computed in
fp32."""

from __future__ import annotations

from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.render import common_header, render
from qir.dtypes import DType

THREADS = 256

# C expressions over the operands' float values (av, bv); Python picks them, the template
# only substitutes.
EXPRESSIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "silu": (("a",), "qir_silu(av)"),
    "gelu_tanh": (("a",), "qir_gelu_tanh(av)"),
    "softcap": (("a",), "tanhf(av / CAP) * CAP"),
    "mul": (("a", "b"), "av * bv"),
    "add": (("a", "b"), "av + bv"),
}


def elementwise_name(op: str, act: DType, n: int, cap: float | None = None) -> str:
    spelled = "" if cap is None else f"_c{cap:g}".replace(".", "p").replace("+", "")
    return f"ew_{op}{spelled}_{act.name}_n{n}"


def elementwise_kernel(op: str, act: DType, n: int, cap: float | None = None) -> Kernel:
    """The kernel of `op`; softcap's `cap` is a constant of its source (and its name)."""
    operands, expr = EXPRESSIONS[op]
    if cap is not None:
        expr = expr.replace("CAP", f"{float(cap)!r}f")
    name = elementwise_name(op, act, n, cap)
    act_t = act.c_type
    source = render(
        "elementwise.cu.j2",
        name=name,
        op=op,
        operands=operands,
        expr=expr,
        act_t=act_t,
        N=n,
        threads=THREADS,
    )
    params = (
        *(KernelParam(a, f"const {act_t}* __restrict__", "buffer") for a in operands),
        KernelParam("y", f"{act_t}* __restrict__", "buffer"),
        KernelParam("M", "int", "int"),
    )
    return Kernel(name, source, params, (THREADS, 1, 1), (common_header(),), collectives=False)


def elementwise_grid_x(n: int) -> int:
    return -(-n // THREADS)
