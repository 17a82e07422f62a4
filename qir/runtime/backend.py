"""The interface the executor needs from a backend, and picking one by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from qir.codegen.kernel import Kernel
from qir.errors import UsageError
from qir.runtime.cache import KernelCache
from qir.target import DEFAULT, Target

BACKENDS = ("reference", "host", "cuda")

# (loaded kernel, grid, arguments): one launch with its memory bound.
BoundLaunch = tuple[Any, tuple[int, int, int], Sequence[Any]]


@dataclass(frozen=True)
class InStream:
    """A step of the launches to record that is not a kernel: `enqueue(stream)` puts its work
    on the stream it is given (a NCCL collective on the compute stream). A recording keeps it
    in place among the kernels: the cuda backend calls it on the capture stream, so it becomes
    nodes of the CUDA graph; the host backend calls it in turn at each replay. Bound as
    (InStream, (1, 1, 1), ())."""

    name: str
    enqueue: Callable[[Any], None]


class Backend(Protocol):
    name: str
    cache: KernelCache

    @property
    def target(self) -> Target | None:
        """The target a plan must be for to run here (a GPU's), or None: any (the host
        emulates every target's instructions)."""
        ...

    def load(self, kernel: Kernel) -> Any: ...

    def prepare(self, kernel: Kernel) -> None:
        """Compile `kernel` into the caches without loading it. Must be safe to call from any
        thread: a block's kernels are prepared in parallel, then loaded in order."""
        ...

    def launch(
        self, loaded: Any, grid: tuple[int, int, int], args: Sequence[Any], stream: Any = None
    ) -> None: ...

    def record(self, launches: Sequence[BoundLaunch]) -> Callable[[Any], None]:
        """Launches bound once, replayed by calling the result with a stream (the cuda backend
        captures a CUDA graph); an InStream among them is recorded in place."""
        ...

    def accept(self, a: Any) -> tuple[Any, bool]:
        """An input as a backend array, and whether results should stay on the device."""
        ...

    def to_device(self, a: np.ndarray) -> Any: ...

    def from_device(self, a: Any) -> np.ndarray: ...

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any: ...

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """`shape` x `dtype` at byte `offset` of a uint8 arena from `empty`."""
        ...

    def copy_into(self, dst: Any, src: Any) -> None:
        """Copy a numpy array or an accepted backend array into `dst`, on the current stream."""
        ...

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Makes `stream` current for allocations and copies; yields the backend's stream."""
        ...

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


def default_target() -> Target:
    """The target when none is named: this machine's GPU, else qir.target.DEFAULT."""
    from qir.runtime.cuda import device_target

    return device_target() or DEFAULT


def resolve_target(target: str | Target | None, backend: Backend | None) -> Target:
    """The target a plan for `backend` is lowered for: a GPU backend's own (naming another is an
    error: its kernels may not run there), else `target`, else default_target()."""
    named = Target(target) if isinstance(target, str) else target
    own = backend.target if backend is not None else None
    if backend is not None and own is not None:
        if named is not None and named != own:
            raise UsageError(
                f"target {named.arch}: the {backend.name} backend runs on {own.arch} (its GPU); "
                "other targets run on --backend host"
            )
        return own
    return named or default_target()
