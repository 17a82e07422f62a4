"""The `host` backend: rendered CUDA kernels compiled by g++ and run on the CPU.

Every CUDA thread is a fiber (see include/qir_host.h); blocks are spread over OS threads
(`QIR_HOST_THREADS`, default: all CPUs). Buffers are plain numpy arrays, so "device" memory is
host memory and copies are ordinary copies.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike

from qir.codegen.kernel import Kernel
from qir.runtime.errors import CompileError
from qir.runtime.toolkit import cuda_include_dirs

log = logging.getLogger("qir.runtime")

HEADER = Path(__file__).parent / "include" / "qir_host.h"
CXX = "g++"
# CUDA code routinely type-puns through reinterpret_cast (uint4 -> __half2 etc.), which nvcc
# tolerates and g++ -O2 miscompiles under strict aliasing.
BASE_FLAGS = ("-std=c++17", "-fno-strict-aliasing", "-x", "c++")
# Hidden visibility keeps each kernel's copy of the runtime private to its .so (no process-wide
# unique symbols shared between kernels); the entry points are exported explicitly.
SO_FLAGS = ("-O2", "-fPIC", "-shared", "-fvisibility=hidden")
# An ASan runtime cannot be loaded into an uninstrumented Python without LD_PRELOAD, so sanitized
# kernels are built as standalone executables and run in a child process (see QIR_HOST_RUNNER).
SANITIZE_FLAGS = (
    "-O1",
    "-g",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
)
_INT32 = (-(2**31), 2**31 - 1)


@cache
def _compiler_version() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout


def _default_cache_dir() -> Path:
    root = os.environ.get("QIR_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "qir") / "host"


def _write_atomic(path: Path, data: str | bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class HostKernel:
    kernel: Kernel
    path: Path  # the shared object, or the executable in sanitize mode
    lib: ctypes.CDLL | None  # None in sanitize mode: the kernel runs in a child process


class HostBackend:
    name = "host"

    def __init__(self, cache_dir: Path | None = None, sanitize: bool = False) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
        self.sanitize = sanitize
        self._loaded: dict[str, HostKernel] = {}

    # -- compile -------------------------------------------------------------------------------

    def _flags(self, kernel: Kernel, build: Path) -> list[str]:
        mode = (
            (*SANITIZE_FLAGS, f"-DQIR_HOST_RUNNER=qir_launch_{kernel.name}")
            if self.sanitize
            else SO_FLAGS
        )
        includes = [f"-I{d}" for d in (build, *cuda_include_dirs())]
        return [*BASE_FLAGS, *mode, "-include", str(HEADER), *includes]

    def _key(self, kernel: Kernel, source: str) -> str:
        h = hashlib.sha256()
        # Include dirs depend on the build dir, which depends on the key: hash the mode instead.
        for part in (
            source,
            repr(kernel.headers),
            HEADER.read_text(),
            repr(self.sanitize),
            repr((BASE_FLAGS, SO_FLAGS, SANITIZE_FLAGS)),
            _compiler_version(),
            repr(cuda_include_dirs()),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def load(self, kernel: Kernel) -> HostKernel:
        # One exported, generic trampoline per kernel; qir_host.h does the argument unpacking.
        source = f"{kernel.source.rstrip()}\n\nQIR_HOST_EXPORT({kernel.name})\n"
        key = self._key(kernel, source)
        if key in self._loaded:
            return self._loaded[key]
        build = self.cache_dir / f"{kernel.name}-{key[:16]}"
        build.mkdir(parents=True, exist_ok=True)
        out = build / (f"{kernel.name}.exe" if self.sanitize else f"{kernel.name}.so")
        # The lock keeps concurrent processes from compiling the same kernel twice.
        with open(build / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            hk = self._open(kernel, out) if out.exists() else None
            if hk is None:
                self._compile(kernel, source, build, out)
                hk = self._open(kernel, out)
                if hk is None:
                    raise RuntimeError(f"cannot load freshly compiled {out}")
        self._loaded[key] = hk
        return hk

    def _open(self, kernel: Kernel, out: Path) -> HostKernel | None:
        """The cached artifact, or None if it is unusable (a corrupt entry is a miss)."""
        if self.sanitize:
            return HostKernel(kernel, out, None) if os.access(out, os.X_OK) else None
        try:
            lib = ctypes.CDLL(str(out))
            getattr(lib, f"qir_launch_{kernel.name}")
        except (OSError, AttributeError):
            return None
        return HostKernel(kernel, out, lib)

    def _compile(self, kernel: Kernel, source: str, build: Path, out: Path) -> None:
        for name, text in kernel.headers:
            _write_atomic(build / name, text)
        cu = build / f"{kernel.name}.cu"
        _write_atomic(cu, source)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        cmd = [CXX, *self._flags(kernel, build), str(cu), "-o", str(tmp)]
        log.info("compiling %s (host g++) ...", kernel.name)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise CompileError(kernel.name, "g++", proc.stderr.strip(), source)
        os.replace(tmp, out)
        log.info("compiled %s (host g++) in %.2f s", kernel.name, time.perf_counter() - t0)

    # -- launch --------------------------------------------------------------------------------

    def launch(
        self, k: HostKernel, grid: tuple[int, int, int], args: Sequence[np.ndarray | int]
    ) -> None:
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
            self._run_sanitized(k, grid, args)
            return
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
        rc = fn((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*kernel.block), params)
        if rc != 0:
            err = k.lib.qir_host_error
            err.restype = ctypes.c_char_p
            raise RuntimeError(f"{kernel.name}: {err().decode()}")

    def _run_sanitized(
        self, k: HostKernel, grid: tuple[int, int, int], args: Sequence[np.ndarray | int]
    ) -> None:
        # Each buffer gets its own exact-size allocation in the child, so two args aliasing one
        # array are two copies there; sanitize mode is for catching indexing bugs, not aliasing.
        parts = [np.array([*grid, *k.kernel.block, len(args)], dtype=np.uint32).tobytes()]
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

    # -- memory --------------------------------------------------------------------------------

    def to_device(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True, order="C")

    def from_device(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True, order="C")

    def empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        """Launches are synchronous on the host."""
