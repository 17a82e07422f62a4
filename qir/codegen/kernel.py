"""What codegen hands the runtime: a rendered kernel and how to call it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class KernelParam:
    name: str
    c_type: str  # as written in the signature, e.g. "const uint4* __restrict__", "int"
    kind: Literal["buffer", "int"]  # buffer: a device pointer; int: a 32-bit signed scalar


@dataclass(frozen=True)
class Kernel:
    """One `extern "C" __global__` function in a self-contained CUDA source.

    `source` includes only CUDA toolkit headers (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h, stdint.h)
    and the files in `headers`, which are written beside the .cu when it is dumped.
    """

    name: str
    source: str
    params: tuple[KernelParam, ...]
    block: tuple[int, int, int]
    headers: tuple[tuple[str, str], ...] = field(default=())  # (file name, text)
    # Whether a thread ever waits for another (a barrier, shuffle or vote, the tensor-core
    # emulation's exchanges): the generator says so, from its template. The host backend runs a
    # block of a kernel that does not as a plain loop over its threads, with no fiber switches.
    collectives: bool = True
