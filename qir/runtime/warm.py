"""Filling the compile cache ahead of time, for machines that will run the kernels later.

A deployment image is usually built without a GPU, and a server that compiles on its first
request stalls it. NVRTC needs no GPU, and a cubin's cache key depends only on the kernel, the
arch, NVRTC and the CUDA headers (`nvrtc.key_parts`), so kernels compiled here for sm_90 are
exactly the entries a CudaBackend on an H100/H200 loads, with no compile, provided it sees the
same NVRTC and headers (the same qir[cuda] install). `host` fills the host backend's entries.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from qir.codegen.kernel import Kernel
from qir.errors import UsageError
from qir.runtime.cache import KernelCache
from qir.runtime.loading import prepare_all
from qir.runtime.nvrtc import check_arch, compile_cubin

log = logging.getLogger("qir.runtime")

HOST = "host"


@dataclass(frozen=True)
class Warmed:
    target: str  # "host" or an arch, e.g. "sm_90"
    kernels: int  # distinct kernels
    compiled: int  # of which were not cached yet
    seconds: float


def warm(plans: Mapping[str, Sequence[Kernel]], root: Path | None = None) -> list[Warmed]:
    """Compile the distinct kernels of each target ("host" or an arch: the kernels lowered for
    it) into the cache at `root` (default: the configured one), on the compile thread pool.
    Targets are checked before anything compiles."""
    prepares = [(t, _preparer(t, root)) for t in plans]
    out = []
    for target, (cache, prepare) in prepares:
        distinct = list(dict.fromkeys(plans[target]))
        _check_writable(cache)
        before, t0 = cache.compiles, time.perf_counter()
        log.info("warming %d kernels for %s ...", len(distinct), target)
        prepare(distinct)
        # A cache that cannot be written keeps its builds in a directory deleted at exit:
        # for a warm that is a failure, not a fallback.
        _check_writable(cache)
        out.append(Warmed(target, len(distinct), cache.compiles - before, time.perf_counter() - t0))
    return out


def _check_writable(cache: KernelCache) -> None:
    problem = "its writes failed" if cache.degraded else None
    if problem is None:
        try:
            cache.root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=cache.root):
                pass
        except OSError as e:
            problem = e.strerror or str(e)
    if problem is not None:
        raise UsageError(
            f"cache warm: cannot write to the cache directory {cache.root} ({problem}); "
            "set QIR_CACHE_DIR to a writable directory"
        )


def _preparer(
    target: str, root: Path | None
) -> tuple[KernelCache, Callable[[Sequence[Kernel]], object]]:
    """The cache a target's kernels go to, and what compiles a list of them into it."""
    if target == HOST:
        from qir.runtime.host import HostBackend

        be = HostBackend(cache_dir=root)
        return be.cache, partial(be.prepare_many, done=lambda k: None)
    cache = KernelCache.at(root)
    return cache, partial(prepare_all, partial(compile_cubin, arch=check_arch(target), cache=cache))
