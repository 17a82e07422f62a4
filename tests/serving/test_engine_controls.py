"""The engine's scores and sampling controls against by-hand references on the interpreter
(float32): logprobs and prompt_logprobs are the log-softmax of the model's logits; penalties,
logit_bias and seeded draws follow vLLM's formulas and the sample op's definition step by step;
min_tokens, stop_token_ids, bad_words and allowed_token_ids restrict the greedy choice as they
say; n samples are the requests with seeds seed + i; a prompt's full KV pages are reused across
requests (counted), evicted least recently used under pressure, and change no id. Each request
run beside others gets what it gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from qir.dtypes import F32
from qir.errors import UsageError
from qir.models import Model
from qir.sampling import Sampling, sample_row
from qir.serving import Delta, Engine, Request
from qir.serving.rules import Rules
from tests.conftest import DATA

CKPT = DATA / "mlx_affine4_g64_S"
PROMPT = (1, 40, 41, 42, 43, 44, 45)
LONG = tuple(range(1, 40))  # two full pages and a partial one


def run(engine: Engine, requests: Sequence[Request], one_by_one: bool = False) -> list[list[Delta]]:
    """Every request at once (or each after the last ended); each one's deltas, in request
    order. The engine is shut down after."""

    async def main() -> list[list[Delta]]:
        engine.start()

        async def one(r: Request) -> list[Delta]:
            return [d async for d in engine.submit(r)]

        try:
            if one_by_one:
                return [await one(r) for r in requests]
            return list(await asyncio.gather(*(one(r) for r in requests)))
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def ids(deltas: list[Delta], index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.token_ids]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.load(CKPT, act=F32, max_seq=64)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def engine(**options: object) -> Engine:
    return Engine.load(CKPT, act=F32, max_seq=64, max_batch=4, chunk=8, **options)  # type: ignore[arg-type]


def test_logprobs_are_the_log_softmax_of_the_models_logits(model: Model) -> None:
    r = Request(PROMPT, 5, Sampling(), ignore_eos=True, logprobs=3, prompt_logprobs=2)
    other = Request((1, 7, 9), 6, Sampling(temperature=1.0, seed=3), ignore_eos=True)
    got, _ = run(engine(), [r, other])
    out = ids(got)
    lp = log_softmax(model.logits(list(PROMPT) + out[:-1]))
    prompt = got[0].prompt_scores
    assert prompt is not None and prompt[0] is None and len(prompt) == len(PROMPT)
    for p, score in enumerate(prompt[1:], start=1):
        assert score is not None and score.token == PROMPT[p]
        assert score.logprob == pytest.approx(lp[p - 1, PROMPT[p]], abs=1e-5)
        best = sorted(range(lp.shape[1]), key=lambda t: -lp[p - 1, t])[:2]
        assert [t for t, _ in score.top] == best
    scores = [s for d in got for s in d.scores]
    assert [s.token for s in scores] == out
    for i, s in enumerate(scores):
        row = lp[len(PROMPT) - 1 + i]
        assert s.logprob == pytest.approx(row[out[i]], abs=1e-5)
        assert [t for t, _ in s.top] == list(np.argsort(-row, kind="stable")[:3])
        assert [v for _, v in s.top] == pytest.approx(np.sort(row)[::-1][:3], abs=1e-5)
    assert got[-1].cumulative_logprob == pytest.approx(sum(s.logprob for s in scores), abs=1e-4)
    # Alone, the same ids and scores (to the interpreter's rounding, which numpy's matmul
    # varies with the batch: the host kernels' rows are bit-exact, test_engine.py).
    (alone,) = run(engine(), [r])
    lone = [s for d in alone for s in d.scores]
    assert [(s.token, [t for t, _ in s.top]) for s in lone] == [
        (s.token, [t for t, _ in s.top]) for s in scores
    ]
    assert [s.logprob for s in lone] == pytest.approx([s.logprob for s in scores], abs=1e-5)


def vllm_adjusted(
    z: np.ndarray, prompt: Sequence[int], out: Sequence[int], rules: Rules
) -> np.ndarray:
    """vLLM's logit_bias, then apply_penalties, over dense per-token counts (by hand)."""
    z = z.astype(np.float32).copy()
    for t, b in rules.logit_bias.items():
        z[t] = np.float32(z[t] + np.float32(b))
    counts = np.bincount(np.array(out, int), minlength=len(z)).astype(np.float32)
    seen = counts > 0
    seen[list(prompt)] = True
    rep = np.float32(rules.repetition_penalty)
    z = np.where(seen, np.where(z > 0, z / rep, z * rep), z).astype(np.float32)
    z = (z - (np.float32(rules.frequency_penalty) * counts).astype(np.float32)).astype(np.float32)
    return (z - np.where(counts > 0, np.float32(rules.presence_penalty), 0)).astype(np.float32)


@pytest.mark.parametrize(
    "rules",
    [
        Rules(repetition_penalty=1.7),
        Rules(frequency_penalty=1.5, presence_penalty=-0.5, logit_bias={7: 3.0, 100: -2.5}),
    ],
    ids=["repetition", "frequency-presence-bias"],
)
def test_penalties_and_bias_follow_vllms_formulas_step_by_step(model: Model, rules: Rules) -> None:
    sampling = Sampling(temperature=0.8, top_k=40, seed=2**40 + 9)
    r = Request(PROMPT, 8, sampling, ignore_eos=True, rules=rules)
    plain = Request(PROMPT, 8, sampling, ignore_eos=True)
    got, unpenalized = run(engine(), [r, plain])
    out = ids(got)
    want: list[int] = []
    row = sampling.row()
    for _ in range(8):
        seq = list(PROMPT) + want
        z = vllm_adjusted(model.logits(seq)[-1], PROMPT, want, rules)
        want.append(sample_row(z, row, sampling.seed, len(seq) - 1))
    assert out == want
    assert out != ids(unpenalized)  # the penalties changed the draws


def test_restrictions_change_the_greedy_choice_as_they_say(model: Model) -> None:
    (free,) = run(engine(), [Request(PROMPT, 6, Sampling(), ignore_eos=True)])
    x = ids(free)
    z = model.logits(list(PROMPT) + x[:2])[-1]
    second = int(np.argsort(-z, kind="stable")[1]) if x[2] == int(np.argmax(z)) else None
    allowed = frozenset({x[0], 3, 200})
    stop, held, banned, only = run(
        engine(),
        [
            Request(PROMPT, 6, Sampling(), stop_token_ids=frozenset({x[2]})),
            Request(
                PROMPT, 6, Sampling(), stop_token_ids=frozenset({x[2]}), rules=Rules(min_tokens=5)
            ),
            Request(PROMPT, 6, Sampling(), ignore_eos=True, rules=Rules(bad_words=((x[1],),))),
            Request(PROMPT, 6, Sampling(), ignore_eos=True, rules=Rules(allowed_token_ids=allowed)),
        ],
    )
    assert ids(stop) == x[:3] and stop[-1].finish_reason == "stop"
    assert ids(held)[:2] == x[:2] and ids(held)[2] == second and len(ids(held)) >= 5
    assert ids(banned)[0] == x[0] and ids(banned)[1] != x[1] and x[1] not in ids(banned)
    assert set(ids(only)) <= allowed and ids(only)[0] == x[0]


def test_n_samples_are_the_requests_with_seeds_seed_plus_i() -> None:
    sampling = Sampling(temperature=1.0, seed=11)
    e = engine()
    (together,) = run(e, [Request(LONG, 5, sampling, ignore_eos=True, n=3, logprobs=0)])
    assert e.scheduler.pool.reused >= 2 * 2  # samples 1 and 2 took the prompt's two full pages
    alone = [
        ids(
            run(
                engine(prefix_caching=False),
                [Request(LONG, 5, Sampling(1.0, seed=11 + i), ignore_eos=True)],
            )[0]
        )
        for i in range(3)
    ]
    assert [ids(together, i) for i in range(3)] == alone
    assert sum(d.finish_reason is not None for d in together) == 3
    ends = [d for d in together if d.finish_reason is not None]
    assert all(d.cumulative_logprob is not None for d in ends)


def test_samples_copy_the_shared_partial_page_and_draw_the_same() -> None:
    """n samples of LONG (two full pages, seven ids on a third): the first computes the prompt,
    the others take its full pages and copy its partial page's rows, feeding only the last id;
    greedy, every sample is what the prompt gives without prefix caching."""
    reqs = [Request(LONG, 6, Sampling(), ignore_eos=True, n=3)]
    warm, cold = engine(), engine(prefix_caching=False)
    (shared,), (alone,) = run(warm, reqs), run(cold, reqs)
    assert warm.scheduler.prefilled == len(LONG) + 2 * 1
    assert cold.scheduler.prefilled == 3 * len(LONG)
    assert warm.scheduler.pool.reused == 2 * 2
    want = ids(alone, 0)
    assert [ids(shared, i) for i in range(3)] == [want] * 3 == [ids(alone, i) for i in range(3)]


def test_prefix_pages_are_reused_evicted_under_pressure_and_change_nothing() -> None:
    other = tuple(range(100, 139))
    reqs = [Request(p, 4, Sampling(), ignore_eos=True) for p in (LONG, other, (*LONG, 5), other)]
    cold = engine(prefix_caching=False)
    want = [ids(d) for d in run(cold, reqs, one_by_one=True)]
    # Room for one sequence at full context (4 pages): the other prompt's pages push the first
    # one's last full page out, its first stays.
    small = engine(kv_cache_gb=4 * 16 * 2048 / 2**30)
    assert small.scheduler.pool.pages == 4
    assert [ids(d) for d in run(small, reqs, one_by_one=True)] == want
    pool, counters = small.scheduler.pool, small.scheduler.counters
    assert pool.evicted > 0 and pool.reused > 0
    warm = engine()
    assert [ids(d) for d in run(warm, reqs, one_by_one=True)] == want
    # LONG's two pages hit for LONG + (5,), other's for the second other.
    assert warm.scheduler.counters.prefix_cache_hits == 4 * 16
    # the time-to-first-token gain, counted: the ids found in cached pages are not prefilled
    assert warm.scheduler.prefilled == cold.scheduler.prefilled - 4 * 16
    assert warm.scheduler.pool.free == warm.scheduler.pool.pages
    assert counters.prefix_cache_queries == sum(len(r.prompt) for r in reqs)


def test_what_a_request_cannot_have_is_refused() -> None:
    e = engine()
    for request, message in [
        (Request(PROMPT, 2, logprobs=21), "logprobs must be in 0..20"),
        (Request(PROMPT, 2, rules=Rules(logit_bias={999: 1.0})), "logit_bias: token id 999"),
        (Request(PROMPT, 2, rules=Rules(allowed_token_ids=frozenset())), "allowed_token_ids"),
        (Request(PROMPT, 2, stop_token_ids=frozenset({-1})), "stop_token_ids"),
        (Request(PROMPT, 2, n=0), "n must be at least 1"),
    ]:
        with pytest.raises(UsageError, match=message):
            e.check(request)
    with pytest.raises(UsageError, match="repetition_penalty must be a number > 0"):
        Rules(repetition_penalty=0)
    with pytest.raises(UsageError, match=r"frequency_penalty must be a number in \[-2, 2\]"):
        Rules(frequency_penalty=3)
    with pytest.raises(UsageError, match="bias must be in"):
        Rules(logit_bias={1: 101.0})
