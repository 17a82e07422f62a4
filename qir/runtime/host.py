"""The `host` backend: rendered CUDA kernels compiled by g++ and run on the CPU.

Every CUDA thread is a fiber (see include/qir_host.h); blocks are spread over OS threads
(`QIR_HOST_THREADS`, default: all CPUs): the launching thread plus a worker pool that, like the
fiber stacks, is made once per process and shared by every loaded kernel library (see
`_share_runtime`). Buffers are plain numpy arrays, so "device" memory is host memory and copies
are ordinary copies.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from qir.codegen.kernel import Kernel
from qir.errors import UsageError
from qir.interpret import BindError
from qir.runtime.backend_api import BoundLaunch, InStream
from qir.runtime.cache import HOST, PCH, Artifact, KernelCache, key
from qir.runtime.errors import BackendUnavailable, CompileError
from qir.runtime.host_pch import PrecompiledHeader
from qir.runtime.host_units import Member, plan_units, unit_source
from qir.runtime.loading import compile_jobs, prepare_all
from qir.runtime.toolkit import cuda_include_dirs, toolkit_fingerprint

HEADER = Path(__file__).parent / "include" / "qir_host.h"
# The parts qir_host.h includes from beside it, one concern each: what keys a build on the
# header (the cache, the ABI hash, the precompiled header) reads them all.
HEADER_PARTS = tuple(sorted(HEADER.parent.glob("qir_host_*.h")))
VECTOR_ALIGN = 16
CXX = "g++"
# CUDA code routinely type-puns through reinterpret_cast (uint4 -> __half2 etc.), which nvcc
# tolerates and g++ -O2 miscompiles under strict aliasing. No contraction of a * b + c into an
# FMA (ISO mode's default, said outright): kernels round where their source says, as the
# interpreter does. -march=native: this CPU's FMA (fmaf inline instead of a libm call), F16C
# (f16 conversions in one instruction) and vector units; `native_arch` puts what it resolves to
# in every cache key, so a cache never serves a kernel built for another CPU. -fno-exceptions:
# nothing in a kernel or qir_host.h throws, and with exceptions on, the fibers' setjmp and the
# unrolled kernel bodies cost g++ 1.7 times the time (17 s instead of 10 s for one GEMV).
BASE_FLAGS = (
    "-std=c++17",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-march=native",
    "-fno-exceptions",
    "-x",
    "c++",
)
# Hidden visibility keeps each kernel's inline copies private to its .so (no process-wide unique
# symbols shared between kernels); the entry points are exported explicitly.
SO_FLAGS = ("-fPIC", "-shared", "-fvisibility=hidden")
# Kernel libraries leave the worker pool and fiber stacks out (qir_host.h): they use those of
# the runtime library, built once from the header alone (`_runtime_library`).
KERNEL_FLAGS = ("-DQIR_HOST_SHARED_RUNTIME=1",)
RUNTIME = "qir_host_runtime"  # the runtime library's cache entry name
# g++'s optimisation level: -O3 unless QIR_HOST_OPT says (0-3). A kernel's results do not depend
# on it (no fast-math: IEEE arithmetic at every level; tests/runtime/test_host.py compares -O1
# with -O3 bytes), its build and run time do: the test suite builds at -O1, a quarter faster.
OPT_LEVELS = ("0", "1", "2", "3")
# QIR_HOST_MODE: `fast` (the default) gives the few hot helpers that have one their host body
# (QIR_HOST_FAST: a 4-bit code read as an integer where a GPU decodes it with packed f16
# arithmetic, which the CPU can only emulate); `check` runs every helper's portable GPU-path
# body instead. Both give the same bytes (tests/runtime/test_host_modes.py).
MODES = {"fast": ("-DQIR_HOST_FAST=1",), "check": ()}
# An ASan runtime cannot be loaded into an uninstrumented Python without LD_PRELOAD, so sanitized
# kernels are built as standalone executables and run in a child process (see QIR_HOST_RUNNER).
# -g1: line tables and function names, what a report's frames print (file:line in the kernel's
# .cu); full -g adds variable info no report shows, a third more g++ time (6.3 s vs 4.7 s of a
# two-GEMV unit).
SANITIZE_FLAGS = (
    "-O1",
    "-g1",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
)
_INT32 = (-(2**31), 2**31 - 1)
log = logging.getLogger("qir.runtime")


# Every kernel library built from one header uses one runtime (worker pool and fiber stacks),
# the runtime library's: the header's hash is compiled in as QIR_HOST_ABI, and a library only
# adopts a runtime of the same hash.
_RUNTIMES: dict[int, tuple[int, ctypes.CDLL]] = {}  # ABI -> (the shared Runtime*, its library)
_RUNTIMES_LOCK = threading.Lock()
# Kernels built in one unit (host_units) share one library, which their cache entries each
# hold: loaded once per process (by the payload's digest), however many of them are used.
_LIBRARIES: dict[bytes, ctypes.CDLL] = {}


def _header_abi() -> str:
    # Not cached: a header edited while a process runs must not reuse the old hash.
    return "0x" + hashlib.sha256(header_text().encode()).hexdigest()[:16] + "ull"


def header_text() -> str:
    """qir_host.h and its parts: what every host build depends on."""
    return "".join(p.read_text() for p in (HEADER, *HEADER_PARTS))


def _exported(lib: ctypes.CDLL) -> tuple[Any, Any, Any]:
    abi_fn, runtime_fn, share_fn = lib.qir_host_abi, lib.qir_host_runtime, lib.qir_host_share
    abi_fn.restype = ctypes.c_ulonglong
    runtime_fn.restype = ctypes.c_void_p
    share_fn.restype, share_fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
    return abi_fn, runtime_fn, share_fn


def _share_runtime(lib: ctypes.CDLL, runtime_library: Callable[[], Path]) -> None:
    """Give a freshly loaded kernel library the process's runtime for its header (loading the
    runtime library first if this is the first kernel of that header), so N loaded kernels do
    not mean N worker pools and N sets of fiber stacks per thread. Runs before the library's
    first launch."""
    abi_fn, _, share_fn = _exported(lib)
    abi = int(abi_fn())
    with _RUNTIMES_LOCK:
        if abi not in _RUNTIMES:
            runtime = ctypes.CDLL(str(runtime_library()))
            theirs, runtime_fn, _ = _exported(runtime)
            if int(theirs()) != abi:
                raise RuntimeError(f"{RUNTIME}: built from another qir_host.h than its kernels")
            _RUNTIMES[abi] = (int(runtime_fn()), runtime)
        if share_fn(_RUNTIMES[abi][0]) != 1:
            raise RuntimeError("a kernel library refused the runtime built from its own header")


@cache
def compiler_version() -> str:
    """`g++ --version`, whole: part of every host cache key."""
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout


@cache
def native_arch() -> str:
    """What -march=native means on this machine (g++'s resolved target options: the CPU and
    every instruction set it enables): part of every host cache key."""
    proc = subprocess.run(
        [CXX, "-march=native", "-Q", "--help=target"], capture_output=True, text=True, check=True
    )
    return proc.stdout


# CUDA's `#pragma unroll [N]` in GCC's words (which ignores nvcc's): the kernels rely on full
# unrolling to fold their constant index arithmetic (a pair's bit position, a magic constant),
# which GCC otherwise computes at run time. A bare pragma asks for at most UNROLL copies, so a
# loop whose trip count is not a constant grows by a bounded factor. QIR_HOST_UNROLL=0 drops the
# pragmas and lets g++ decide: the same results (unrolling moves no rounding), a slower kernel
# and a build up to seven times faster (a GEMV: 1.4 s instead of 10); the test suite builds so
# (tests/conftest.py).
UNROLL = 64
_PRAGMA_UNROLL = re.compile(r"^([ \t]*)#pragma unroll\b[ \t]*(\d*)", re.MULTILINE)
UNROLL_MODES = ("0", "1")


def for_gcc(text: str, unroll: bool = True) -> str:
    """CUDA source as g++ compiles it: the same code, its unroll pragmas in GCC's spelling (or,
    without `unroll`, blanked: line numbers stay the kernel's)."""
    if not unroll:
        return _PRAGMA_UNROLL.sub(lambda m: m[1], text)
    return _PRAGMA_UNROLL.sub(lambda m: f"{m[1]}#pragma GCC unroll {m[2] or UNROLL}", text)


def host_source(kernel: Kernel, unroll: bool = True) -> str:
    """What g++ compiles: the kernel plus one exported, generic trampoline (qir_host.h does the
    argument unpacking). Appended, so line numbers in compiler messages stay the kernel's."""
    return f"{for_gcc(kernel.source, unroll).rstrip()}\n\nQIR_HOST_EXPORT({kernel.name})\n"


def host_headers(kernel: Kernel, unroll: bool = True) -> tuple[tuple[str, str], ...]:
    """The kernel's own headers (qir_common.cuh, its format's), as g++ compiles them."""
    return tuple((name, for_gcc(text, unroll)) for name, text in kernel.headers)


def seed_cache(src: Path, dst: Path, runtime: bool = True) -> Path:
    """`dst`, a cache root, holding `src`'s precompiled headers and (with `runtime`) its host
    runtime libraries: what a machine builds once per toolchain, not per cache (~3 s of g++).
    Hard links where they can be, else copies; a cache replaces a file by renaming a new one
    over it, never by writing into one, so `src`'s stay whole."""

    def link(a: str, b: str) -> None:
        if not os.path.exists(b):  # seeded before
            try:
                os.link(a, b)
            except OSError:  # another filesystem
                shutil.copy2(a, b)

    shutil.copytree(src / PCH, dst / PCH, dirs_exist_ok=True, copy_function=link)
    if runtime:
        (dst / HOST).mkdir(parents=True, exist_ok=True)
        for lib in (src / HOST).glob(f"{RUNTIME}-*.so"):
            link(str(lib), str(dst / HOST / lib.name))
    return dst


@dataclass(frozen=True)
class HostKernel:
    kernel: Kernel
    path: Path  # the cache entry: a shared object, or an executable in sanitize mode
    lib: ctypes.CDLL | None  # None in sanitize mode: the kernel runs in a child process


class HostBackend:
    name = "host"
    target = None  # runs every target's kernels (portable bodies of their instructions)

    def __init__(self, cache_dir: Path | None = None, sanitize: bool = False) -> None:
        if shutil.which(CXX) is None:
            raise BackendUnavailable(
                f"the host backend compiles kernels with {CXX}, which is not on PATH"
            )
        if not cuda_include_dirs():
            raise BackendUnavailable(
                "the host backend needs the CUDA headers (cuda_fp16.h): pip install 'qir[host]' "
                "or install the CUDA toolkit (or set CUDA_HOME)"
            )
        self.cache = KernelCache.at(cache_dir)
        self.sanitize = sanitize
        opt = os.environ.get("QIR_HOST_OPT", "3").strip()
        if opt not in OPT_LEVELS:
            raise UsageError(f"QIR_HOST_OPT={opt!r}: expected one of {', '.join(OPT_LEVELS)}")
        unroll = os.environ.get("QIR_HOST_UNROLL", "1").strip()
        if unroll not in UNROLL_MODES:
            raise UsageError(
                f"QIR_HOST_UNROLL={unroll!r}: expected 1 (as the pragmas say) or 0 (g++ decides)"
            )
        self.unroll = unroll == "1"
        mode = os.environ.get("QIR_HOST_MODE", "fast").strip()
        if mode not in MODES:
            raise UsageError(f"QIR_HOST_MODE={mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self._so_flags = (f"-O{opt}", *SO_FLAGS, *KERNEL_FLAGS, *MODES[mode])
        self._runtime_flags = (f"-O{opt}", *SO_FLAGS, *MODES[mode])
        self._sanitize_flags = (*SANITIZE_FLAGS, *MODES[mode])
        # Entries prepare_many() fetched (compiled or read and checksummed), for load() to take
        # instead of reading them again.
        self._prepared: dict[Kernel, Artifact] = {}
        self._runtime_path: Path | None = None
        self._runtime_lock = threading.Lock()
        self._pch = PrecompiledHeader(
            self.cache,
            HEADER,
            HEADER_PARTS,
            CXX,
            cuda_include_dirs,
            lambda: compiler_version() + native_arch() + toolkit_fingerprint(),
        )

    # -- compile -------------------------------------------------------------------------------

    def _flags(self, kernel: str, build: Path, precompiled: bool = True) -> list[str]:
        mode = (
            (*self._sanitize_flags, f"-DQIR_HOST_RUNNER=qir_launch_{kernel}")
            if self.sanitize
            else self._so_flags
        )
        includes = [f"-I{d}" for d in (build, *cuda_include_dirs())]
        # Derived from the header, which is part of the key: no need to hash it into `options`.
        abi = f"-DQIR_HOST_ABI={_header_abi()}"
        # Sanitizer builds are few and define a per-kernel macro the header reads: no .gch.
        header = (
            self._pch.header([*BASE_FLAGS, *mode, abi])
            if precompiled and not self.sanitize
            else HEADER
        )
        return [*BASE_FLAGS, *mode, abi, "-include", str(header), *includes]

    def source(self, kernel: Kernel) -> str:
        """What this backend's g++ compiles for `kernel` (host_source in its unroll mode)."""
        return host_source(kernel, self.unroll)

    def key_parts(self, kernel: Kernel, source: str) -> dict[str, str]:
        """What a compiled kernel depends on, besides qir's codegen (see cache.key)."""
        # The include dirs hold the temporary build dir: hash the flags of the mode instead.
        flags = (BASE_FLAGS, self._sanitize_flags if self.sanitize else self._so_flags)
        return {
            "source": source,
            "headers": repr(host_headers(kernel, self.unroll)),
            "runtime_header": header_text(),
            "options": repr(flags),
            "compiler": compiler_version(),
            "cpu": native_arch(),
            "toolkit": toolkit_fingerprint(),
        }

    def load(self, kernel: Kernel) -> HostKernel:
        return self.cache.loaded(self._spec(kernel), lambda: self._load(kernel))

    def _spec(self, kernel: Kernel) -> tuple[object, ...]:
        """The in-memory cache's key: one loaded library per kernel and build mode."""
        return (self.name, self.sanitize, self._so_flags, self._sanitize_flags, self.unroll, kernel)

    def prepare_many(self, kernels: Sequence[Kernel], done: Callable[[Kernel], None]) -> int:
        """Compile the distinct `kernels` into the disk cache without loading them (and the
        runtime library their loads need: a warmed cache holds it too), calling `done(kernel)`
        after each; safe on any thread. The cold ones build as units of several kernels
        (host_units: the precompiled header loaded and the shared helpers generated once per
        unit), about one unit per compile thread. Returns the threads used."""
        cold, keys = [], {}
        for k in kernels:
            if not self.cache.holds(self._spec(k)):
                keys[k] = self._key(k)
                entry = self.cache.peek(HOST, k.name, keys[k], self._ext)
                if entry is None:
                    cold.append(k)
                    continue
                self._prepared[k] = entry
            done(k)
        jobs = max(1, min(compile_jobs(), len(cold)))
        members = [Member(k.name, self.source(k), host_headers(k, self.unroll)) for k in cold]
        # Sanitizer builds define a per-kernel runner macro: one kernel per build.
        units = [[i] for i in range(len(cold))] if self.sanitize else plan_units(members, jobs)

        def build(unit: list[int]) -> None:
            entries = [(cold[i].name, keys[cold[i]], self._ext) for i in unit]
            # Claimed together: another thread or process (a rank of the same model, whose
            # shard has these shapes too) builds none of them meanwhile, nor did one before.
            with self.cache.claim(HOST, entries) as found:
                todo = [members[i] for i, entry in zip(unit, found, strict=True) if entry is None]
                payload = self._compile_unit(todo) if len(todo) > 1 else None
                for i, entry, spec in zip(unit, found, entries, strict=True):
                    k = cold[i]
                    if entry is None:
                        alone = partial(self._compile, k, members[i].source)
                        built = alone if payload is None else partial(bytes, payload)
                        entry = self.cache.build_claimed(
                            HOST, spec, built, "host g++", executable=self.sanitize
                        )
                    self._prepared[k] = entry
                    done(k)
            if cold and not self.sanitize:
                self._runtime_library()

        return prepare_all(build, units) if units else 1

    def _load(self, kernel: Kernel) -> HostKernel:
        entry = self._prepared.pop(kernel, None) or self._entry(kernel)
        if self.sanitize:
            return HostKernel(kernel, entry.path, None)
        try:
            digest = hashlib.sha256(entry.payload).digest()
            with _RUNTIMES_LOCK:
                lib = _LIBRARIES.get(digest)
                if lib is None:
                    lib = _LIBRARIES[digest] = ctypes.CDLL(str(entry.path))
            getattr(lib, f"qir_launch_{kernel.name}")
            _share_runtime(lib, self._runtime_library)
        except (OSError, AttributeError) as e:
            # The checksum matched, so this is what g++ produced: not a cache problem.
            raise RuntimeError(f"{kernel.name}: cannot load {entry.path}: {e}") from e
        return HostKernel(kernel, entry.path, lib)

    @property
    def _ext(self) -> str:
        return ".exe" if self.sanitize else ".so"

    def _key(self, kernel: Kernel) -> str:
        return key(self.key_parts(kernel, self.source(kernel)))

    def _entry(self, kernel: Kernel) -> Artifact:
        """The kernel's cache entry; on a miss, a build of the kernel alone."""
        return self.cache.fetch(
            HOST,
            kernel.name,
            self._key(kernel),
            self._ext,
            lambda: self._compile(kernel, self.source(kernel)),
            what="host g++",
            executable=self.sanitize,
        )

    def _runtime_library(self) -> Path:
        """The worker pool and fiber stacks every kernel library uses: qir_host.h compiled on
        its own, once per header, flags and compiler (in the kernel cache)."""
        parts = {
            "runtime_header": header_text(),
            "options": repr((BASE_FLAGS, self._runtime_flags)),
            "compiler": compiler_version(),
            "cpu": native_arch(),
            "toolkit": toolkit_fingerprint(),
        }

        def build() -> bytes:
            with tempfile.TemporaryDirectory(prefix="qir-runtime-") as tmp:
                cu, out = Path(tmp) / f"{RUNTIME}.cc", Path(tmp) / "runtime.out"
                cu.write_text("// qir_host.h's runtime: the pool, the fibers, the exports\n")
                abi = f"-DQIR_HOST_ABI={_header_abi()}"
                includes = [f"-I{d}" for d in cuda_include_dirs()]
                cmd = [CXX, *BASE_FLAGS, *self._runtime_flags, abi, "-include", str(HEADER)]
                proc = subprocess.run(
                    [*cmd, *includes, str(cu), "-o", str(out)], capture_output=True, text=True
                )
                if proc.returncode != 0:
                    raise CompileError(RUNTIME, "g++", proc.stderr.strip(), "", filename=cu.name)
                return out.read_bytes()

        with self._runtime_lock:
            if self._runtime_path is None or not self._runtime_path.is_file():
                entry = self.cache.fetch(
                    HOST, RUNTIME, key(parts), ".so", build, what="host g++", counted=False
                )
                self._runtime_path = entry.path
            return self._runtime_path

    def _compile_unit(self, members: Sequence[Member]) -> bytes | None:
        """One library holding every member, or None when g++ refuses the unit (each member
        then builds alone, and a real error is reported against its own source)."""
        first = members[0]
        headers = tuple(dict(h for m in members for h in m.headers).items())
        name = f"unit{len(members)}_{first.name}"
        try:
            return self._gxx(name, unit_source(members), headers, first.name)
        except CompileError as e:
            log.debug("%s: built one by one (%s)", name, str(e).splitlines()[0])
            return None

    def _compile(self, kernel: Kernel, source: str) -> bytes:
        return self._gxx(kernel.name, source, host_headers(kernel, self.unroll), kernel.name)

    def _gxx(
        self, name: str, source: str, headers: tuple[tuple[str, str], ...], kernel: str
    ) -> bytes:
        """`source` (its `headers` beside it) built by g++ in this backend's mode; `kernel`
        names the sanitizer runner's kernel."""
        with tempfile.TemporaryDirectory(prefix=f"qir-{name}-") as tmp:
            build = Path(tmp)
            for header, text in headers:
                (build / header).parent.mkdir(parents=True, exist_ok=True)
                (build / header).write_text(text)
            cu, out = build / f"{name}.cu", build / "kernel.out"
            cu.write_text(source)
            cmd = [CXX, *self._flags(kernel, build), str(cu), "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 and Path(cmd[cmd.index("-include") + 1]) != HEADER:
                # A damaged .gch is a hard g++ error: the plain header decides, and tells.
                cmd = [CXX, *self._flags(kernel, build, precompiled=False), str(cu), "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode == 0:
                    self._pch.discard()
            if proc.returncode != 0:
                raise CompileError(name, "g++", proc.stderr.strip(), source, filename=cu.name)
            return out.read_bytes()

    # -- launch --------------------------------------------------------------------------------

    def launch(
        self,
        k: HostKernel,
        grid: tuple[int, int, int],
        args: Sequence[np.ndarray | int],
        stream: Any = None,
    ) -> None:
        """Run `k` to completion; `stream` is accepted for the executor and ignored (host
        launches are synchronous)."""
        self._bind(k, grid, args)()

    def record(self, launches: Sequence[BoundLaunch]) -> Callable[[Any], None]:
        """Bind every launch once (argument checks, ctypes marshalling) for cheap replays; an
        InStream is called in its place (there is no stream here)."""
        calls = [
            partial(k.enqueue, None) if isinstance(k, InStream) else self._bind(k, grid, args)
            for k, grid, args in launches
        ]

        def replay(stream: Any = None) -> None:
            for call in calls:
                call()

        return replay

    def _bind(
        self, k: HostKernel, grid: tuple[int, int, int], args: Sequence[np.ndarray | int]
    ) -> Callable[[], None]:
        kernel = k.kernel
        if len(grid) != 3 or any(not isinstance(g, int) or g < 1 for g in grid):
            raise ValueError(f"{kernel.name}: grid must be three positive ints, got {grid}")
        if len(args) != len(kernel.params):
            raise ValueError(
                f"{kernel.name}: expected {len(kernel.params)} arguments "
                f"({', '.join(p.name for p in kernel.params)}), got {len(args)}"
            )
        for p, a in zip(kernel.params, args, strict=True):
            if p.kind == "buffer":
                if not isinstance(a, np.ndarray):
                    raise ValueError(
                        f"{kernel.name}: param {p.name} ({p.c_type}) needs a numpy "
                        f"array, got {type(a).__name__}"
                    )
                if not a.flags.c_contiguous:
                    raise ValueError(f"{kernel.name}: param {p.name} must be C-contiguous")
            else:
                if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
                    raise ValueError(
                        f"{kernel.name}: param {p.name} (int) needs an int, got {type(a).__name__}"
                    )
                if not _INT32[0] <= int(a) <= _INT32[1]:
                    raise ValueError(f"{kernel.name}: param {p.name}={a} does not fit in int32")
        if k.lib is None:
            return lambda: self._run_sanitized(k, grid, args)
        # kernelParams convention: params[i] points at the value of argument i.
        values: list[ctypes.c_void_p | ctypes.c_int] = [
            ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else ctypes.c_int(int(a))
            for a in args
        ]
        params = (ctypes.c_void_p * max(1, len(values)))(
            *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values)
        )
        fn = getattr(k.lib, f"qir_launch_{kernel.name}")
        fn.restype = ctypes.c_int
        grid_c, block_c = (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*kernel.block)
        # `params` holds raw pointers into `values` and the arrays: the partial keeps them alive.
        loops = ctypes.c_int(self._loops(kernel))
        return partial(_call, k, fn, grid_c, block_c, params, loops, (values, args))

    def _loops(self, kernel: Kernel) -> int:
        """1 where a block runs as a loop over its threads (no collectives, fast mode): the
        check mode runs every kernel on fibers."""
        return int(self.mode == "fast" and not kernel.collectives)

    def _run_sanitized(
        self, k: HostKernel, grid: tuple[int, int, int], args: Sequence[np.ndarray | int]
    ) -> None:
        # Each buffer gets its own exact-size allocation in the child, so two args aliasing one
        # array are two copies there; sanitize mode is for catching indexing bugs, not aliasing.
        header = [*grid, *k.kernel.block, self._loops(k.kernel), len(args)]
        parts = [np.array(header, dtype=np.uint32).tobytes()]
        for a in args:
            if isinstance(a, np.ndarray):
                parts += [
                    np.array([0], np.uint32).tobytes(),
                    np.array([a.nbytes], np.uint64).tobytes(),
                    a.tobytes(),
                ]
            else:
                parts += [
                    np.array([1], np.uint32).tobytes(),
                    np.array([4], np.uint64).tobytes(),
                    np.array([a], np.int32).tobytes(),
                ]
        with tempfile.TemporaryDirectory(prefix="qir-host-") as d:
            inp, outp = Path(d) / "in.bin", Path(d) / "out.bin"
            inp.write_bytes(b"".join(parts))
            env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0"}
            proc = subprocess.run(
                [str(k.path), str(inp), str(outp)], capture_output=True, text=True, env=env
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{k.kernel.name} (sanitize): exit {proc.returncode}\n{proc.stderr.strip()}"
                )
            data = outp.read_bytes()
        offset = 0
        for a in args:
            if isinstance(a, np.ndarray):
                if a.flags.writeable:
                    a.reshape(-1).view(np.uint8)[:] = np.frombuffer(
                        data, np.uint8, a.nbytes, offset
                    )
                offset += a.nbytes

    # -- memory: "device" arrays are numpy arrays -----------------------------------------------

    def accept(self, a: Any) -> tuple[np.ndarray, bool]:
        """A numpy view of an input (no copy when it is already C-contiguous) and False: the
        results of a host run are numpy, whatever came in. Anything with `__dlpack__` on the CPU
        is taken through `np.from_dlpack` (zero-copy)."""
        if not isinstance(a, np.ndarray):
            if not hasattr(a, "__dlpack__"):
                raise BindError(
                    f"expected a numpy array or a DLPack tensor, got {type(a).__name__}"
                )
            try:
                a = np.from_dlpack(a)
            except (BufferError, RuntimeError, TypeError) as e:
                raise BindError(
                    f"cannot read a {type(a).__name__} on the host backend ({e}); "
                    "pass a CPU tensor, or use --backend cuda for device tensors"
                ) from None
        a = np.ascontiguousarray(a)
        if a.ctypes.data % VECTOR_ALIGN:
            a = a.copy()  # kernels read activations with 16-byte vector loads
        return a, False

    def to_device(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True, order="C")

    def from_device(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(a)

    def empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def view(
        self, arena: np.ndarray, offset: int, shape: tuple[int, ...], dtype: Any
    ) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        result: np.ndarray = arena[offset : offset + n].view(dtype).reshape(shape)
        return result

    def copy_into(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src, casting="no")

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return nullcontext(stream)

    def synchronize(self) -> None:
        """Launches are synchronous on the host."""


# One launch at a time per process: the shared runtime's worker pool and fiber stacks serve one
# launch (ranks of a tensor-parallel group run as threads of one process in tests).
_LAUNCH_LOCK = threading.Lock()


def _call(
    k: HostKernel, fn: Any, grid: Any, block: Any, params: Any, loops: Any, _alive: object
) -> None:
    with _LAUNCH_LOCK:
        failed = fn(grid, block, params, loops) != 0
    if failed:
        assert k.lib is not None
        err = k.lib.qir_host_error
        err.restype = ctypes.c_char_p
        raise RuntimeError(f"{k.kernel.name}: {err().decode()}")
