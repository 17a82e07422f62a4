"""Collectives of a launch plan at run time: a CollectiveRunner calls its communicator on the
backend's buffers, in program order between the kernels.

- host backend: the buffers are numpy arrays; the communicator is a thread group
  (qir.collectives.LocalGroup, tests) or MPI between processes (MpiComm below), each
  exchanging the buffers and summing in rank order, so every rank holds the same bits.
- cuda backend: NCCL (cupy.cuda.nccl) on the block's stream, its unique id broadcast over MPI
  (`device_comm`). ncclAllReduce sums in its own order, so results may differ from the host's
  in the last bits. NCCL enqueues on a stream, so a captured decode step records its
  collectives in the one CUDA graph (`CollectiveRunner.capturable`); MPI and thread groups
  exchange host buffers when called, and a capture replays in pieces around them. Written, not
  yet run across ranks on a device (no GPU was lent to the sessions that wrote it; one GPU
  cannot hold two NCCL ranks: tests/runtime/test_collective_capture.py runs a rank of one).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qir import collectives
from qir.codegen.collectives import CollectiveKernel
from qir.collectives import DEFAULT_TIMEOUT, Comm
from qir.dtypes import by_name
from qir.errors import UsageError
from qir.runtime.backend_api import InStream


class CollectiveRunner:
    """One collective launch bound to a communicator (the executor calls it with the launch's
    arguments: x, y, M)."""

    def __init__(self, kernel: CollectiveKernel, comm: Any, device: bool) -> None:
        self.kernel = kernel
        self.comm = comm
        self.device = device
        self.dtype = by_name(kernel.dtype_name).np

    @property
    def capturable(self) -> bool:
        """Whether a recording of the launches (a decode step's CUDA graph) may hold this
        collective: its communicator says so (`capturable`: NCCL, which enqueues its work on
        the stream it is given). MPI and thread groups exchange host buffers when called, which
        no CUDA graph can replay: the executor splits the recording around them."""
        return bool(getattr(self.comm, "capturable", False))

    def bind(self, args: Sequence[Any], capture: bool = True) -> InStream:
        """The collective on fixed buffers, enqueued on the stream it is called with: what a
        recording holds. What it needs besides x and y (an all_gather's rank-major rows on a
        device) is allocated here, outside any capture, and kept alive by the result."""
        x, y, _ = args
        k = self.kernel
        if self.device:
            return InStream(k.name, _nccl(self.comm, k, x, y, warm=capture))

        def host(stream: Any) -> None:
            xs = np.asarray(x).view(self.dtype)
            if k.op == "all_reduce":
                result = collectives.all_reduce(self.comm, xs, k.name)
            else:
                result = collectives.all_gather(self.comm, xs, k.axis, k.name)
            np.asarray(y).view(self.dtype)[...] = result

        return InStream(k.name, host)

    def __call__(self, args: Sequence[Any], stream: Any = None) -> None:
        self.bind(args, capture=False).enqueue(stream)


def collective_runner(kernel: CollectiveKernel, backend: Any, comm: Any) -> CollectiveRunner:
    if kernel.ranks == 1:
        raise UsageError(f"{kernel.name}: a collective over one rank should not be in a plan")
    if comm is None:
        raise UsageError(
            f"{kernel.name}: the block has collectives over {kernel.ranks} ranks; compile it "
            "with comm= (qir.collectives.LocalGroup, or MpiComm under mpiexec)"
        )
    if comm.size != kernel.ranks:
        raise UsageError(
            f"{kernel.name}: a group of {comm.size} ranks runs a plan for {kernel.ranks}"
        )
    return CollectiveRunner(kernel, comm, backend.name == "cuda")


# The exit status of a job a rank ended because a collective timed out.
EXIT_TIMEOUT = 3


class MpiComm:
    """One rank per MPI process (mpi4py). An exchange is an Iallgather polled until `timeout`
    seconds: where a rank died or hangs, the first rank to give up prints why (naming itself
    and the collective) and ends the job (every rank exits), instead of waiting
    forever."""

    def __init__(self, mpi_comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.c = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.timeout = timeout

    @property
    def rank(self) -> int:
        return int(self.c.Get_rank())

    @property
    def size(self) -> int:
        return int(self.c.Get_size())

    def exchange(self, a: np.ndarray, what: str) -> list[np.ndarray]:
        raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        out = np.empty((self.size, raw.size), np.uint8)
        req = self.c.Iallgather(raw, out)
        self._wait(req, what)
        return [row.view(a.dtype).reshape(a.shape) for row in out]

    def barrier(self, what: str = "barrier") -> None:
        self._wait(self.c.Ibarrier(), what)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """`root`'s object on every rank. The ranks meet in a barrier polled with sleeps first,
        with no timeout: a follower may wait as long as its leader idles (a chat's user typing,
        a server with no requests), and MPICH's blocking calls would spin a core meanwhile."""
        self._wait(self.c.Ibarrier(), "bcast", deadline=False)
        return self.c.bcast(obj, root)

    def _wait(self, req: Any, what: str, deadline: bool = True) -> None:
        end = time.monotonic() + self.timeout if deadline else float("inf")
        pause = 1e-5
        while not req.Test():
            if time.monotonic() > end:
                self._abort(
                    f"{what} timed out after {self.timeout:g} s waiting for the other "
                    f"{self.size - 1} rank(s) (one died or hangs)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _abort(self, message: str) -> None:
        """Say why and end this rank unfinalized: MPI_Finalize would wait for the collective
        that never completes. An exit, not MPI_Abort: mpiexec (MPICH's and Open MPI's) forwards
        an exited rank's output to its end and then ends the job's other ranks, where MPI_Abort
        raced the forwarding and lost this line on a loaded machine."""
        sys.stderr.write(f"qir: error: rank {self.rank}: {message}\n")
        sys.stderr.flush()
        os._exit(EXIT_TIMEOUT)


class NcclComm:
    """A NCCL communicator for this MPI rank's GPU: rank 0 makes the unique id, MPI broadcasts
    it, every rank joins. Its collectives are enqueued on the compute stream, so a captured
    decode step holds them in its CUDA graph (NCCL >= 2.9). Not yet run on a device with more
    than one rank (see the module docstring)."""

    nccl = True
    capturable = True

    def __init__(self, mpi: MpiComm) -> None:
        from cupy.cuda import nccl

        self.mpi = mpi
        uid = nccl.get_unique_id() if mpi.rank == 0 else None
        uid = mpi.bcast(uid)
        self.c = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
        self.rank, self.size = mpi.rank, mpi.size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Host objects (the serving followers' steps) still go over MPI."""
        return self.mpi.bcast(obj, root)


def device_comm(mpi: MpiComm) -> NcclComm:
    """This rank's GPU (rank modulo the devices this process sees) and a NCCL communicator on
    it. A NCCL collective has no timeout of its own: a dead peer ends the job through mpiexec."""
    import cupy

    cupy.cuda.Device(mpi.rank % cupy.cuda.runtime.getDeviceCount()).use()
    return NcclComm(mpi)


_NCCL_TYPES = {"f16": "NCCL_FLOAT16", "bf16": "NCCL_BFLOAT16", "f32": "NCCL_FLOAT32"}


def _nccl(comm: NcclComm, k: CollectiveKernel, x: Any, y: Any, warm: bool) -> Callable[[Any], None]:
    """The NCCL call of `k` on x and y, enqueued on the stream it is given (None: the current
    one). Nothing is allocated when it is called, so a CUDA-graph capture may record it; `warm`
    (for a capture): CuPy's copy kernel compiled first, not while capturing."""
    import cupy
    from cupy.cuda import nccl

    dtype = getattr(nccl, _NCCL_TYPES[k.dtype_name])

    def ptr(stream: Any) -> int:
        return int((stream or cupy.cuda.get_current_stream()).ptr)

    if k.op == "all_reduce":

        def reduce(stream: Any) -> None:
            comm.c.allReduce(x.data.ptr, y.data.ptr, x.size, dtype, nccl.NCCL_SUM, ptr(stream))

        return reduce
    # ncclAllGather concatenates whole buffers (rank-major); the gathered axis is the last one
    # here, so rows [ranks, M, n] are copied into y [M, ranks * n] seen as [M, ranks, n].
    rows = cupy.empty((k.ranks, *x.shape), x.dtype)
    parts = y.reshape(*y.shape[:-1], k.ranks, x.shape[-1])  # a view: y is contiguous
    ranked = cupy.moveaxis(rows, 0, -2)
    if warm:
        parts[...] = ranked  # y's values are the gather's to write, later

    def gather(stream: Any) -> None:
        comm.c.allGather(x.data.ptr, rows.data.ptr, x.size, dtype, ptr(stream))
        with stream or cupy.cuda.get_current_stream():
            parts[...] = ranked

    return gather


__all__ = ["CollectiveRunner", "Comm", "MpiComm", "NcclComm", "collective_runner"]
