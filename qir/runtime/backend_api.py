"""What the executor needs from a backend: the Backend protocol and the launches it records.
It imports no backend, so the backends (qir.runtime.cuda, qir.runtime.host) implement it from
below and qir.runtime.backend, which picks one by name, sits above them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from qir.codegen.kernel import Kernel
from qir.runtime.cache import KernelCache
from qir.target import Target

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

    def prepare_many(self, kernels: Sequence[Kernel], done: Callable[[Kernel], None]) -> int:
        """Compile the distinct `kernels` into the caches without loading them (in parallel, as
        the backend sees fit), calling `done(kernel)` after each; returns the threads used. A
        block's kernels are prepared so, then loaded in order on the calling thread."""
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
