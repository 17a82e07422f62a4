"""/metrics in Prometheus' text format, under vLLM's metric names (so that dashboards and
alerts written for vLLM read qir's): the engine's state, read when scraped (running and waiting
requests, KV-cache usage, token, preemption and prefix-cache counts), and each finished
request's timings (time to first token, inter-token latency, end to end) and sizes.

Every app has its own registry: several servers in one process (tests) do not share counts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from qir.serving.engine import Engine, Stream

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds; a decode step of a small model on a GPU takes milliseconds, a long prompt seconds.
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0),
)
TOKEN_BUCKETS = tuple(float(2**k) for k in range(0, 21))


class _EngineCounts(Collector):
    """The engine's counters, as counters (their values are the engine's, read at scrape)."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine, self.name = engine, name

    def collect(self) -> Iterator[Metric]:
        c = self.engine.scheduler.counters
        for metric, help, value in (
            ("vllm:prompt_tokens", "Prompt tokens prefilled.", c.prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated.", c.generation_tokens),
            ("vllm:num_preemptions", "Sequences preempted.", self.engine.scheduler.preempted),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up.", c.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found cached.", c.prefix_cache_hits),
        ):
            family = CounterMetricFamily(metric, help, labels=["model_name"])
            family.add_metric([self.name], value)
            yield family


class Metrics:
    def __init__(self, engine: Engine, name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCounts(engine, name))
        reg = self.registry
        for metric, help, read in (
            ("vllm:num_requests_running", "Requests running.", lambda: engine.running),
            ("vllm:num_requests_waiting", "Requests waiting.", lambda: engine.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache pages in use (0..1).", lambda: engine.kv_usage),
        ):
            Gauge(metric, help, ["model_name"], registry=reg).labels(name).set_function(read)

        def histogram(metric: str, help: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(metric, help, ["model_name"], registry=reg, buckets=buckets)
            return h.labels(name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens.", LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS
        )
        self.prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens.", TOKEN_BUCKETS)
        self.generated = histogram(
            "vllm:request_generation_tokens", "Tokens generated.", TOKEN_BUCKETS
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests finished, by why.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.name = name

    def finished(self, stream: Stream) -> None:
        """Record a request the server is done with (finished or cancelled: "abort")."""
        times = stream.token_times
        if times:
            self.ttft.observe(times[0] - stream.arrived)
            for a, b in itertools.pairwise(times):
                self.itl.observe(b - a)
            self.e2e.observe(times[-1] - stream.arrived)
        self.prompt.observe(len(stream.request.prompt))
        self.generated.observe(len(times))
        self.success.labels(self.name, stream.finish_reason or "abort").inc()
