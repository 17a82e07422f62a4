"""The `cuda` backend: kernels compiled to cubin by NVRTC and launched on a CUDA GPU through CuPy.

CuPy is an optional extra (`qir[cuda]`), so it is imported only when a backend is built.

Compiling: the cubin comes from `nvrtc.compile_cubin` (cuda.core, `qir[compile]`) for the
device's arch, through qir's compile cache, and is loaded with `cupy.cuda.function.Module.load`
(cuModuleLoadData, from memory). CuPy's own kernel cache (`RawModule`) is not used: its key has
no notion of qir's codegen version, it needs a driver to compile, and sharing the compile-only
path means a CI machine without a GPU warms exactly the entries a GPU machine loads. What CuPy
does provide: module loading, launches, its stream-ordered memory pool (a run's arena is reused
from the pool, so repeated runs do not grow it) and graph capture (`Stream.begin_capture`).
Without a usable cuda-core (a machine with only CuPy, or cuda-core before 1.0) kernels compile
through `cupy.RawModule` instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from qir.codegen.kernel import Kernel
from qir.interpret import BindError
from qir.runtime.backend_api import BoundLaunch, InStream
from qir.runtime.cache import KernelCache
from qir.runtime.errors import BackendUnavailable, CompileError
from qir.runtime.loading import prepare_all
from qir.runtime.nvrtc import available as nvrtc_available
from qir.runtime.nvrtc import compile_cubin, kernel_include_dir
from qir.runtime.toolkit import cuda_include_dirs
from qir.target import Target

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
VECTOR_ALIGN = 16


def available() -> bool:
    """Whether CuPy is installed and sees a CUDA GPU."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


def device_target(device: int = 0) -> Target | None:
    """The target of this machine's GPU `device`, None without one."""
    if not available():
        return None
    import cupy

    return Target.of_capability(cupy.cuda.Device(device).compute_capability)


@dataclass(frozen=True)
class CudaKernel:
    kernel: Kernel
    function: Any  # cupy.cuda.function.Function, loaded on the backend's device


class CudaBackend:
    name = "cuda"

    def __init__(self, device: int = 0, cache_dir: Any = None) -> None:
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailable(
                "CuPy is not installed: pip install 'qir[cuda]', or use --backend host"
            ) from e
        if not cupy.cuda.is_available():
            raise BackendUnavailable(
                "no CUDA GPU available (cupy.cuda.is_available() is false); use --backend host"
            )
        # Machines with CuPy but no usable cuda-core (a bare GPU image) compile through CuPy's
        # RawModule instead: its own disk cache keys on source, options and NVRTC version.
        self._compile = self._cubin_via_cache if nvrtc_available() else self._module_via_cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device < count:
            raise BackendUnavailable(f"no CUDA device {device}: this machine has {count}")
        self._cp = cupy
        self.device = cupy.cuda.Device(device)
        # Plans for this GPU use its arch-specific instructions (sm_120a: the FP4 conversion and
        # the block-scaled FP4 MMA), and its cubins are built for them.
        self.target = Target.of_capability(self.device.compute_capability)
        self.arch = self.target.arch
        self.cache = KernelCache.at(cache_dir)

    def load(self, kernel: Kernel) -> CudaKernel:
        spec = (self.name, self.device.id, kernel)
        return self.cache.loaded(spec, lambda: self._load(kernel))

    def prepare(self, kernel: Kernel) -> None:
        """Compile `kernel` into the caches without loading it; safe on any thread (NVRTC needs
        no device). CuPy's RawModule compiles as it loads, so that path prepares nothing."""
        if self._compile == self._cubin_via_cache:
            compile_cubin(kernel, self.arch, self.cache)

    def prepare_many(self, kernels: Sequence[Kernel], done: Callable[[Kernel], None]) -> int:
        """`prepare` the distinct `kernels` on the compile threads, one NVRTC call each."""

        def one(kernel: Kernel) -> None:
            self.prepare(kernel)
            done(kernel)

        return prepare_all(one, kernels)

    def _load(self, kernel: Kernel) -> CudaKernel:
        with self.device:
            return CudaKernel(kernel, self._compile(kernel))

    def _cubin_via_cache(self, kernel: Kernel) -> Any:
        cubin = compile_cubin(kernel, self.arch, self.cache).cubin
        module = self._cp.cuda.function.Module()
        module.load(cubin)
        return module.get_function(kernel.name)

    def _module_via_cupy(self, kernel: Kernel) -> Any:
        # CuPy keys its cache on the options, so the headers live at a path named by their
        # content (a temporary directory would miss CuPy's cache in every process).
        includes = [f"-I{d}" for d in (self._stable_headers(kernel), *cuda_include_dirs())]
        options = ("-std=c++17", *includes)
        try:
            return self._cp.RawModule(code=kernel.source, options=options).get_function(kernel.name)
        except self._cp.cuda.compiler.CompileException as e:
            raise CompileError(kernel.name, "nvrtc", str(e), kernel.source, filename="*") from None

    def _stable_headers(self, kernel: Kernel) -> Path:
        digest = hashlib.sha256(repr(kernel.headers).encode()).hexdigest()[:16]
        path = self.cache.root / "headers" / digest
        if not path.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=path.parent))
            with kernel_include_dir(kernel) as tmp:
                shutil.copytree(tmp, staging, dirs_exist_ok=True)
            try:
                os.replace(staging, path)
            except OSError:  # another process got there first: its copy is the same
                shutil.rmtree(staging, ignore_errors=True)
        return path

    # -- launch --------------------------------------------------------------------------------

    def launch(
        self,
        k: CudaKernel,
        grid: tuple[int, int, int],
        args: Sequence[Any],
        stream: Any = None,
    ) -> None:
        """Launch `k` with `k.kernel.block` threads per block; `args` follow `k.kernel.params`:
        a C-contiguous device array for each buffer, a Python or NumPy int for each int."""
        converted = self._check(k, args)
        with self.device:
            k.function(tuple(grid), tuple(k.kernel.block), converted, stream=self._stream(stream))

    def record(self, launches: Sequence[BoundLaunch]) -> Callable[[Any], None]:
        """Capture the launches into a CUDA graph; the result replays it on a stream. An
        InStream enqueues its work on the capture stream, inside the graph (NCCL >= 2.9 records
        its collectives in a capture; the communicator must not allocate while capturing)."""
        bound = [
            (k, tuple(grid), args if isinstance(k, InStream) else self._check(k, args))
            for k, grid, args in launches
        ]
        with self.device:  # a stream belongs to the device current when it is made
            capture = self._cp.cuda.Stream(non_blocking=True)  # capture needs a non-default one
        with self.device, capture:
            capture.begin_capture()
            try:
                for k, grid, args in bound:
                    if isinstance(k, InStream):
                        k.enqueue(capture)
                    else:
                        k.function(grid, tuple(k.kernel.block), args, stream=capture)
            except BaseException:
                # A failed launch invalidates the capture, and end_capture would then raise
                # over the error that matters.
                with suppress(Exception):
                    capture.end_capture()
                raise
            graph = capture.end_capture()
        # The graph holds raw pointers into the arrays in `bound`: the partial keeps them alive.
        return partial(self._replay, graph, bound)

    def _replay(self, graph: Any, _alive: object, stream: Any = None) -> None:
        with self.device:  # a foreign stream is labelled with the current device
            graph.launch(self._stream(stream))

    def _check(self, k: CudaKernel, args: Sequence[Any]) -> tuple[Any, ...]:
        params = k.kernel.params
        if len(args) != len(params):
            names = ", ".join(p.name for p in params)
            raise ValueError(
                f"kernel {k.kernel.name} takes {len(params)} arguments ({names}), got {len(args)}"
            )
        converted: list[Any] = []
        for param, arg in zip(params, args, strict=True):
            where = f"kernel {k.kernel.name}, parameter {param.name} ({param.c_type})"
            if param.kind == "int":
                if isinstance(arg, bool) or not isinstance(arg, (int, np.integer)):
                    raise ValueError(f"{where}: expected an int, got {type(arg).__name__}")
                if not _INT32_MIN <= int(arg) <= _INT32_MAX:
                    raise ValueError(f"{where}: {arg} does not fit in 32 bits")
                converted.append(np.int32(arg))
            else:
                if not isinstance(arg, self._cp.ndarray):
                    raise ValueError(f"{where}: expected a cupy array, got {type(arg).__name__}")
                # The kernel sees a bare pointer: a strided view would be read as if packed.
                if not arg.flags.c_contiguous:
                    raise ValueError(f"{where}: array is not C-contiguous")
                if arg.device.id != self.device.id:
                    raise ValueError(
                        f"{where}: array is on device {arg.device.id}, not {self.device.id}"
                    )
                converted.append(arg)
        return tuple(converted)

    def _stream(self, stream: Any) -> Any:
        """A CuPy stream for `stream`: None (the current stream), a CuPy stream, or a foreign one
        (torch.cuda.Stream via its `cuda_stream` handle; anything with `__cuda_stream__`)."""
        cp = self._cp
        if stream is None or isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            return stream
        index = getattr(getattr(stream, "device", None), "index", None)
        if isinstance(index, int) and index != self.device.id:
            # CuPy would label the handle with our device and the launch would fail inside CUDA.
            raise BindError(f"stream is on device {index}, the block on {self.device.id}")
        handle = getattr(stream, "cuda_stream", None)
        if handle is None and hasattr(stream, "__cuda_stream__"):
            return cp.cuda.Stream.from_external(stream)
        handle = stream if handle is None else handle
        if not isinstance(handle, int):
            raise BindError(f"stream must be a CuPy or torch CUDA stream, got {type(stream)}")
        with warnings.catch_warnings():
            # CuPy 14 deprecates ExternalStream for Stream.from_external, which takes only
            # objects with __cuda_stream__, not the raw handle torch.cuda.Stream offers.
            warnings.simplefilter("ignore", DeprecationWarning)
            return cp.cuda.ExternalStream(handle, self.device.id)

    # -- memory --------------------------------------------------------------------------------

    def accept(self, a: Any) -> tuple[Any, bool]:
        """numpy arrays are uploaded (results come back as numpy); CuPy arrays and anything with
        `__dlpack__` (a torch CUDA tensor) are used in place when C-contiguous and on this
        device (results stay on the device, as CuPy arrays)."""
        cp = self._cp
        if isinstance(a, np.ndarray):
            return self.to_device(a), False
        if not isinstance(a, cp.ndarray):
            if not hasattr(a, "__dlpack__"):
                raise BindError(f"expected an array or a DLPack tensor, got {type(a).__name__}")
            try:
                a = cp.from_dlpack(a)
            except (BufferError, RuntimeError, TypeError, ValueError) as e:
                # CuPy refuses CPU tensors (TypeError), and dtypes it cannot map (bf16 needs
                # ml_dtypes with numpy >= 2.1.2; else NotImplementedError, a RuntimeError).
                hint = (
                    " (a CPU tensor: pass it as numpy, or move it to the GPU)"
                    if isinstance(e, TypeError)
                    else " (for bf16 without ml_dtypes, pass t.view(torch.int16))"
                    if isinstance(e, NotImplementedError)
                    else ""
                )
                raise BindError(
                    f"cannot import a {type(a).__name__} via DLPack: {e}{hint}"
                ) from None
        if a.device.id != self.device.id:
            raise BindError(f"input is on device {a.device.id}, the block on {self.device.id}")
        with self.device:
            a = cp.ascontiguousarray(a)
            if a.data.ptr % VECTOR_ALIGN:
                a = a.copy()  # kernels read activations with 16-byte vector loads
            return a, True

    def to_device(self, a: np.ndarray) -> Any:
        with self.device:
            return self._cp.asarray(_storable(a))

    def from_device(self, a: Any) -> np.ndarray:
        # asnumpy copies on the current stream and waits for it.
        with self.device:
            return np.asarray(self._cp.asnumpy(a))

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> Any:
        with self.device:
            return self._cp.empty(shape, dtype=_storable_dtype(np.dtype(dtype)))

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        dt = _storable_dtype(np.dtype(dtype))
        n = int(np.prod(shape)) * dt.itemsize
        return arena[offset : offset + n].view(dt).reshape(shape)

    def copy_into(self, dst: Any, src: Any) -> None:
        with self.device:
            if isinstance(src, np.ndarray):
                dst.set(_storable(src), stream=self._cp.cuda.get_current_stream())
            else:
                self._cp.copyto(dst, src.view(dst.dtype), casting="no")

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return self._on(stream)

    @contextmanager
    def _on(self, stream: Any) -> Iterator[Any]:
        with self.device:  # a foreign stream is labelled with the current device
            s = self._stream(stream)
            if s is None:
                yield self._cp.cuda.get_current_stream()
            else:
                with s:
                    yield s

    def synchronize(self) -> None:
        self.device.synchronize()


def _storable_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    # CuPy has no bfloat16 / float8 / float4 (ml_dtypes registers them as kind "V"); kernels only
    # see raw bits, so such arrays live on the device as unsigned ints of the same width.
    if dtype.kind == "V" and dtype.itemsize in (1, 2, 4, 8):
        return np.dtype(f"u{dtype.itemsize}")
    return dtype


def _storable(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(_storable_dtype(a.dtype))
