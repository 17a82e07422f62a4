"""The interface the executor needs from a backend, and picking one by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from qir.codegen.kernel import Kernel
from qir.errors import UsageError

BACKENDS = ("reference", "host", "cuda")


class Backend(Protocol):
    name: str

    def load(self, kernel: Kernel) -> Any: ...

    def launch(self, loaded: Any, grid: tuple[int, int, int], args: Sequence[Any]) -> None: ...

    def to_device(self, a: np.ndarray) -> Any: ...

    def from_device(self, a: Any) -> np.ndarray: ...

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any: ...

    def synchronize(self) -> None: ...


def get_backend(name: str) -> Backend:
    """A kernel backend: 'host' (CPU) or 'cuda' (CuPy). 'reference' needs no backend."""
    if name == "host":
        from qir.runtime.host import HostBackend

        return HostBackend()
    if name == "cuda":
        from qir.runtime.cuda import CudaBackend

        return CudaBackend()
    raise UsageError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def best_backend() -> str:
    from qir.runtime.cuda import available

    return "cuda" if available() else "host"
