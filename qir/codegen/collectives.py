"""Collectives in a launch plan: an all_reduce or all_gather node becomes one launch whose
"kernel" is a CollectiveKernel, whose source is a note, not CUDA. The executor hands it to the communicator the
block was built with (qir.runtime.collectives: MPI on host buffers, NCCL on the device) in
program order between the kernels, so a plan stays one list of launches."""

from __future__ import annotations

from dataclasses import dataclass

from qir.codegen.kernel import Kernel, KernelParam
from qir.dtypes import DType

PARAMS = (
    KernelParam("x", "const void*", "buffer"),
    KernelParam("y", "void*", "buffer"),
    KernelParam("M", "int", "int"),
)


@dataclass(frozen=True)
class CollectiveKernel(Kernel):
    op: str = ""  # all_reduce or all_gather
    ranks: int = 1
    axis: int = 0  # all_gather's
    dtype_name: str = ""


def collective_kernel(op: str, dtype: DType, features: int, ranks: int, axis: int) -> Kernel:
    suffix = f"_axis{axis}" if op == "all_gather" else ""
    name = f"{op}_{dtype.name}_n{features}_r{ranks}{suffix}"
    # What `qir dump` writes for it: no CUDA, a note of what runs instead.
    note = (
        f"// {op} of {dtype.name} rows of {features} over {ranks} ranks: run by the block's "
        "communicator (qir/runtime/collectives.py: MPI on the host, NCCL on GPUs), not compiled\n"
    )
    return CollectiveKernel(
        name, note, PARAMS, (1, 1, 1), (), op=op, ranks=ranks, axis=axis, dtype_name=dtype.name
    )
