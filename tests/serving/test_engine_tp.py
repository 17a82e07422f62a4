"""The serving engine on tensor-parallel ranks (threads of one group here; `qir serve --tp N`
runs them as MPI processes): rank 0's engine broadcasts each step, the other ranks repeat it,
and every sequence gets the ids it gets from the unsplit model."""

from __future__ import annotations

import pytest

from qir.collectives import run_threads
from qir.dtypes import F32
from qir.models import Model
from qir.sampling import Sampling
from qir.serving import Engine, Request
from qir.serving.engine import follow_engine
from tests.serving.test_engine import CKPT, alone, requests, serve, serve_deltas


@pytest.mark.parametrize("backend", ["reference", "host"])
def test_ranks_serve_what_one_model_gives(backend: str) -> None:
    reqs = requests(sampled=True)[:3]  # the host's captured decode batches of 1 and 2 rows
    options = {"backend": backend, "act": F32, "max_batch": 2, "chunk": 4, "max_seq": 64}

    def rank(comm):
        if comm.rank == 0:
            engine = Engine.load(CKPT, comm=comm, **options)
            return serve(engine, reqs), engine.scheduler.steps
        return follow_engine(CKPT, comm=comm, **{k: v for k, v in options.items() if k != "chunk"})

    (got, steps), followed = run_threads(2, rank, timeout=300)
    model = Model.load(CKPT, backend=backend, act=F32, max_seq=64)
    assert got == [alone(model, r) for r in reqs]
    assert followed >= steps  # every step (and each capture) ran on rank 1 too


def test_ranks_copy_a_shared_partial_page_too() -> None:
    """n=2 samples of a prompt ending mid-page: the second copies the first's partial page on
    every rank (a copy the followers repeat), so both are the unsplit model's greedy ids."""
    request = Request(tuple(range(1, 21)), 4, Sampling(), ignore_eos=True, n=2)
    options = {"backend": "reference", "act": F32, "max_batch": 2, "max_seq": 64}

    def rank(comm):
        if comm.rank == 0:
            engine = Engine.load(CKPT, comm=comm, chunk=8, **options)
            deltas = serve_deltas(engine, request)
            return [[t for d in deltas if d.index == i for t in d.token_ids] for i in (0, 1)], (
                engine.scheduler.prefilled
            )
        return follow_engine(CKPT, comm=comm, **options)

    (got, prefilled), _ = run_threads(2, rank, timeout=300)
    want = alone(Model.load(CKPT, backend="reference", act=F32, max_seq=64), request)
    assert got == [want, want] and prefilled == 20 + 1
