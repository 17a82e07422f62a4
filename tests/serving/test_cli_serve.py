"""`qir serve` as a user runs it: a process that prints what it serves and where, drains on
SIGTERM (running streams finish, new connections are refused, exit 0), and refuses bad options,
a busy port, a checkpoint without a tokenizer and missing packages in one line (exit 2)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from qir.cli import main
from qir.cli.serve import _loopback
from tests.serving.conftest import FIXTURE
from tests.text.conftest import copy_checkpoint


def _lines(stream: Any) -> queue.Queue[str]:
    """A pipe's lines as they come, without blocking the test on a silent process."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_serve_prints_its_address_and_drains_when_stopped(stop: signal.Signals) -> None:
    argv = [sys.executable, "-m", "qir.cli", "serve", str(FIXTURE), "--backend", "host"]
    proc = subprocess.Popen(
        [*argv, "--port", "0", "--api-key", "k1", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out = _lines(proc.stdout)
        printed = [out.get(timeout=300)]
        while "/v1 (" not in printed[-1]:
            printed.append(out.get(timeout=300))
        # Engine.describe()'s lines, then the address.
        assert printed[0].startswith("qir serve: model tiny: context 128 tokens")
        assert all(line.startswith("qir serve: ") for line in printed)
        base = printed[-1].split()[2]
        assert base.startswith("http://127.0.0.1:") and base.endswith("/v1")
        assert "'tiny'" in printed[-1] and "API key required" in printed[-1]
        where = urlsplit(base)

        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 16, "temperature": 0}
        body |= {"stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        headers = {"Authorization": "Bearer k1", "Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        assert response.status == 200
        events = [response.readline()]
        proc.send_signal(stop)  # mid-stream
        while events[-1] != b"data: [DONE]\n":
            events.append(response.readline())
            assert events[-1], "the stream ended without [DONE]"
        chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
        assert chunks[-1]["usage"]["completion_tokens"] == 16  # the running stream finished
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=120) == 0
        assert "qir serve: stopped" in proc.stderr.read()  # type: ignore[union-attr]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((where.hostname, where.port), timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_a_busy_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(FIXTURE), "--backend", "host", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qir: error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--max-queue", "0"], "--max-queue must be at least 1"),
        (["--kv-cache-gb", "-1"], "--kv-cache-gb must be > 0"),
        (["--max-body-mb", "0"], "--max-body-mb must be > 0"),
        (["--port", "-5"], "--port must be at least 0"),
    ],
)
def test_serve_refuses_bad_options(
    option: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", str(FIXTURE), *option]) == 2
    assert capsys.readouterr().err == f"qir: error: {message}, got {option[1]}\n"


def test_serve_needs_a_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = copy_checkpoint(FIXTURE, tmp_path / "ck")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (ck / name).unlink()
    assert main(["serve", str(ck), "--backend", "host", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qir: error:") and "tokenizer" in err and err.count("\n") == 1


def test_serve_without_its_packages_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", str(FIXTURE)]) == 2
    assert (
        capsys.readouterr().err == "qir: error: qir serve needs uvicorn: pip install 'qir[serve]'\n"
    )


def test_only_loopback_addresses_count_as_private() -> None:
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("example.org")


def test_serve_on_two_mpi_ranks_answers_as_one_and_stops_them() -> None:
    """`qir serve --tp 2`: rank 0 serves, rank 1 repeats its steps; greedy text equals --tp 1's
    (the Python engine's), and SIGTERM to the launcher drains rank 0, which stops rank 1."""
    from qir.dtypes import F32
    from qir.models import Model

    argv = [sys.executable, "-m", "qir.cli", "serve", str(FIXTURE), "--backend", "host"]
    argv += ["--act-dtype", "f32", "--max-seq", "64", "--port", "0", "--tp", "2"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out = _lines(proc.stdout)
        printed = [out.get(timeout=300)]
        while "/v1 (" not in printed[-1]:
            printed.append(out.get(timeout=300))
        where = urlsplit(printed[-1].split()[2])
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        body = {"model": FIXTURE.name, "prompt": [1, 5, 9], "max_tokens": 6, "temperature": 0}
        body["ignore_eos"] = True
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        text = json.loads(response.read())["choices"][0]["text"]
        model = Model.load(FIXTURE, backend="host", act=F32, max_seq=64)
        ids = model.generate([1, 5, 9], 6, do_sample=False, ignore_eos=True).tokens.tolist()
        assert text == model.tokenizer.decode(ids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "qir serve: stopped" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve(*options: str) -> tuple[subprocess.Popen[str], str]:
    """`qir serve` on the fixture in a process, and its base URL once it listens."""
    argv = [sys.executable, "-m", "qir.cli", "serve", str(FIXTURE), "--backend", "host"]
    proc = subprocess.Popen(
        [*argv, "--port", "0", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = _lines(proc.stdout)
    line = out.get(timeout=300)
    while "/v1 (" not in line:
        line = out.get(timeout=300)
    return proc, line.split()[2].removesuffix("/v1")


def _stream(base: str, max_tokens: int) -> Any:
    """A streamed completion under way: its response, its first event read."""
    where = urlsplit(base)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
    body = {"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return response


def _status(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    where = urlsplit(base)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    conn.request(method, path, json.dumps(body) if body is not None else None)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.add(pid)
    return alive


def test_drain_answers_503_and_ends_what_outlives_its_deadline() -> None:
    """SIGTERM with a stream running and two queued behind it (--max-batch 1): new requests
    and /health get 503 while it drains; after --drain-timeout the streams still running end
    with an error event; the process exits 0."""
    proc, base = _serve("--drain-timeout", "0.5", "--max-batch", "1")
    try:
        streams = [_stream(base, 120) for _ in range(3)]
        streams[0].readline()
        proc.send_signal(signal.SIGTERM)
        status, health = _status(base, "GET", "/health")
        while status == 200:  # until the signal is handled
            status, health = _status(base, "GET", "/health")
        assert status == 503 and health["error"]["code"] == "shutting_down"
        status, error = _status(base, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 503 and error["error"]["code"] == "shutting_down"
        ends = []
        for response in streams:
            events = [line for line in response.read().split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]"
            ends.append(json.loads(events[-2][6:]))
        ended = [e["error"]["message"] for e in ends if "error" in e]
        assert ended and all("shut down" in m for m in ended)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert "qir serve: stopped" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_signal_stops_at_once() -> None:
    proc, base = _serve()
    try:
        stream = _stream(base, 120)
        stream.readline()
        children = _children(proc.pid)
        assert children  # the tokenizing worker
        proc.send_signal(signal.SIGTERM)
        while _status(base, "GET", "/health")[0] == 200:
            pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert "qir serve: stopped at once (SIGTERM while draining)" in err
        assert "Traceback" not in err
        end = time.monotonic() + 30
        while _alive(children) and time.monotonic() < end:  # none left behind
            time.sleep(0.05)
        assert not _alive(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
