"""The serving engine: continuous batching over a paged KV cache. Every sequence gets the ids it
gets alone (batches, chunked prompts, preemption and recompute, on the interpreter and the host
kernels), pages come back when sequences end or are cancelled, and what a request cannot have
is refused before it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from qir.dtypes import F32
from qir.errors import UsageError
from qir.models import Model
from qir.sampling import Sampling
from qir.serving import Engine, EngineClosed, QueueFull, Request
from qir.serving.engine import Delta
from tests.conftest import DATA

CKPT = DATA / "mlx_affine4_g64_S"
PROMPTS = [[1, 5, 9], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [1, 7], [1, 3, 3, 3, 3]]


def serve(engine: Engine, requests: Sequence[Request]) -> list[list[int]]:
    """Every request at once; each one's ids, in request order."""

    async def main() -> list[list[int]]:
        engine.start()

        async def one(r: Request) -> list[int]:
            return [t for d in [d async for d in engine.submit(r)] for t in d.token_ids]

        try:
            return list(await asyncio.gather(*(one(r) for r in requests)))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def alone(model: Model, r: Request) -> list[int]:
    s = r.sampling
    gen = model.generate(
        list(r.prompt),
        r.max_tokens,
        ignore_eos=r.ignore_eos,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        seed=s.seed,
    )
    return gen.tokens.tolist()


def requests(sampled: bool) -> list[Request]:
    out = []
    for i, p in enumerate(PROMPTS * 2):
        s = Sampling(temperature=1.2, top_k=40, seed=i) if sampled else Sampling()
        out.append(Request(tuple(p), 3 + i % 5, s, ignore_eos=True))
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_sequence_gets_its_ids_alone(sampled: bool) -> None:
    engine = Engine.load(CKPT, act=F32, max_batch=4, chunk=4, max_seq=64)
    reqs = requests(sampled)
    got = serve(engine, reqs)
    model = Model.load(CKPT, act=F32, max_seq=64)
    assert got == [alone(model, r) for r in reqs]
    assert engine.scheduler.pool.free == engine.scheduler.pool.pages  # every page came back
    # Batches ran: fewer steps than the requests' tokens one at a time.
    assert engine.scheduler.steps < sum(r.max_tokens for r in reqs)


def test_host_kernels_batch_bit_for_bit() -> None:
    """Decode batches of up to 8 rows (the GEMV: a row's sums the same at every batch size)
    give each sequence the bytes it gets alone."""
    engine = Engine.load(CKPT, backend="host", max_batch=8, max_seq=64)
    reqs = requests(True)
    got = serve(engine, reqs)
    model = Model.load(CKPT, backend="host", max_seq=64)
    assert got == [alone(model, r) for r in reqs]


def test_preempted_sequences_are_recomputed_and_continue() -> None:
    # Room for 4 sequences of 64 positions, 2 pages each at first: 8 long requests must take
    # turns, and running ones run out of pages and preempt the last admitted.
    engine = Engine.load(CKPT, act=F32, max_batch=8, max_seq=64, kv_cache_gb=4 * 64 * 2048 / 2**30)
    assert engine.scheduler.pool.pages == 16
    reqs = [Request(tuple(p), 40, Sampling(), ignore_eos=True) for p in PROMPTS * 2]
    got = serve(engine, reqs)
    assert engine.scheduler.preempted > 0
    model = Model.load(CKPT, act=F32, max_seq=64)
    assert got == [alone(model, r) for r in reqs]
    assert engine.scheduler.pool.free == 16


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes() -> None:
    engine = Engine.load(CKPT, act=F32, max_batch=4, chunk=4, max_seq=64)
    order: list[str] = []

    async def main() -> None:
        engine.start()
        short = engine.submit(Request((1, 5), 12, Sampling(), ignore_eos=True))

        async def read(stream, tag: str) -> None:
            async for _ in stream:
                order.append(tag)

        first = asyncio.create_task(read(short, "short"))
        await asyncio.sleep(0)
        long = engine.submit(Request(tuple(range(1, 30)), 2, Sampling(), ignore_eos=True))
        await asyncio.gather(first, read(long, "long"))
        await engine.shutdown()

    asyncio.run(main())
    # The 29-token prompt takes 8 chunks of 4; the short sequence keeps decoding meanwhile.
    assert order.count("short") == 12 and order.count("long") == 2
    assert order.index("long") > 4


def test_cancelled_streams_free_their_pages() -> None:
    engine = Engine.load(CKPT, act=F32, max_batch=4, max_seq=64)

    async def main() -> int:
        engine.start()
        stream = engine.submit(Request((1, 2, 3), 50, Sampling(), ignore_eos=True))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                stream.cancel()
                break
        keep = [d async for d in engine.submit(Request((1, 2), 5, Sampling(), ignore_eos=True))]
        await engine.shutdown()
        return len(keep)

    assert asyncio.run(main()) == 5
    assert engine.scheduler.idle and engine.scheduler.pool.free == engine.scheduler.pool.pages


def test_stop_strings_and_eos_end_sequences_with_their_reasons() -> None:
    engine = Engine.load(CKPT, act=F32, max_seq=64)
    model = Model.load(CKPT, act=F32, max_seq=64)
    free = alone(model, Request((1, 5, 9), 8, Sampling(), ignore_eos=True))
    text = model.tokenizer.decode(free)

    async def main() -> list:
        engine.start()
        stop = text[2:4]
        a = [d async for d in engine.submit(Request((1, 5, 9), 8, Sampling(), (stop,)))]
        b = [d async for d in engine.submit(Request((1, 5, 9), 3, Sampling()))]
        await engine.shutdown()
        return [a, b]

    a, b = asyncio.run(main())
    assert "".join(d.text for d in a) == text[: text.find(text[2:4])]
    assert a[-1].finish_reason == "stop" and b[-1].finish_reason == "length"
    assert b[-1].prompt_tokens == 3 and b[-1].completion_tokens == 3


def test_what_a_request_cannot_have_is_refused_before_it_runs() -> None:
    engine = Engine.load(CKPT, act=F32, max_seq=32, max_queue=2)

    async def main() -> None:
        with pytest.raises(UsageError, match="past --max-seq 32"):
            engine.submit(Request(tuple(range(1, 30)), 10))
        with pytest.raises(UsageError, match="outside the vocabulary"):
            engine.submit(Request((1, 999), 2))
        with pytest.raises(UsageError, match="max_tokens must be at least 1"):
            engine.submit(Request((1, 2), 0))
        engine.submit(Request((1, 2), 2))
        engine.submit(Request((1, 2), 2))
        with pytest.raises(QueueFull, match="2 requests are waiting"):
            engine.submit(Request((1, 2), 2))
        engine.start()
        await engine.shutdown()
        with pytest.raises(EngineClosed):
            engine.submit(Request((1, 2), 2))

    asyncio.run(main())
    with pytest.raises(UsageError, match="less than one sequence of --max-seq 64"):
        Engine.load(CKPT, act=F32, max_seq=64, kv_cache_gb=1e-6)


def test_describe_says_what_fits() -> None:
    engine = Engine.load(CKPT, act=F32, max_seq=64, max_batch=4)
    lines = engine.describe()
    assert "context 64 tokens" in lines[0] and "up to 4 sequences" in lines[0]
    assert "16 pages of 16 tokens" in lines[1] and "4 sequence(s) at full context" in lines[1]


def test_a_rows_logits_do_not_depend_on_the_other_rows_of_its_bucket() -> None:
    """A decode step of 6 sequences in a bucket of 8 gives each row the bytes of that sequence
    decoded alone in the same bucket (the other rows padding)."""
    model = Model.load(CKPT, backend="host", max_seq=32, kv_pages=16)
    block, rng = model.block, np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 3 + i).tolist() for i in range(6)]
    tables = [np.array([2 * i, 2 * i + 1], np.int32) for i in range(6)]
    for ids, table in zip(prompts, tables, strict=True):  # each prompt's K/V rows in its pages
        model.compiled(block.token_inputs(np.array(ids), 0, table))
    step = model.compiled.capture(8, rows="many")

    def decode(members: list[int]) -> np.ndarray:
        inputs = block.token_inputs(np.zeros(8, np.int64), 0)
        inputs["pos"][:] = -1
        for r in members:
            inputs["ids"][r] = prompts[r][-1]
            inputs["pos"][r] = len(prompts[r])
            inputs["pages"][r] = np.pad(tables[r], (0, block.table_pages - 2))
        return np.asarray(step(inputs)["logits"]).copy()

    together = decode(list(range(6)))
    for r in range(6):
        assert together[r].tobytes() == decode([r])[r].tobytes(), r


def test_a_sliding_window_model_serves_sequences_from_rings_of_pages() -> None:
    """Mistral (window 8) with rings of one page per sequence (a prefill chunk of 4: the
    window plus 4 less one fit in 16 positions): batched, with prompts prefilled in chunks and
    sequences running past their ring, each sequence gets the ids a full cache gives it."""
    ck = DATA / "mlx_affine4_mistral"
    engine = Engine.load(ck, act=F32, max_batch=4, chunk=8, max_seq=64, prefill_chunk=4)
    assert (engine.model.block.table_pages, engine.scheduler.chunk) == (1, 8)
    reqs = [
        Request(tuple((7 * i + 3 * j) % 256 for j in range(n)), 10, Sampling(), ignore_eos=True)
        for i, n in enumerate((3, 12, 20, 5))
    ]
    got = serve(engine, reqs)
    full = Model.load(ck, act=F32, max_seq=64)  # no ring: max_seq's 4 pages a sequence
    assert full.block.table_pages == 4
    assert got == [alone(full, r) for r in reqs]
    assert engine.scheduler.pool.free == engine.scheduler.pool.pages


def test_a_failed_step_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """The clients hear a step's failure as an error delta; the operator's log gets the
    exception with its traceback (no client message carries one)."""
    engine = Engine.load(CKPT, act=F32, max_seq=64)
    scheduler = engine.scheduler
    step = scheduler.step

    def fail_once() -> None:
        scheduler.step = step  # type: ignore[method-assign]
        raise RuntimeError("boom")

    scheduler.step = fail_once  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="qir.serving"):
        deltas = serve_deltas(engine, Request((1, 2, 3), 4, Sampling(), ignore_eos=True))
    assert deltas[-1].finish_reason == "error" and deltas[-1].error == "RuntimeError: boom"
    (record,) = [r for r in caplog.records if r.name == "qir.serving"]
    assert record.getMessage() == "engine step failed; ending its 1 request(s)"
    assert record.exc_info is not None and record.exc_info[1] is not None
    assert str(record.exc_info[1]) == "boom" and "fail_once" in caplog.text  # the traceback


def serve_deltas(engine: Engine, request: Request) -> list[Delta]:
    async def main() -> list[Delta]:
        engine.start()
        try:
            return [d async for d in engine.submit(request)]
        finally:
            await engine.shutdown()

    return asyncio.run(main())
