"""Collectives as IR ops: type rules, printed IR, interpreter semantics over a thread group,
and a peer that never arrives."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from qir import interpret
from qir.builder import Builder
from qir.collectives import (
    CollectiveTimeout,
    LocalGroup,
    all_gather,
    all_reduce,
    reduce_sum,
    run_threads,
)
from qir.dtypes import F16, F32
from qir.interpret import BindError
from qir.ops import IRTypeError
from qir.parser import parse
from qir.printer import print_graph
from qir.types import TensorType


def _graph(ranks: int = 2):
    b = Builder("model.rank0of2")
    x = b.input("x", ("M", 8), F16)
    r = b.all_reduce(x, ranks, name="r")
    g = b.all_gather(r, axis=1, ranks=ranks, name="g")
    b.output("y", g)
    return b.graph


def test_types_and_printed_ir_round_trip():
    g = _graph()
    assert g.node("r").type == TensorType(("M", 8), F16)
    assert g.node("g").type == TensorType(("M", 16), F16)
    text = print_graph(g)
    assert "graph model.rank0of2 {" in text
    assert "%r = all_reduce %x {ranks=2} : f16[M, 8]" in text
    assert "%g = all_gather %r {axis=1, ranks=2} : f16[M, 16]" in text
    assert print_graph(parse(text)) == text


@pytest.mark.parametrize(
    ("axis", "ranks", "error"),
    [
        (0, 2, r"axis 0 of %x: f16\[M, 8\] is symbolic"),
        (2, 2, "axis 2 out of range"),
        (1, 0, "ranks must be a positive int, got 0"),
    ],
)
def test_bad_collectives_are_refused(axis, ranks, error):
    b = Builder()
    x = b.input("x", ("M", 8), F16)
    with pytest.raises(IRTypeError, match=error):
        b.all_gather(x, axis=axis, ranks=ranks)


def _ranks(n, fn):
    return run_threads(n, fn, timeout=10)


def test_all_reduce_sums_in_rank_order_and_every_rank_agrees():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((3, 5)).astype(np.float16) for _ in range(4)]
    want = ((parts[0].astype(np.float32) + parts[1]) + parts[2]) + parts[3]
    got = _ranks(4, lambda c: all_reduce(c, parts[c.rank]))
    for g in got:
        assert g.dtype == np.float16
        np.testing.assert_array_equal(g, want.astype(np.float16))
    gathered = _ranks(4, lambda c: all_gather(c, parts[c.rank], axis=1))
    for g in gathered:
        np.testing.assert_array_equal(g, np.concatenate(parts, axis=1))
    # twice in a row: the second exchange does not see the first one's buffers
    twice = _ranks(2, lambda c: [all_reduce(c, parts[c.rank]), all_reduce(c, parts[2 + c.rank])])
    np.testing.assert_array_equal(twice[1][1], reduce_sum(parts[2:], np.dtype(np.float16)))


def test_interpreter_runs_ranks_over_a_group():
    g = _graph()
    xs = [np.full((2, 8), r + 1, np.float16) for r in range(2)]
    outs = _ranks(2, lambda c: interpret(g, {"x": xs[c.rank]}, {}, comm=c)["y"])
    for o in outs:
        np.testing.assert_array_equal(o, np.full((2, 16), 3, np.float16))


def test_interpreter_needs_a_group_of_the_graphs_ranks():
    g = _graph()
    x = {"x": np.ones((1, 8), np.float16)}
    with pytest.raises(BindError, match=r"%r: all_reduce over 2 ranks, but the run has no comm"):
        interpret(g, x, {})
    with pytest.raises(BindError, match="but the run has a group of 1"):
        interpret(g, x, {}, comm=LocalGroup(1).comm(0))
    one = _graph(ranks=1)
    assert interpret(one, x, {})["y"].shape == (1, 8)


def test_a_missing_peer_times_out_with_a_message():
    group = LocalGroup(2, timeout=0.3)
    t0 = time.perf_counter()
    with pytest.raises(CollectiveTimeout, match=r"rank 0: all_reduce timed out after 0.3 s"):
        all_reduce(group.comm(0), np.zeros(4, np.float32))
    assert time.perf_counter() - t0 < 5
    assert reduce_sum([np.ones(2, np.float32)], np.dtype(np.float32)).tolist() == [1, 1]
    assert F32.np == np.float32


def test_a_rank_that_fails_ends_its_peers_with_its_own_error():
    def fn(c):
        if c.rank == 1:
            raise ValueError("rank 1 broke")
        return all_reduce(c, np.zeros(2, np.float32))

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="rank 1 broke"):
        run_threads(2, fn, timeout=30)
    assert time.perf_counter() - t0 < 5  # rank 0 did not sit out its timeout


class _SlowBarrier:
    """An MPI communicator whose ranks meet in a barrier after `tests` polls."""

    def __init__(self, tests: int) -> None:
        self.tests, self.polls = tests, 0

    def Ibarrier(self):
        return self

    def Test(self):
        self.polls += 1
        return self.polls > self.tests

    def bcast(self, obj, root):
        return ("from root", obj)

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2


def test_mpi_bcast_waits_for_its_root_past_the_collective_timeout_sleeping(monkeypatch):
    """A chat's or a server's followers wait in a bcast as long as rank 0 idles: no timeout
    there, and sleeps between polls instead of MPICH's spinning blocking bcast."""
    from qir.runtime.collectives import MpiComm

    fake = _SlowBarrier(40)
    comm = MpiComm(fake, timeout=1e-3)
    t0 = time.perf_counter()
    assert comm.bcast("line") == ("from root", "line")
    assert fake.polls == 41 and time.perf_counter() - t0 > comm.timeout
    fake.polls = 0

    def exit_(code):
        raise AssertionError(f"exited with {code}")

    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(AssertionError, match="exited with 3"):  # a collective still times out
        comm.barrier("%x")
