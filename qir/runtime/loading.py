"""Loading what a block runs with: its weights, uploaded once, and its kernels, compiled (cold
ones in parallel) and loaded on first use."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from qir.codegen.kernel import Kernel
from qir.codegen.plan import Plan
from qir.errors import UsageError
from qir.interpret import Weights, expert_input_scales, weight_buffers
from qir.logs import Progress
from qir.runtime.backend_api import Backend
from qir.types import QExperts, QWeight, TensorType

log = logging.getLogger("qir.runtime")
T = TypeVar("T")


def upload_weights(plan: Plan, backend: Backend, weights: Weights) -> dict[str, dict[str, Any]]:
    """Every weight's buffers on the device (weight -> buffer name -> array), uploaded once per
    block."""
    graph = plan.graph
    uploaded: dict[str, dict[str, Any]] = {}
    for wname in graph.weights:
        node = graph.node(wname)
        w = node.type
        bufs = weight_buffers(node, weights)
        names = ["weight"] if isinstance(w, TensorType) else list(_format_buffers(w))
        uploaded[wname] = {b: backend.to_device(np.ascontiguousarray(bufs[b])) for b in names}
    for name in graph.of_op("expert_qlinear"):
        if graph.node(name).attr("act_quant"):
            # the kernels read the gate's scales for a pair: refuse a pair of two
            expert_input_scales(graph, name, weights)
    return uploaded


def _format_buffers(w: object) -> dict[str, TensorType]:
    if isinstance(w, QExperts):
        return w.buffers()
    assert isinstance(w, QWeight)
    return w.buffers()


def compile_jobs() -> int:
    """Threads that compile one block's kernels: `$QIR_COMPILE_JOBS`, else the usable CPUs."""
    raw = os.environ.get("QIR_COMPILE_JOBS", "").strip()
    if not raw:
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        return max(1, len(usable) if usable is not None else os.cpu_count() or 1)
    try:
        jobs = int(raw, 10)
    except ValueError:
        jobs = 0
    if jobs < 1 or not raw.isascii():
        raise UsageError(f"QIR_COMPILE_JOBS must be a positive integer, got {raw!r}")
    return jobs


def prepare_all(prepare: Callable[[T], object], kernels: Sequence[T]) -> int:
    """`prepare` every kernel (or group of kernels) on up to `compile_jobs()` threads;
    re-raises the first failure (in `kernels` order) once all have finished. Returns the
    threads used."""
    jobs = max(1, min(compile_jobs(), len(kernels)))
    if jobs == 1:
        for k in kernels:
            prepare(k)
        return 1
    pool = ThreadPoolExecutor(jobs, thread_name_prefix="qir-compile")
    try:
        for _ in pool.map(prepare, kernels):
            pass
    except BaseException:
        # A failure (or Ctrl-C) drops the compiles still queued; those running finish.
        pool.shutdown(cancel_futures=True)
        raise
    pool.shutdown()
    return jobs


def load_kernels(backend: Backend, kernels: Sequence[Kernel]) -> list[Any]:
    """Each kernel loaded, in order. Cold kernels compile in parallel first (g++ runs as a
    child process, NVRTC without the GIL), then load one by one on this thread, so device
    state (CUDA contexts, dlopen) is only touched here."""
    distinct = list(dict.fromkeys(kernels))
    before, t0 = backend.cache.compiles, time.perf_counter()
    progress = Progress(log, "compiling kernels", len(distinct))

    def done(k: Kernel) -> None:
        progress.step(show=backend.cache.compiles > before)  # a warm load draws no bar

    try:
        jobs = backend.prepare_many(distinct, done)
        loaded = [backend.load(k) for k in kernels]
    except BaseException:
        progress.finish(None)
        raise
    compiled = backend.cache.compiles - before
    seconds, threads = time.perf_counter() - t0, "thread" if jobs == 1 else "threads"
    summary = (
        f"{compiled} of {len(distinct)} kernels compiled in {seconds:.2f} s ({jobs} {threads})"
    )
    progress.finish(summary if compiled else None)
    return loaded
