"""The `cuda` backend: kernels compiled by CuPy's NVRTC and launched on a CUDA GPU.

CuPy is an optional extra (`qir[cuda]`), so it is imported only when a backend is built.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from qir.codegen.kernel import Kernel
from qir.runtime.errors import BackendUnavailable, CompileError
from qir.runtime.nvrtc import kernel_include_dir
from qir.runtime.toolkit import cuda_include_dirs

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def available() -> bool:
    """Whether CuPy is installed and sees a CUDA GPU."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


@dataclass(frozen=True)
class CudaKernel:
    kernel: Kernel
    function: Any  # cupy.RawKernel, compiled and loaded on the backend's device


class CudaBackend:
    name = "cuda"

    def __init__(self, device: int = 0) -> None:
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
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= device < count:
            raise BackendUnavailable(f"no CUDA device {device}: this machine has {count}")
        self._cp = cupy
        self.device = cupy.cuda.Device(device)
        self.arch = f"sm_{self.device.compute_capability}"
        self._kernels: dict[tuple[str, str], CudaKernel] = {}

    def load(self, kernel: Kernel) -> CudaKernel:
        digest = hashlib.sha256(kernel.source.encode())
        for name, text in kernel.headers:
            digest.update(f"\0{name}\0{text}".encode())
        key = (kernel.name, digest.hexdigest())
        if key not in self._kernels:
            self._kernels[key] = CudaKernel(kernel, self._compile(kernel))
        return self._kernels[key]

    def _compile(self, kernel: Kernel) -> Any:
        cp = self._cp
        with self.device, kernel_include_dir(kernel) as inc:
            # CuPy may append its own -arch for the current device; NVRTC keeps the last one.
            options = (
                "-std=c++17",
                f"-arch={self.arch}",
                f"-I{inc}",
                *(f"-I{d}" for d in cuda_include_dirs()),
            )
            module = cp.RawModule(code=kernel.source, options=options)
            try:
                # get_function compiles, and must do so while the include dir still exists.
                return module.get_function(kernel.name)
            except cp.cuda.compiler.CompileException as e:
                raise CompileError(kernel.name, "nvrtc", str(e), kernel.source) from e

    def launch(
        self,
        k: CudaKernel,
        grid: tuple[int, int, int],
        args: Sequence[Any],
        stream: Any = None,
    ) -> None:
        """Launch `k` with `k.kernel.block` threads per block; `args` follow `k.kernel.params`:
        a C-contiguous device array for each buffer, a Python or NumPy int for each int."""
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
        with self.device, stream if stream is not None else nullcontext():
            k.function(tuple(grid), tuple(k.kernel.block), tuple(converted))

    def to_device(self, a: np.ndarray) -> Any:
        with self.device:
            return self._cp.asarray(_storable(a))

    def from_device(self, a: Any) -> np.ndarray:
        with self.device:
            return np.asarray(self._cp.asnumpy(a))

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> Any:
        with self.device:
            return self._cp.empty(shape, dtype=_storable_dtype(np.dtype(dtype)))

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
