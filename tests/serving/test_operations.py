"""`qir serve` as an operator runs it: vLLM's /metrics, /tokenize, /detokenize, /version and
/v1/models/{id}; strict request types; a 4 MB prompt that neither stalls the server nor keeps
its memory (tokenizing happens in a worker process, after a cap on the prompt's length); idle,
half-sent and slow-bodied connections closed; schemathesis on the served OpenAPI document."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qir.models import Model
from qir.serving.timeouts import Timeouts
from tests.serving.conftest import API_KEY, NAME, Served, serve

BIG = 4 << 20
TIMEOUTS = Timeouts(idle=0.5, header=1.0, body=1.0, drain=5.0)
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    yield from serve(max_body_bytes=BIG + (64 << 10), timeouts=TIMEOUTS)


def _call(
    served: Served, method: str, path: str, body: Any = None, timeout: float = 60
) -> tuple[int, Any, http.client.HTTPMessage]:
    where = urlsplit(served.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, AUTH)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    kind = r.headers.get("content-type", "")
    return r.status, json.loads(raw) if kind.startswith("application/json") else raw, r.headers


def _metrics(served: Served) -> dict[str, float]:
    """Every sample of /metrics, by name (the model label checked and dropped)."""
    status, raw, headers = _call(served, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            assert sample.labels.get("model_name") == NAME
            extra = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))
            out[key] = sample.value
    return out


def test_metrics_count_what_was_served(server: Served) -> None:
    before = _metrics(server)
    usages = []
    for i, stream in enumerate((False, True, False)):
        body = {"prompt": f"Count {i}", "max_tokens": 3 + i, "ignore_eos": True, "stream": stream}
        body["stream_options"] = {"include_usage": True} if stream else None
        status, answer, _ = _call(server, "POST", "/v1/completions", body)
        assert status == 200
        if stream:
            answer = json.loads(answer.split(b"data: ")[-2])  # the usage chunk
        usages.append(answer["usage"])
    after = _metrics(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 12
    assert grew("vllm:request_success_total{finished_reason=length}") == 3
    assert grew("vllm:time_to_first_token_seconds_count") == 3
    assert grew("vllm:inter_token_latency_seconds_count") == 12 - 3  # a gap between two tokens
    assert grew("vllm:e2e_request_latency_seconds_count") == 3
    assert grew("vllm:request_generation_tokens_sum") == 12
    assert after["vllm:prefix_cache_hits_total"] <= after["vllm:prefix_cache_queries_total"]
    end = time.monotonic() + 30  # the engine retires the last sequence after its last token
    while (now := _metrics(server))["vllm:num_requests_running"] and time.monotonic() < end:
        time.sleep(0.05)
    assert now["vllm:num_requests_running"] == now["vllm:num_requests_waiting"] == 0
    assert now["vllm:kv_cache_usage_perc"] == 0


def test_metrics_see_running_requests_and_their_pages(server: Served) -> None:
    sched = server.engine.scheduler
    body = {"prompt": "Go on", "max_tokens": 100, "ignore_eos": True, "stream": True}
    where = urlsplit(server.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), AUTH)
    response = conn.getresponse()
    response.readline()  # the stream started
    now = _metrics(server)
    assert now["vllm:num_requests_running"] == len(sched.running) == 1
    used = 1 - sched.pool.free / sched.pool.pages
    assert now["vllm:kv_cache_usage_perc"] == pytest.approx(used) and used > 0
    conn.close()


def test_tokenize_and_detokenize_as_the_model_does(server: Served, reference: Model) -> None:
    text = "The capital of France"
    status, got, _ = _call(server, "POST", "/tokenize", {"prompt": text, "model": NAME})
    ids = reference.encode(text)
    assert status == 200 and got == {"count": len(ids), "max_model_len": 128, "tokens": ids}
    plain = reference.tokenizer.encode(text, add_special_tokens=False)
    got = _call(server, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})[1]
    assert got["tokens"] == plain != ids

    messages = [{"role": "user", "content": "Hi there"}]
    chat = reference.tokenizer.encode(reference.chat_prompt(messages), add_special_tokens=False)
    got = _call(server, "POST", "/tokenize", {"messages": messages})[1]
    assert got["tokens"] == chat and got["count"] == len(chat)

    status, got, _ = _call(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and got == {"prompt": reference.tokenizer.decode(ids)}
    status, got, _ = _call(server, "POST", "/detokenize", {"tokens": [1, 5, 256]})
    assert status == 400 and got["error"]["param"] == "tokens.[2]"
    status, got, _ = _call(server, "POST", "/tokenize", {"prompt": "x", "return_token_strs": True})
    assert status == 400 and got["error"]["param"] == "return_token_strs"  # not ignored
    status, got, _ = _call(server, "POST", "/tokenize", {"prompt": "x", "model": "other"})
    assert status == 404 and got["error"]["code"] == "model_not_found"


def test_version_and_one_model(server: Served) -> None:
    assert _call(server, "GET", "/version")[1] == {"version": version("qir")}
    status, card, _ = _call(server, "GET", f"/v1/models/{NAME}")
    assert status == 200 and card["id"] == NAME and card["max_model_len"] == 128
    status, error, _ = _call(server, "GET", "/v1/models/gpt-4o")
    assert status == 404 and error["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "10"), ("stream", "true"), ("temperature", "0.5"), ("seed", 1.5)],
)
def test_types_are_strict(server: Served, field: str, value: Any) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, field: value}
    status, error, _ = _call(server, "POST", "/v1/completions", body)
    assert status == 400 and error["error"]["param"] == field


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def test_a_4mb_prompt_is_refused_before_it_is_tokenized(server: Served) -> None:
    """The server runs in this process: its memory is this process's. A prompt past what the
    context's tokens can spell is refused without tokenizing it (a worker that tokenized it
    would take seconds); the same text within /tokenize's reach is refused the same way."""
    body = json.dumps({"prompt": "hello " * (BIG // 6 - 10), "max_tokens": 4}).encode()
    assert len(body) < BIG
    _call(server, "GET", "/version")
    rss = _rss_mb()
    status, error, _ = _call(server, "POST", "/v1/completions", body, timeout=10)
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["message"].startswith("prompt: at least ")
    messages = {"messages": [{"role": "user", "content": "hello " * (BIG // 6 - 10)}]}
    status, error, _ = _call(server, "POST", "/tokenize", messages, timeout=10)
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    assert _rss_mb() - rss < 64


def _worker_pid(server: Served) -> int:
    pool = server.app.state.context.text._pool
    (pid,) = pool._processes
    return int(pid)


def test_tokenizing_runs_off_the_event_loop_and_the_step_loop(server: Served) -> None:
    """With the tokenizing worker stopped (SIGSTOP: a tokenization that takes forever), a
    request that needs it waits while /health answers and a running stream goes on."""
    _call(server, "POST", "/tokenize", {"prompt": "warm"})
    pid = _worker_pid(server)
    where = urlsplit(server.url)
    stream = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    body = {"prompt": [1, 5, 9], "max_tokens": 100, "ignore_eos": True, "stream": True}
    stream.request("POST", "/v1/completions", json.dumps(body), AUTH)
    events = stream.getresponse()
    events.readline()
    os.kill(pid, signal.SIGSTOP)
    try:
        waiting: list[Any] = []
        ask = threading.Thread(
            target=lambda: waiting.append(_call(server, "POST", "/tokenize", {"prompt": "Hi"}))
        )
        ask.start()
        time.sleep(0.2)
        assert not waiting  # the worker is stopped: the tokenize request waits
        assert _call(server, "GET", "/health", timeout=10)[0] == 200
        chunks = [events.readline() for _ in range(20)]  # tokens keep coming
        assert sum(c.startswith(b"data: {") for c in chunks) == 10
    finally:
        os.kill(pid, signal.SIGCONT)
    ask.join(timeout=60)
    assert waiting[0][0] == 200 and waiting[0][1]["count"] > 1
    stream.close()


def _closed(sock: socket.socket, within: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `within` seconds, and what it sent first."""
    sock.settimeout(within)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return False, got
    return True, got


def test_idle_and_half_sent_connections_are_closed(server: Served) -> None:
    where = urlsplit(server.url)
    address = (where.hostname, where.port)
    with socket.create_connection(address) as idle:  # says nothing
        assert _closed(idle, TIMEOUTS.idle + 5) == (True, b"")
    with socket.create_connection(address) as half:  # a head that never ends
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _closed(half, TIMEOUTS.header + 5) == (True, b"")
    with socket.create_connection(address) as kept:  # idle after a response
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        closed, got = _closed(kept, TIMEOUTS.idle + 5)
        assert closed and got.startswith(b"HTTP/1.1 200")


def test_a_body_that_does_not_come_gets_408(server: Served) -> None:
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port)) as slow:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        slow.sendall(f"{head}Content-Length: 100\r\n\r\n".encode() + b'{"prompt": ')
        closed, got = _closed(slow, TIMEOUTS.body + 5)
    assert closed and got.startswith(b"HTTP/1.1 408")
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout"


def test_the_openapi_document_has_bodies_and_refusals(server: Served) -> None:
    doc = _call(server, "GET", "/openapi.json")[1]
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["required"]
        assert {"200", "400", "401", "413", "500", "503"} <= set(op["responses"])
    assert "429" in doc["paths"]["/v1/completions"]["post"]["responses"]
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "stream"} <= set(schema["properties"])


CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
    "use_after_free",
    "ensure_resource_availability",
    "ignored_auth",
    "object_level_authorization",
)


def test_schemathesis_finds_nothing_in_the_served_document(tmp_path: Path) -> None:
    """Every check schemathesis has but positive_data_acceptance: a body the schema allows may
    still be refused with 400 for what a schema cannot say (a prompt past the context, roles
    in the order the chat template wants, ids past the vocabulary). (`--checks all` would add
    a response time limit: speed is the benchmarks' business.) A short context keeps the
    generations short."""
    st = Path(sys.executable).with_name("st")
    for served in serve(max_seq=16, max_body_bytes=BIG):
        run = subprocess.run(
            [
                *(str(st), "run", f"{served.url}/openapi.json"),
                *("-H", f"Authorization: Bearer {API_KEY}", "--checks", ",".join(CHECKS)),
                *("--max-examples", "5", "--request-timeout", "60", "--seed", "1", "--no-color"),
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-6000:]
        generated = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
        assert generated and generated[1] == generated[2] and int(generated[1]) > 100


def test_connections_send_without_waiting_for_acks() -> None:
    """The listening socket makes asyncio set TCP_NODELAY on every connection it accepts:
    without it a response written as headers then body waited for the client's delayed ACK
    (40 ms a response on a kept-alive connection; schemathesis' run spent 75 s of 95 so)."""
    from qir.serving.server import listen  # uvicorn's: not on the GPU machine's image

    sock = listen("127.0.0.1", 0)
    nodelay: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            s = transport.get_extra_info("socket")
            nodelay.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        while not nodelay:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(accept_one(), 30))
    assert nodelay == [1]
