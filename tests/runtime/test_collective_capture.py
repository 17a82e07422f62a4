"""Collectives inside a captured step: a communicator that can be captured (NCCL, on the
compute stream) has its collectives recorded with the kernels, one recording (one CUDA graph
on the cuda backend); any other (MPI, a thread group: host buffers exchanged when called)
splits the replay around each collective. On the host the decision is checked with a thread
group that says it is capturable, whose collectives the host backend's recording then calls
in place; on a GPU (scripts/gpu_check.sh's gpu tests) NCCL's calls are recorded in a CUDA graph
with a kernel and replayed on new inputs, on a communicator of one rank: NCCL refuses two
ranks on one device, and a lent machine has one GPU."""

from __future__ import annotations

import ctypes
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import qir
from qir import interpret, parse
from qir.collectives import LocalComm, LocalGroup, run_threads
from qir.dtypes import F32
from qir.models import Model, load
from qir.models.shards import shard_weights
from qir.passes.tensor_parallel import TensorParallel
from qir.runtime.executor import replay_steps
from tests.conftest import DATA
from tests.passes.test_layer_passes import weights_for
from tests.passes.test_tensor_parallel import MLP
from tests.requires import requires


class Capturable:
    """A thread group's rank that says its collectives may be recorded (as NCCL's are)."""

    capturable = True

    def __init__(self, comm: LocalComm) -> None:
        self.inner = comm
        self.rank, self.size = comm.rank, comm.size
        self.exchanges = 0

    def exchange(self, a: np.ndarray, what: str) -> list[np.ndarray]:
        self.exchanges += 1
        return self.inner.exchange(a, what)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.inner.bcast(obj, root)


def _rank_block(c: Any) -> qir.Compiled:
    graph = parse(MLP)
    TensorParallel(2, c.rank).run(graph)
    weights = shard_weights(graph, weights_for(MLP, np.random.default_rng(0)))
    return qir.compile(graph, weights, backend="host", comm=c)


def _x(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((3, 64)).astype(np.float32)}


@pytest.mark.parametrize("capturable", [False, True])
def test_the_communicator_decides_one_recording_or_a_split_replay(capturable):
    weights = weights_for(MLP, np.random.default_rng(0))
    want = [interpret(parse(MLP), _x(s), weights)["y"] for s in (1, 2)]

    def rank(c):
        comm = Capturable(c) if capturable else c
        cap = _rank_block(comm).capture(3)
        before = getattr(comm, "exchanges", 0)
        outs = [np.array(cap(_x(s))["y"]) for s in (1, 2)]
        return cap.steps, outs, getattr(comm, "exchanges", 0) - before

    for steps, outs, exchanged in run_threads(2, rank, timeout=120):
        if capturable:  # the all_reduce is a step of the one recording, run by each replay
            assert steps == ("recording",) and exchanged == 2
        else:  # the kernels recorded, then the all_reduce called (nothing after it)
            assert steps == ("recording", "all_reduce_f32_n64_r2")
        for got, y in zip(outs, want, strict=True):
            np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-6)


def test_replay_steps_keep_launch_order_around_collectives():
    """Kernels a, b, then an MPI-like all_reduce, kernel c, a capturable all_gather, kernel d:
    [a, b], the all_reduce, [c, gather, d]."""
    from qir.codegen.collectives import collective_kernel
    from qir.collectives import LocalGroup
    from qir.runtime.backend import InStream
    from qir.runtime.collectives import CollectiveRunner

    group = LocalGroup(2)
    reduce = CollectiveRunner(collective_kernel("all_reduce", F32, 8, 2, 0), group.comm(0), False)
    gather = CollectiveRunner(
        collective_kernel("all_gather", F32, 8, 2, 1), Capturable(group.comm(0)), False
    )
    one, args = (1, 1, 1), [np.zeros(8, np.float32), np.zeros(8, np.float32), 1]
    launches = [("a", one, ()), ("b", one, ()), (reduce, one, args), ("c", one, ())]
    steps = replay_steps([*launches, (gather, one, args), ("d", one, ())])
    assert [type(s).__name__ for s in steps] == ["list", "InStream", "list"]
    assert [k for k, _, _ in steps[0]] == ["a", "b"] and steps[1].name == "all_reduce_f32_n8_r2"
    c, bound, d = (k for k, _, _ in steps[2])
    assert (c, d) == ("c", "d") and isinstance(bound, InStream)
    assert bound.name == "all_gather_f32_n8_r2_axis1"


def test_a_tp_decode_step_captured_whole_generates_as_one_split():
    """Model.generate's decode step (a capture at M = 1) on 2 ranks: with the collectives in
    the recording, the same ids and logits as the split replay and as one rank."""
    ck = load(DATA / "mlx_affine4_g64_S")
    prompt = [3, 10, 17, 24, 31]

    def rank(c, capturable):
        m = Model(ck, backend="host", act=F32, max_seq=32, comm=Capturable(c) if capturable else c)
        got = m.generate(prompt, 3, do_sample=False)
        return got, m._decode.steps

    want = Model(ck, backend="host", act=F32, max_seq=32).generate(prompt, 3, do_sample=False)
    split = run_threads(2, lambda c: rank(c, False), timeout=600)
    whole = run_threads(2, lambda c: rank(c, True), timeout=600)
    for (a, split_steps), (b, whole_steps) in zip(split, whole, strict=True):
        assert whole_steps == ("recording",)
        assert split_steps.count("recording") > 1 and len(split_steps) > 2
        np.testing.assert_array_equal(b.tokens, want.tokens)
        np.testing.assert_array_equal(b.logits, a.logits)  # the same collectives, in place


class _Stream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None: ...


class _Array(np.ndarray):
    """A host array standing in for a CuPy one: `.data.ptr` is its address."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])


def _at(ptr: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * count).from_address(ptr))


class _FakeNccl:
    """NCCL's communicator over a thread group, on float32 addresses; records each call's
    stream."""

    def __init__(self, size: int, group: Any, rank: int) -> None:
        self.comm, self.streams = group.comm(rank), []

    def allReduce(self, src, dst, count, dtype, op, stream):
        self.streams.append(stream)
        _at(dst, count)[:] = sum(self.comm.exchange(_at(src, count).copy(), "allReduce"))

    def allGather(self, src, dst, count, dtype, stream):
        self.streams.append(stream)
        parts = self.comm.exchange(_at(src, count).copy(), "allGather")
        _at(dst, count * len(parts))[:] = np.concatenate(parts)


def test_nccl_runner_enqueues_on_the_stream_given_and_allocates_before(monkeypatch):
    """The NCCL path without a GPU: CuPy and NCCL faked over host memory and a thread group.
    Bound once (the all_gather's rank-major rows allocated then), each call enqueues on the
    stream it is given, reads x as it is at the call, and allocates nothing (a capture may
    record it); the all_gather's rows land in y [M, ranks * n] in rank order."""
    from qir.codegen.collectives import collective_kernel
    from qir.runtime.collectives import CollectiveRunner, NcclComm

    allocations = []

    def empty(shape, dtype):
        allocations.append(threading.get_ident())
        return np.zeros(shape, dtype).view(_Array)

    nccl = SimpleNamespace(
        NCCL_FLOAT32=7,
        NCCL_SUM=0,
        get_unique_id=lambda: LocalGroup(2),  # rank 0's "id": the group the ranks join
        NcclCommunicator=_FakeNccl,
    )
    cuda = SimpleNamespace(nccl=nccl, get_current_stream=lambda: _Stream(0))
    fake = SimpleNamespace(cuda=cuda, empty=empty, moveaxis=np.moveaxis)
    for name, module in (("cupy", fake), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)

    def rank(c):
        comm = NcclComm(c)
        m, n = 2, 3
        x = np.zeros((m, n), np.float32).view(_Array)
        out = {
            op: np.zeros((m, n * ranks), np.float32).view(_Array)
            for op, ranks in (("all_reduce", 1), ("all_gather", 2))
        }
        bound = [
            CollectiveRunner(collective_kernel(op, F32, n, 2, 1), comm, device=True).bind([x, y, m])
            for op, y in out.items()
        ]
        made = allocations.count(threading.get_ident())  # the all_gather's rows
        x[...] = np.arange(m * n).reshape(m, n) + 10 * c.rank  # written after the bind
        for b in bound:
            b.enqueue(_Stream(77))
        assert allocations.count(threading.get_ident()) == made == 1 and comm.capturable
        return comm.c.streams, {k: np.array(v) for k, v in out.items()}

    for streams, out in run_threads(2, rank, timeout=30):
        assert streams == [77, 77]
        base = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_array_equal(out["all_reduce"], 2 * base + 10)
        np.testing.assert_array_equal(out["all_gather"], np.concatenate([base, base + 10], 1))


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires("gpu", "nccl")
def test_nccl_collectives_are_nodes_of_the_cuda_graph():
    """axpy, then NCCL's all_reduce and all_gather (one rank), captured into one CUDA graph:
    a replay on new inputs carries them through both collectives, so both are in the graph."""
    import cupy
    import cupy.testing
    from test_nvrtc import HEADER_AXPY  # sibling module (tests/runtime is on sys.path)

    from qir.codegen.collectives import collective_kernel
    from qir.collectives import LocalGroup
    from qir.runtime.collectives import CollectiveRunner, NcclComm
    from qir.runtime.cuda import CudaBackend

    be = CudaBackend()
    comm = NcclComm(LocalGroup(1).comm(0))  # the unique id "broadcast" to itself
    assert comm.capturable
    m, n = 4, 250
    rng = np.random.default_rng(0)
    x, b = (cupy.asarray(rng.standard_normal(m * n).astype(np.float32)) for _ in range(2))
    y, reduced, gathered = (cupy.zeros((m, n), np.float32) for _ in range(3))
    runners = [
        CollectiveRunner(collective_kernel(op, F32, n, 1, 1), comm, device=True)
        for op in ("all_reduce", "all_gather")
    ]
    stream = cupy.cuda.Stream(non_blocking=True)
    replay = be.record(
        [
            (be.load(HEADER_AXPY), (-(-m * n // 64), 1, 1), (x, b, y, m * n)),
            (runners[0].bind([y, reduced, m]), (1, 1, 1), ()),
            (runners[1].bind([reduced, gathered, m]), (1, 1, 1), ()),
        ]
    )
    for seed in (1, 2):
        x[...] = cupy.asarray(np.random.default_rng(seed).standard_normal(m * n), np.float32)
        replay(stream)
        stream.synchronize()
        want = (2 * x + b).reshape(m, n)
        cupy.testing.assert_allclose(reduced, want, rtol=1e-6)
        cupy.testing.assert_allclose(gathered, want, rtol=1e-6)
