"""Collectives between the ranks of a tensor-parallel group: what `all_reduce` and `all_gather`
compute, and the communicators that carry them.

One rule for every engine: an all_reduce sums every rank's buffer in float32 in rank order
(rank 0 + rank 1 + ...) and rounds once to the value's dtype. Every rank computes that same
sum from the gathered buffers, so all ranks hold bit-identical results (each rank then samples
the same next id) and the numpy interpreter, the thread group and MPI agree bit for bit. An
all_gather concatenates the ranks' buffers along an axis in rank order.

Communicators: `LocalGroup(n)` runs n ranks as threads of one process (the interpreter's and
the tests' multi-rank runs, no MPI needed); `MpiComm` (qir.runtime.collectives) runs one rank
per process. Both time out: a rank that waits longer than `timeout` seconds for the others
raises CollectiveTimeout naming the collective (MpiComm: prints it and aborts the MPI job), so
a dead rank ends its peers instead of hanging them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from qir.errors import QirError

# Seconds a rank waits for its peers inside one collective before it gives up.
DEFAULT_TIMEOUT = 60.0


class CollectiveTimeout(QirError, RuntimeError):
    """A collective's peers did not arrive in time (a rank died or hangs)."""


def reduce_sum(parts: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The all_reduce of `parts` (one per rank, in rank order): float32 sums, rounded once."""
    total = np.asarray(parts[0], np.float32).copy()
    for p in parts[1:]:
        total += np.asarray(p, np.float32)
    return total.astype(dtype)


def gather(parts: Sequence[np.ndarray], axis: int) -> np.ndarray:
    """The all_gather of `parts` (one per rank, in rank order) along `axis`."""
    return np.concatenate([np.asarray(p) for p in parts], axis=axis)


class Comm(Protocol):
    """One rank's end of a group."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def exchange(self, a: np.ndarray, what: str) -> list[np.ndarray]:
        """Every rank's `a` (same shape and dtype on every rank), in rank order; `what` names
        the collective in a timeout's message."""
        ...

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """`root`'s host object on every rank (a seed, a serving step)."""
        ...


def all_reduce(comm: Comm, a: np.ndarray, what: str = "all_reduce") -> np.ndarray:
    return reduce_sum(comm.exchange(np.ascontiguousarray(a), what), a.dtype)


def all_gather(comm: Comm, a: np.ndarray, axis: int, what: str = "all_gather") -> np.ndarray:
    return gather(comm.exchange(np.ascontiguousarray(a), what), axis)


class LocalGroup:
    """`size` ranks as threads of this process: `group.comm(r)` is rank r's end."""

    def __init__(self, size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.size = size
        self.timeout = timeout
        self._slots: list[Any] = [None] * size
        self._barrier = threading.Barrier(size)

    def comm(self, rank: int) -> LocalComm:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a group of {self.size}")
        return LocalComm(self, rank)

    def _wait(self, rank: int, what: str) -> None:
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise CollectiveTimeout(
                f"rank {rank}: {what} timed out after {self.timeout:g} s waiting for the other "
                f"{self.size - 1} rank(s) (one died or hangs)"
            ) from None


def run_threads(
    size: int, fn: Callable[[Comm], Any], timeout: float = DEFAULT_TIMEOUT
) -> list[Any]:
    """fn(comm) for each rank of a LocalGroup of `size`, on its own thread: the results in rank
    order. The first rank's exception (in rank order) is raised once every thread has ended."""
    group = LocalGroup(size, timeout)
    out: list[Any] = [None] * size
    failed: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        try:
            out[rank] = fn(group.comm(rank))
        except BaseException as e:  # handed to the caller below
            failed[rank] = e
            group._barrier.abort()  # the peers stop waiting for this rank

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next(
        (e for e in failed if e is not None and not isinstance(e, CollectiveTimeout)), None
    )
    first = first or next((e for e in failed if e is not None), None)
    if first is not None:
        raise first
    return out


class LocalComm:
    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.group.size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """`root`'s obj on every rank (the serving followers' next step)."""
        g = self.group
        g._slots[self._rank] = obj
        g._wait(self._rank, "bcast")
        out = g._slots[root]
        g._wait(self._rank, "bcast")
        return out

    def exchange(self, a: np.ndarray, what: str) -> list[np.ndarray]:
        g = self.group
        g._slots[self._rank] = a.copy()
        g._wait(self._rank, what)  # every slot is written
        parts = [p for p in g._slots if p is not None]
        g._wait(self._rank, what)  # every rank has read them before the next exchange writes
        return parts
