"""The cuda backend: the NVRTC test kernels run on a GPU against NumPy references."""

from __future__ import annotations

import sys
import types
import warnings

import ml_dtypes
import numpy as np
import pytest

# Sibling test module: pytest puts this directory on sys.path (no __init__.py here).
from test_nvrtc import BF16_SCALE, HALF_SUM, HEADER_AXPY

from qir.codegen.kernel import Kernel
from qir.interpret import BindError
from qir.runtime.cuda import CudaBackend, available
from qir.runtime.errors import BackendUnavailable, CompileError
from qir.runtime.nvrtc import compile_cubin
from tests.conftest import ON_GPU
from tests.requires import requires

N = 1000  # not a multiple of any block size, so the bounds checks matter


def test_without_gpu_names_the_host_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    no_gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "cupy", no_gpu)
    with pytest.raises(BackendUnavailable, match=r"is_available\(\) is false.*--backend host"):
        CudaBackend()


def test_without_cupy_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(BackendUnavailable, match=r"qir\[cuda\].*--backend host"):
        CudaBackend()
    assert not available()


class FakeDevice:
    id = 0
    compute_capability = "90"

    def __init__(self, index: int = 0) -> None: ...

    def __enter__(self) -> None: ...

    def __exit__(self, *exc: object) -> None: ...


def fake_cupy(**extra: object) -> types.SimpleNamespace:
    """Just enough of CuPy's namespace for CudaBackend to be built on a machine without a GPU."""
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        Device=FakeDevice,
        compiler=types.SimpleNamespace(CompileException=RuntimeError),
        Stream=type("Stream", (), {}),
        ExternalStream=type("ExternalStream", (), {}),
    )
    for name, value in extra.items():
        setattr(cuda, name, value)
    return types.SimpleNamespace(cuda=cuda, ndarray=type("ndarray", (), {}))


# None: not installed; an empty module: a cuda-core before 1.0 (Program under .experimental).
@pytest.mark.parametrize("cuda_core", [None, types.ModuleType("cuda.core")], ids=["none", "0.x"])
def test_without_cuda_core_compiles_through_cupy_rawmodule(
    monkeypatch: pytest.MonkeyPatch, tmp_path, cuda_core: types.ModuleType | None
) -> None:
    """A GPU image with CuPy but no usable cuda-core still loads kernels: through CuPy's
    RawModule, with the kernel's own headers on the include path while it compiles."""
    seen: dict[str, object] = {}

    class RawModule:
        def __init__(self, code: str, options: tuple[str, ...]) -> None:
            seen["code"], seen["options"] = code, options

        def get_function(self, name: str) -> str:
            include = next(o[2:] for o in seen["options"] if o.startswith("-I"))
            seen["header"] = (tmp_path.__class__(include) / "ops" / "axpy.h").read_text()
            return f"function {name}"

    fake = fake_cupy()
    fake.RawModule = RawModule
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cuda.core", cuda_core)
    be = CudaBackend(cache_dir=tmp_path)
    be.prepare(HEADER_AXPY)  # CuPy compiles as it loads: nothing to prepare
    assert not seen and be.cache.compiles == 0
    loaded = be.load(HEADER_AXPY)
    assert loaded.function == f"function {HEADER_AXPY.name}"
    assert seen["code"] == HEADER_AXPY.source
    assert "-std=c++17" in seen["options"]
    assert seen["header"] == dict(HEADER_AXPY.headers)["ops/axpy.h"]


@requires("nvrtc")
def test_prepare_compiles_the_cubin_that_load_then_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """prepare (run on compile threads) builds the cubin without touching the device; load (on
    the caller's thread) hands that cubin to the driver and compiles nothing."""
    loaded: list[bytes] = []

    class Module:
        def load(self, cubin: bytes) -> None:
            loaded.append(cubin)

        def get_function(self, name: str) -> str:
            return f"function {name}"

    monkeypatch.setitem(
        sys.modules, "cupy", fake_cupy(function=types.SimpleNamespace(Module=Module))
    )
    be = CudaBackend(cache_dir=tmp_path)
    be.prepare(HALF_SUM)
    assert be.cache.compiles == 1 and not loaded
    assert be.load(HALF_SUM).function == "function half_sum8"
    assert be.cache.compiles == 1
    assert loaded == [compile_cubin(HALF_SUM, be.arch, be.cache).cubin]
    assert loaded[0].startswith(b"\x7fELF")


class TestForeignStreams:
    """Streams from other libraries, checked without a GPU against a fake CuPy."""

    @pytest.fixture
    def made(self, monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[tuple[str, object]]:
        made: list[tuple[str, object]] = []

        class ExternalStream:
            def __init__(self, handle: int, device: int) -> None:
                warnings.warn("ExternalStream is deprecated", DeprecationWarning, stacklevel=2)
                made.append(("external", (handle, device)))

        class Stream:
            @staticmethod
            def from_external(obj: object) -> str:
                made.append(("from_external", obj))
                return "protocol stream"

        monkeypatch.setitem(
            sys.modules, "cupy", fake_cupy(ExternalStream=ExternalStream, Stream=Stream)
        )
        self.be = CudaBackend(cache_dir=tmp_path)
        return made

    def test_torch_stream_handle_without_a_deprecation_warning(self, made) -> None:
        torch_like = types.SimpleNamespace(
            cuda_stream=0x1234, device=types.SimpleNamespace(index=0)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.be._stream(torch_like)
        assert made == [("external", (0x1234, 0))]

    def test_cuda_stream_protocol_goes_through_from_external(self, made) -> None:
        class Proto:
            def __cuda_stream__(self) -> tuple[int, int]:
                return (0, 0x99)

        obj = Proto()
        assert self.be._stream(obj) == "protocol stream"
        assert made == [("from_external", obj)]

    def test_stream_of_another_device_is_refused(self, made) -> None:
        other = types.SimpleNamespace(cuda_stream=0x1234, device=types.SimpleNamespace(index=1))
        with pytest.raises(BindError, match="stream is on device 1, the block on 0"):
            self.be._stream(other)
        assert made == []

    def test_not_a_stream(self, made) -> None:
        with pytest.raises(BindError, match="must be a CuPy or torch CUDA stream"):
            self.be._stream("default")


def test_dlpack_refusal_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    def from_dlpack(obj: object) -> None:
        raise TypeError("CPU arrays cannot be directly imported to CuPy")

    fake = fake_cupy()
    fake.from_dlpack = from_dlpack
    monkeypatch.setitem(sys.modules, "cupy", fake)
    be = CudaBackend(cache_dir=tmp_path)
    cpu_tensor = types.SimpleNamespace(__dlpack__=lambda **kw: None)
    with pytest.raises(BindError, match=r"CPU arrays cannot.*a CPU tensor: pass it as numpy"):
        be.accept(cpu_tensor)


def _grid(n: int, block: tuple[int, int, int]) -> tuple[int, int, int]:
    return ((n + block[0] - 1) // block[0], 1, 1)


@pytest.mark.gpu
@ON_GPU
class TestOnGpu:
    @pytest.fixture(scope="class")
    def be(self) -> CudaBackend:
        return CudaBackend()

    def test_half_uint4_loads(self, be: CudaBackend) -> None:
        x = np.random.default_rng(0).standard_normal((N, 8)).astype(np.float16)
        k = be.load(HALF_SUM)
        y = be.empty(N, np.float16)
        be.launch(k, _grid(N, HALF_SUM.block), [be.to_device(x), y, N])
        be.synchronize()
        want = x.astype(np.float32).sum(axis=1).astype(np.float16)
        np.testing.assert_allclose(be.from_device(y), want, rtol=1e-3, atol=1e-3)

    def test_bfloat16_round_trips_as_raw_bits(self, be: CudaBackend) -> None:
        x = np.random.default_rng(1).standard_normal(N).astype(ml_dtypes.bfloat16)
        k = be.load(BF16_SCALE)
        y = be.empty(N, ml_dtypes.bfloat16)
        be.launch(k, _grid(N, BF16_SCALE.block), [be.to_device(x), y, 3, np.int64(N)])
        got = be.from_device(y).view(ml_dtypes.bfloat16)
        want = (x.astype(np.float32) * 3).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))

    def test_kernel_headers_are_on_the_include_path(self, be: CudaBackend) -> None:
        rng = np.random.default_rng(2)
        x, b = rng.standard_normal((2, N)).astype(np.float32)
        y = be.empty(N, np.float32)
        be.launch(
            be.load(HEADER_AXPY),
            _grid(N, HEADER_AXPY.block),
            [be.to_device(x), be.to_device(b), y, N],
        )
        np.testing.assert_allclose(be.from_device(y), 2 * x + b, rtol=1e-6)

    def test_launch_on_a_stream(self, be: CudaBackend) -> None:
        import cupy

        x = np.arange(N, dtype=np.float32)
        y = be.empty(N, np.float32)
        stream = cupy.cuda.Stream(non_blocking=True)
        be.launch(
            be.load(HEADER_AXPY),
            _grid(N, HEADER_AXPY.block),
            [be.to_device(x), be.to_device(x), y, N],
            stream=stream,
        )
        stream.synchronize()
        np.testing.assert_array_equal(be.from_device(y), 3 * x)

    def test_load_is_cached(self, be: CudaBackend) -> None:
        assert be.load(HALF_SUM) is be.load(HALF_SUM)

    def test_compile_error(self, be: CudaBackend) -> None:
        broken = Kernel(
            "broken_gpu", 'extern "C" __global__ void broken_gpu() { int x = ; }', (), (1, 1, 1)
        )
        with pytest.raises(CompileError, match="broken_gpu"):
            be.load(broken)

    def test_launch_checks_arguments(self, be: CudaBackend) -> None:
        k = be.load(HALF_SUM)
        x = be.empty((N, 8), np.float16)
        y = be.empty(N, np.float16)
        with pytest.raises(ValueError, match=r"half_sum8 takes 3 arguments \(x, y, n\), got 2"):
            be.launch(k, (1, 1, 1), [x, y])
        with pytest.raises(ValueError, match=r"parameter n .*expected an int, got float"):
            be.launch(k, (1, 1, 1), [x, y, 1.0])
        with pytest.raises(ValueError, match=r"parameter x .*expected a cupy array, got ndarray"):
            be.launch(k, (1, 1, 1), [np.zeros(8), y, N])
        with pytest.raises(ValueError, match=r"parameter n .*does not fit in 32 bits"):
            be.launch(k, (1, 1, 1), [x, y, 2**31])
        with pytest.raises(ValueError, match=r"parameter x .*not C-contiguous"):
            be.launch(k, (1, 1, 1), [x[:, ::2], y, N])
