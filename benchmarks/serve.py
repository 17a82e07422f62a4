"""`qir serve` under load: N requests of mixed prompt and output lengths, sent all at once and
then the same requests one at a time, in one run, through the official OpenAI client (streamed,
greedy, `ignore_eos` so each request generates exactly its output length).

    python benchmarks/serve.py [CHECKPOINT] [--backend host|cuda] [--requests 16]
    python benchmarks/serve.py --url http://127.0.0.1:8000 [--api-key KEY]   # a running server
    python benchmarks/serve.py --url ... --requests 32 --api-load 8   # streams beside API work

Without --url it serves CHECKPOINT itself (default: the tiny tests/data/mlx_affine4_g64_S) on a
free loopback port. Per mode: requests/s and output tokens/s over the wall time, time to first
token and inter-token latency percentiles (p50/p90/p99; an inter-token gap is the time between
two streamed chunks, a chunk per token except where a token completes no character), and the
batching ratio: output tokens/s all at once over one at a time. A warm-up round (untimed) runs
first so that kernel compiles and captures stay out of the numbers. Last, the prefix cache: the
time to first token of prompts that repeat one long prefix (--prefix-words; its KV pages are
reused) against prompts whose prefixes are each new, one request at a time.

--api-load N adds a third mode: all at once again while N clients in another process keep the
server busy with work that is not generation (/tokenize of a long prompt, /metrics,
/v1/models, a refused completion), to see whether HTTP work slows the engine's steps. Each row
also has the server's own inter-token latency (its /metrics: the time between two tokens as
the engine pushed them, the client's timing left out). Serve from another process (--url) for
this: a server in this process shares the client's interpreter."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "tests" / "data" / "mlx_affine4_g64_S"
WORDS = [
    "the",
    "a",
    "model",
    "reads",
    "every",
    "token",
    "of",
    "its",
    "prompt",
    "then",
    "writes",
    "more",
    "words",
    "one",
    "at",
    "a",
    "time",
]
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int


@dataclass
class Timing:
    start: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    end: float = 0.0
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.start

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.chunks))


@dataclass
class Row:
    mode: str
    requests: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    ttft_ms: tuple[float, ...]  # p50, p90, p99
    itl_ms: tuple[float, ...]
    server_itl_ms: float = float("nan")  # mean, from the server's /metrics
    api_requests: int = 0  # other requests served meanwhile (--api-load)


def jobs(n: int, prompt_words: list[int], output_tokens: list[int], seed: int) -> list[Job]:
    """n requests crossing the prompt and output lengths, the prompts' words drawn at random."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = prompt_words[i % len(prompt_words)]
        tokens = output_tokens[(i // len(prompt_words) + i) % len(output_tokens)]
        out.append(Job(" ".join(rng.choice(WORDS, words)), tokens))
    return out


async def run(client: Any, model: str, job: Job) -> Timing:
    t = Timing(time.perf_counter())
    stream = await client.completions.create(
        model=model,
        prompt=job.prompt,
        max_tokens=job.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            t.chunks.append(time.perf_counter())
        if chunk.usage is not None:
            t.tokens = chunk.usage.completion_tokens
    t.end = time.perf_counter()
    if not t.chunks or t.tokens != job.max_tokens:
        raise RuntimeError(f"{job}: {t.tokens} tokens in {len(t.chunks)} chunks came back")
    return t


async def one_at_a_time(client: Any, model: str, todo: list[Job]) -> list[Timing]:
    return [await run(client, model, job) for job in todo]


async def all_at_once(client: Any, model: str, todo: list[Job]) -> list[Timing]:
    return list(await asyncio.gather(*(run(client, model, job) for job in todo)))


def row(mode: str, timings: list[Timing], wall: float) -> Row:
    def pct(values: list[float]) -> tuple[float, ...]:
        if not values:
            return tuple(float("nan") for _ in PERCENTILES)
        return tuple(float(np.percentile(values, p)) * 1e3 for p in PERCENTILES)

    tokens = sum(t.tokens for t in timings)
    gaps = [g for t in timings for g in t.gaps]
    return Row(
        mode,
        len(timings),
        wall,
        len(timings) / wall,
        tokens / wall,
        pct([t.ttft for t in timings]),
        pct(gaps),
    )


def server_itl(url: str) -> tuple[float, float]:
    """The server's inter-token latency histogram: (sum of seconds, count)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics") as r:
        text = r.read().decode()
    got = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"vllm:inter_token_latency_seconds_{part}"):
                got[part] = float(line.rsplit(" ", 1)[1])
    return got.get("sum", float("nan")), got.get("count", float("nan"))


def api_load(url: str, api_key: str, clients: int, stop: Any, served: Any) -> None:
    """`clients` threads sending requests that are not generation, until `stop` is set."""
    import http.client
    import threading
    from urllib.parse import urlsplit

    where = urlsplit(url)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    long_prompt = " ".join(WORDS * 60)
    calls = [
        ("POST", "/tokenize", json.dumps({"prompt": long_prompt})),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0})),  # 400
    ]

    def client(i: int) -> None:
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        n = i
        while not stop.is_set():
            method, path, body = calls[n % len(calls)]
            conn.request(method, path, body, headers)
            conn.getresponse().read()
            n += 1
            with served.get_lock():
                served.value += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


async def measure(url: str, api_key: str, todo: list[Job], warmup: int, load: int = 0) -> list[Row]:
    import multiprocessing

    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    for _ in range(warmup):
        await all_at_once(client, model, todo)
    rows = []
    modes = [("one at a time", one_at_a_time, 0), ("all at once", all_at_once, 0)]
    if load:
        modes.append((f"+ {load} API", all_at_once, load))
    for mode, how, clients in modes:
        ctx = multiprocessing.get_context("spawn")
        stop, served = ctx.Event(), ctx.Value("i", 0)
        loader = ctx.Process(target=api_load, args=(url, api_key, clients, stop, served))
        if clients:
            loader.start()
            while served.value < clients:  # the load is on before the streams start
                await asyncio.sleep(0.01)
        before = server_itl(url)
        t0 = time.perf_counter()
        timings = await how(client, model, todo)
        r = row(mode, timings, time.perf_counter() - t0)
        after = server_itl(url)
        r.server_itl_ms = (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1e3
        if clients:
            stop.set()
            loader.join()
            r.api_requests = served.value
        rows.append(r)
    await client.close()
    return rows


async def ttft(client: Any, model: str, prompt: str) -> float:
    """Seconds to the first streamed token of `prompt` (greedy, one token)."""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, stream=True
    )
    first = None
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter()
    return (first or time.perf_counter()) - t0


async def prefix_cache(url: str, api_key: str, words: int, repeats: int, seed: int) -> dict:
    """TTFT of prompts that share a long prefix (the prefix cache holds its KV pages after the
    first) against prompts whose prefixes are each new (cold), one request at a time."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    rng = np.random.default_rng(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS, n))

    shared = text(words)
    await ttft(client, model, f"{shared} {text(2)}")  # compiles, and caches the prefix
    cold = [await ttft(client, model, f"{text(words)} {text(2)}") for _ in range(repeats)]
    warm = [await ttft(client, model, f"{shared} {text(2)}") for _ in range(repeats)]
    await client.close()
    c, w = float(np.median(cold)) * 1e3, float(np.median(warm)) * 1e3
    return {"prefix_words": words, "cold_ttft_ms": c, "repeated_prefix_ttft_ms": w, "ratio": c / w}


def show(rows: list[Row], todo: list[Job]) -> None:
    prompts = sorted({len(j.prompt.split()) for j in todo})
    outputs = sorted({j.max_tokens for j in todo})
    print(f"{len(todo)} requests; prompts of {prompts} words, {outputs} output tokens; greedy")
    head = f"{'mode':14} {'req/s':>7} {'out tok/s':>9}  {'TTFT ms p50/p90/p99':>22}"
    print(f"{head}  {'ITL ms p50/p90/p99':>22}  {'server ITL ms':>13}  {'wall s':>7}")
    for r in rows:
        ttft = "/".join(f"{v:.0f}" for v in r.ttft_ms)
        itl = "/".join(f"{v:.0f}" for v in r.itl_ms)
        load = f"  ({r.api_requests} API requests meanwhile)" if r.api_requests else ""
        print(
            f"{r.mode:14} {r.requests_per_s:7.2f} {r.tokens_per_s:9.1f}  {ttft:>22}  {itl:>22}  "
            f"{r.server_itl_ms:13.1f}  {r.wall_s:7.2f}{load}"
        )
    ratio = rows[1].tokens_per_s / rows[0].tokens_per_s
    print(f"batching ratio (output tokens/s, all at once / one at a time): {ratio:.2f}x")


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--url", help="a running server (default: serve CHECKPOINT here)")
    ap.add_argument("--api-key", default="none", help="the running server's key")
    ap.add_argument("--backend", help="host or cuda (default: best available)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, nargs="+", default=[4, 12, 24])
    ap.add_argument("--output-tokens", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--api-load", type=int, default=0, help="clients sending other requests (a third mode)"
    )
    ap.add_argument(
        "--prefix-words",
        type=int,
        default=24,
        help="words of the shared prefix of the prefix-cache TTFT rows (0: skip them)",
    )
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    todo = jobs(args.requests, args.prompt_words, args.output_tokens, args.seed)
    with ExitStack() as stack:
        url = args.url
        if url is None:
            from qir.runtime.backend import best_backend
            from qir.serving import Engine
            from qir.serving.http import background, create_app

            engine = Engine.load(args.checkpoint, backend=args.backend or best_backend())
            for line in engine.describe():
                print(line)
            url = stack.enter_context(background(create_app(engine)))
        try:
            rows = asyncio.run(measure(url, args.api_key, todo, args.warmup, args.api_load))
            cache = None
            if args.prefix_words:
                cache = asyncio.run(
                    prefix_cache(url, args.api_key, args.prefix_words, 5, args.seed)
                )
        except Exception as e:  # a refusal (a request past the context, a wrong key): one line
            status = getattr(e, "status_code", None)
            if status is None:
                raise
            raise SystemExit(f"serve.py: the server answered {status}: {e}") from None
    show(rows, todo)
    if cache is not None:
        print(
            f"prefix cache, {cache['prefix_words']}-word prefix, one at a time, TTFT p50: "
            f"cold {cache['cold_ttft_ms']:.0f} ms, repeated prefix "
            f"{cache['repeated_prefix_ttft_ms']:.0f} ms ({cache['ratio']:.2f}x)"
        )
    if args.json:
        out = {"rows": [asdict(r) for r in rows], "prefix_cache": cache}
        args.json.write_text(json.dumps(out, indent=1))
    return rows


if __name__ == "__main__":
    main()
