"""Elementwise kernels (silu, mul, add) over [M, N] activations, computed in fp32."""

from __future__ import annotations

from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.render import common_header, render
from qir.dtypes import DType

THREADS = 256

# C expressions over the operands' float values (av, bv); Python picks them, the template
# only substitutes.
EXPRESSIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "silu": (("a",), "qir_silu(av)"),
    "mul": (("a", "b"), "av * bv"),
    "add": (("a", "b"), "av + bv"),
}


def elementwise_name(op: str, act: DType, n: int) -> str:
    return f"ew_{op}_{act.name}_n{n}"


def elementwise_kernel(op: str, act: DType, n: int) -> Kernel:
    operands, expr = EXPRESSIONS[op]
    name = elementwise_name(op, act, n)
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
    return Kernel(name, source, params, (THREADS, 1, 1), (common_header(),))


def elementwise_grid_x(n: int) -> int:
    return -(-n // THREADS)
