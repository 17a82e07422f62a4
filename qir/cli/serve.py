"""`qir serve`: a checkpoint behind the OpenAI HTTP API (qir.serving.http in front of
qir.serving.Engine), until Ctrl-C or SIGTERM, which drain it."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
from pathlib import Path
from typing import Any

from qir.cli import tp
from qir.cli.options import add_lowering, add_max_seq, model_options
from qir.errors import UsageError
from qir.runtime.backend import BACKENDS, best_backend
from qir.serving.engine import DEFAULT_CHUNK, DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE
from qir.serving.timeouts import Timeouts

INSTALL = "pip install 'qir[serve]'"


def _http() -> Any:
    """qir.serving.http, or a UsageError saying what to install."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"qir serve needs {e.name or 'fastapi, uvicorn'}: {INSTALL}") from None
    from qir.serving import http

    return http


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    http = _http()
    for name, value, low in (
        ("--max-queue", args.max_queue, 1),
        ("--port", args.port, 0),
        ("--max-batch", args.max_batch, 1),
        ("--chunk", args.chunk, 1),
    ):
        if value < low:
            raise UsageError(f"{name} must be at least {low}, got {value}")
    for name, value in (
        ("--kv-cache-gb", args.kv_cache_gb),
        ("--max-body-mb", args.max_body_mb),
        ("--drain-timeout", args.drain_timeout),
        ("--idle-timeout", args.idle_timeout),
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ):
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be > 0, got {value:g}")
    api_key = args.api_key or os.environ.get("QIR_API_KEY") or None
    launched = tp.launch(args)
    if launched is not None:
        return launched
    options = model_options(args, args.backend or best_backend())
    comm = tp.comm_of(args, options["backend"])
    if comm is not None and comm.rank != 0:  # a rank that repeats rank 0's steps, no HTTP
        # Rank 0 drains on Ctrl-C / SIGTERM and then stops the others: they must not die first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        from qir.serving.engine import follow_engine

        follow_engine(args.checkpoint, args.kv_cache_gb, args.max_batch, comm=comm, **options)
        return 0
    sock = http.listen(args.host, args.port)  # a port in use fails before the model loads
    try:
        from qir.serving import Engine

        engine = Engine.load(
            args.checkpoint,
            max_queue=args.max_queue,
            max_batch=args.max_batch,
            chunk=args.chunk,
            kv_cache_gb=args.kv_cache_gb,
            name=args.served_model_name,
            comm=comm,
            **options,
        )
        engine.tokenizer  # noqa: B018 (text in and out: a checkpoint without one is refused now)
    except BaseException:
        sock.close()
        raise
    app = http.create_app(
        engine,
        api_key=api_key,
        served_model_name=args.served_model_name,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        timeouts=http.Timeouts(
            idle=args.idle_timeout,
            header=args.header_timeout,
            body=args.body_timeout,
            drain=args.drain_timeout,
        ),
    )
    if not _loopback(args.host) and api_key is None:
        print(
            f"qir serve: warning: listening on {args.host} without --api-key: anyone who can "
            "reach this port can use the model",
            file=sys.stderr,
        )

    def ready(base: str) -> None:
        for line in engine.describe():
            print(f"qir serve: {line}")
        name = args.served_model_name or engine.name
        auth = ", API key required" if api_key else ""
        print(
            f"qir serve: {base}/v1 (model {name!r}{auth}); Ctrl-C or SIGTERM drains and stops "
            f"(within {args.drain_timeout:g} s; a second one stops at once)"
        )
        sys.stdout.flush()

    level = "warning" if args.quiet else "debug" if args.verbose else "info"
    http.serve(app, sock, on_ready=ready, log_level=level)
    print("qir serve: stopped", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint over the OpenAI HTTP API (chat and text completions)",
        description="Serve a checkpoint over the OpenAI HTTP API: /v1/chat/completions, "
        "/v1/completions (streamed or not), /v1/models, and vLLM's /tokenize, /detokenize, "
        "/metrics, /version, /health. Ctrl-C or SIGTERM drains: new requests get 503 while "
        "running ones finish (within --drain-timeout), then it exits; a second signal exits at "
        f"once. Needs {INSTALL}.",
    )
    p.add_argument("checkpoint", type=Path, help="checkpoint directory (with its tokenizer)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on /v1 (default: $QIR_API_KEY, else none)",
    )
    p.add_argument(
        "--served-model-name", help="the model's name in the API (default: the directory's)"
    )
    p.add_argument(
        "--backend", choices=BACKENDS, help="default: cuda if a GPU is present, else host"
    )
    add_lowering(p)
    add_max_seq(p)
    tp.add_tp(p)
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests waiting beyond which new ones get 429 (default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"sequences decoded in one step at most (default {DEFAULT_MAX_BATCH})",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help=f"prompt tokens prefilled per step at most (default {DEFAULT_CHUNK})",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        help="memory for the KV cache (default: most of a GPU's free memory after the weights; "
        "on the host, --max-batch sequences at full context, at most 2 GiB)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=4.0,
        help="request bodies over this many MiB get 413 (default 4)",
    )
    defaults = Timeouts()
    for option, default, what in (
        (
            "--drain-timeout",
            defaults.drain,
            "after Ctrl-C or SIGTERM, running requests get this "
            "long to finish before they are ended",
        ),
        (
            "--idle-timeout",
            defaults.idle,
            "a connection without a request in flight is closed after this long",
        ),
        (
            "--header-timeout",
            defaults.header,
            "a connection whose request head has not come "
            "whole this long after it opened (or after the previous response) is closed",
        ),
        (
            "--body-timeout",
            defaults.body,
            "a request body not whole this long after its head gets 408",
        ),
    ):
        p.add_argument(
            option, type=float, default=default, help=f"seconds: {what} (default {default:g})"
        )
    p.set_defaults(func=cmd_serve)
