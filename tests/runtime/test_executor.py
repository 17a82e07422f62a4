"""The executor: liveness-planned memory, DLPack inputs, streams, capture/replay, and no growth
over repeated runs. Host backend here; the GPU twins are marked `gpu` and skip without one."""

from __future__ import annotations

import gc
import resource
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import qir
from qir.codegen.lower import lower
from qir.dtypes import F16
from qir.errors import UsageError
from qir.formats.mlx import MlxAffine
from qir.interpret import BindError
from qir.runtime.memory import ALIGN, plan_memory
from tests.conftest import ON_GPU, mlp_graph
from tests.requires import requires

FMT = MlxAffine(4, 32, F16)
HIDDEN, INTER = 128, 64

needs_gxx = requires("gxx")


@pytest.fixture(scope="module")
def mlp() -> tuple[qir.Graph, Any]:
    return mlp_graph(np.random.default_rng(0), HIDDEN, INTER, FMT, F16)


@pytest.fixture(scope="module")
def host_block(mlp: tuple[qir.Graph, Any]) -> qir.Compiled:
    return qir.compile(*mlp, backend="host", passes="none")


def x_of(m: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, HIDDEN), np.float32).astype(np.float16)


# -- memory planning ---------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 7, 64])
def test_live_values_never_share_bytes(mlp: tuple[qir.Graph, Any], m: int) -> None:
    plan = lower(mlp[0])
    mem = plan_memory(plan, m)
    # A value lives from the launch that writes it to the last launch that reads it.
    span: dict[str, list[int]] = {}
    for i, launch in enumerate(plan.launches):
        for v in launch.outputs:
            span[v] = [i, i]
        for a in launch.args:
            if a.kind == "value" and a.ref in span:
                span[a.ref][1] = i
    sizes = {v: m * (HIDDEN if v == "down" else INTER) * 2 for v in mem.offsets}
    for a in mem.offsets:
        assert mem.offsets[a] % ALIGN == 0
        assert mem.offsets[a] + sizes[a] <= mem.arena_bytes
        for b in mem.offsets:
            overlap_time = span[a][0] <= span[b][1] and span[b][0] <= span[a][1]
            ra = (mem.offsets[a], mem.offsets[a] + sizes[a])
            rb = (mem.offsets[b], mem.offsets[b] + sizes[b])
            if a != b and overlap_time:
                assert ra[1] <= rb[0] or rb[1] <= ra[0], (a, b)
    assert "y" not in mem.offsets  # outputs are never in the arena
    assert mem.output_bytes == m * HIDDEN * 2


def test_intermediates_reuse_memory(mlp: tuple[qir.Graph, Any]) -> None:
    # gate, up, act, h: [M, 64] f16 each; down: [M, 128]. At most three are live at once.
    mem = plan_memory(lower(mlp[0]), 64)
    row = 64 * INTER * 2
    assert mem.unshared_bytes == 4 * row + 64 * HIDDEN * 2
    assert mem.arena_bytes == 3 * row
    assert mem.peak_bytes == mem.arena_bytes + mem.output_bytes


@needs_gxx
def test_peak_bytes_is_reported(mlp: tuple[qir.Graph, Any], host_block: qir.Compiled) -> None:
    assert host_block.plan is not None
    assert host_block.peak_bytes(64) == plan_memory(host_block.plan, 64).peak_bytes
    assert host_block.peak_bytes(64) > host_block.peak_bytes(1)
    with pytest.raises(UsageError, match="needs a kernel backend"):
        qir.compile(*mlp, backend="reference").peak_bytes(1)


# -- runs --------------------------------------------------------------------------------------


@needs_gxx
@pytest.mark.parametrize("m", [1, 5, 9])
def test_planned_run_matches_reference(
    mlp: tuple[qir.Graph, Any], host_block: qir.Compiled, m: int
) -> None:
    ref = qir.compile(*mlp, backend="reference")
    x = x_of(m)
    ours = host_block({"x": x})["y"]
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float16
    np.testing.assert_allclose(
        ours.astype(np.float32), ref({"x": x})["y"].astype(np.float32), rtol=2e-3, atol=2e-3
    )


class Tensor:
    """A foreign CPU tensor that only speaks DLPack (as a torch CPU tensor would)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kw: Any) -> Any:
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._a.__dlpack_device__()


@needs_gxx
def test_dlpack_input_without_copy(host_block: qir.Compiled) -> None:
    x = x_of(3)
    be = host_block._exec.backend  # type: ignore[union-attr]
    arr, on_device = be.accept(Tensor(x))
    assert np.shares_memory(arr, x) and not on_device
    np.testing.assert_array_equal(host_block({"x": Tensor(x)})["y"], host_block({"x": x})["y"])
    with pytest.raises(BindError, match="DLPack"):
        host_block({"x": [[1.0]]})


@needs_gxx
def test_results_are_not_reused_between_runs(host_block: qir.Compiled) -> None:
    a = host_block({"x": x_of(2, seed=1)})["y"]
    keep = a.copy()
    host_block({"x": x_of(2, seed=2)}, stream=None)
    np.testing.assert_array_equal(a, keep)


@needs_gxx
def test_a_run_does_not_walk_the_graph(
    host_block: qir.Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a run needs from the graph is looked up when the block is built: a topological sort
    per run cost ~80 us of CPU, more than a decode step's kernels take on a GPU."""
    want = host_block({"x": x_of(3)})["y"]

    def walked(self: qir.Graph) -> list[str]:
        raise AssertionError("a run walked the graph")

    monkeypatch.setattr(qir.Graph, "order", walked)
    np.testing.assert_array_equal(host_block({"x": x_of(3)})["y"], want)
    assert host_block({"x": x_of(70)})["y"].shape == (70, HIDDEN)  # a batch size not seen yet
    with pytest.raises(BindError, match=r"input %x: shape \[128\], expected"):
        host_block({"x": x_of(3)[0]})


@needs_gxx
def test_runs_from_several_threads_agree(host_block: qir.Compiled) -> None:
    """A server may call one block from several threads: each run has its own arena."""
    xs = [x_of(m, seed=m) for m in (1, 3, 5, 9, 70, 2, 7, 4)]
    want = [host_block({"x": x})["y"] for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: host_block({"x": x})["y"], xs * 3))
    for i, y in enumerate(got):
        np.testing.assert_array_equal(y, want[i % len(xs)])


@needs_gxx
def test_capture_replays_identically(host_block: qir.Compiled) -> None:
    g = host_block.capture(4)
    for seed in (1, 2):
        x = x_of(4, seed)
        np.testing.assert_array_equal(g({"x": x})["y"], host_block({"x": x})["y"])
    # Inputs written in place, replay with none.
    g.inputs["x"][...] = x_of(4, 3)
    np.testing.assert_array_equal(g()["y"], host_block({"x": x_of(4, 3)})["y"])
    with pytest.raises(
        BindError, match=r"input %x: shape \[5, 128\], expected \[4, 128\] \(captured for M=4\)"
    ):
        g({"x": x_of(5)})
    with pytest.raises(BindError, match="dtype float32"):
        g({"x": x_of(4).astype(np.float32)})


@needs_gxx
def test_captured_batches_pad_to_the_nearest_size(host_block: qir.Compiled) -> None:
    batches = host_block.capture_batches([16, 1, 4])
    assert list(batches.captures) == [1, 4, 16]
    for m, size in [(1, 1), (2, 4), (4, 4), (5, 16), (16, 16)]:
        assert batches.capture_for(m) is batches.captures[size]
        x = x_of(m, seed=m)
        got = batches({"x": x})["y"]
        assert got.shape == (m, HIDDEN)
        np.testing.assert_array_equal(got, host_block({"x": x})["y"])
    first = batches({"x": x_of(2, seed=1)})["y"]
    kept = first.copy()
    batches({"x": x_of(3, seed=2)})  # the same capture of 4 rows: its outputs are overwritten
    assert not np.array_equal(first, kept)


@needs_gxx
def test_captured_batches_refuse_what_they_cannot_serve(host_block: qir.Compiled) -> None:
    batches = host_block.capture_batches([4])
    with pytest.raises(BindError, match=r"M=5: the captured batch sizes are \[4\]"):
        batches({"x": x_of(5)})
    with pytest.raises(BindError, match=r"M=0: the captured batch sizes are \[4\]"):
        batches({"x": x_of(0)})
    with pytest.raises(BindError, match=r"input %x: shape \[2, 64\], expected \[2, 128\]"):
        batches({"x": x_of(2)[:, :64]})
    with pytest.raises(BindError, match=r"inputs \['y'\]; the block takes \['x'\]"):
        batches({"y": x_of(2)})
    with pytest.raises(BindError, match="batch sizes must be a non-empty list of ints"):
        host_block.capture_batches([])
    with pytest.raises(BindError, match="batch sizes must be a non-empty list of ints"):
        host_block.capture_batches([2.0])  # type: ignore[list-item]


@needs_gxx
def test_captured_batches_only_pad_within_the_same_kernels() -> None:
    """Above 64 rows a W4A4 block runs 16-bit twins: a batch of 5 padded to 72 rows would take
    other kernels (and other numerics) than a run of 5 does, so it is refused."""
    from qir.formats.nvfp4 import Nvfp4

    graph, weights = mlp_graph(np.random.default_rng(0), HIDDEN, INTER, Nvfp4("div", 4), F16)
    block = qir.compile(graph, weights, backend="host")
    with pytest.raises(BindError, match=r"M=5: no captured batch size of at least 5 rows runs"):
        block.capture_batches([72])({"x": x_of(5)})
    both = block.capture_batches([8, 72])
    for m in (5, 70):
        np.testing.assert_array_equal(both({"x": x_of(m)})["y"], block({"x": x_of(m)})["y"])


@needs_gxx
def test_capture_waits_for_work_already_queued(
    host_block: qir.Compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captured buffers may be memory an earlier run on the stream still uses (CuPy's pool
    reuses per stream without waiting): capture returns only once the device is idle."""
    be = host_block._exec.backend  # type: ignore[union-attr]
    events: list[str] = []
    record = be.record
    monkeypatch.setattr(be, "record", lambda bound: events.append("record") or record(bound))
    monkeypatch.setattr(be, "synchronize", lambda: events.append("synchronize"))
    host_block.capture(2)
    assert events == ["record", "synchronize"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@needs_gxx
def test_repeated_runs_do_not_grow_memory() -> None:
    # The smallest MLP (a host launch costs ~4 us per fiber): 1000 runs stay around 20 s.
    g, w = mlp_graph(np.random.default_rng(0), 64, 32, FMT, F16)
    block = qir.compile(g, w, backend="host", passes="none")
    x = x_of(1)[:, :64].copy()
    replay = block.capture(1)
    for _ in range(20):  # warm: allocator arenas, numpy caches
        block({"x": x})
        replay({"x": x})
    gc.collect()
    before = _rss_bytes()
    for i in range(1000):
        block({"x": x})
        if i % 10 == 0:
            replay({"x": x})
    gc.collect()
    grown = _rss_bytes() - before
    # Keeping each run's arena and output (~1 KiB) would be ~1 MiB; keeping the fiber stacks
    # of a launch would be far more.
    assert grown < 1 * 2**20, grown


# -- GPU ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_block(mlp: tuple[qir.Graph, Any]) -> qir.Compiled:
    return qir.compile(*mlp, backend="cuda", passes="none")


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.gpu
@ON_GPU
def test_gpu_capture_replays_identically(cuda_block: qir.Compiled, m: int) -> None:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    g = cuda_block.capture(m, stream=stream)
    batches = cuda_block.capture_batches([2, 16], stream=stream)  # m=1 and 8 are padded
    for seed in (1, 2):
        x = x_of(m, seed)
        plain = cuda_block({"x": x}, stream=stream)["y"]
        replayed = g({"x": x}, stream=stream)["y"]
        with stream:  # uploaded on the stream that reads it
            x_device = cupy.asarray(x)
        padded = batches({"x": x_device}, stream=stream)["y"]
        stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(replayed), plain)
        np.testing.assert_array_equal(cupy.asnumpy(padded), plain)


@pytest.mark.gpu
@ON_GPU
def test_gpu_pool_does_not_grow(cuda_block: qir.Compiled) -> None:
    import cupy

    pool = cupy.get_default_memory_pool()
    x = cupy.asarray(x_of(8))
    cuda_block({"x": x})
    cupy.cuda.Device().synchronize()
    first = pool.total_bytes()
    for _ in range(1000):
        cuda_block({"x": x})
    cupy.cuda.Device().synchronize()
    assert pool.total_bytes() == first


@pytest.mark.gpu
@ON_GPU
def test_gpu_device_arrays_in_and_out_without_copy(cuda_block: qir.Compiled) -> None:
    import cupy

    be = cuda_block._exec.backend  # type: ignore[union-attr]
    x = cupy.asarray(x_of(3))
    arr, on_device = be.accept(x)
    assert on_device and arr.data.ptr == x.data.ptr
    y = cuda_block({"x": x})["y"]
    assert isinstance(y, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(y), cuda_block({"x": x_of(3)})["y"])


@pytest.mark.gpu
@requires("gpu", "torch")
def test_gpu_torch_tensor_in_dlpack_out(cuda_block: qir.Compiled) -> None:
    import cupy
    import torch

    t = torch.from_numpy(x_of(3)).cuda()
    be = cuda_block._exec.backend  # type: ignore[union-attr]
    arr, on_device = be.accept(t)
    assert on_device and arr.data.ptr == t.data_ptr()
    stream = torch.cuda.current_stream()
    y = cuda_block({"x": t}, stream=stream)["y"]
    assert isinstance(y, cupy.ndarray)
    back = torch.from_dlpack(y)
    assert back.data_ptr() == y.data.ptr
    stream.synchronize()
    np.testing.assert_array_equal(back.cpu().numpy(), cuda_block({"x": x_of(3)})["y"])


def test_misaligned_input_is_copied_not_read_unaligned(tmp_path) -> None:
    """Kernels read activations with 16-byte loads: an input view 2 bytes into a buffer must
    not reach them as is (it crashed the host backend)."""
    import qir
    from qir.builder import Builder
    from qir.dtypes import F16
    from qir.formats.mlx import MlxAffine
    from qir.types import QWeight

    fmt = MlxAffine(4, 64, F16)
    rng = np.random.default_rng(0)
    bufs = fmt.quantize(rng.standard_normal((16, 128), dtype=np.float32))
    b = Builder()
    x = b.input("x", ("M", 128), F16)
    b.output("y", b.qlinear(x, b.weight("w", QWeight(fmt, 16, 128))))
    raw = np.zeros(2 * 3 * 128 + 16, np.uint8)[2:]
    xa = raw[: 2 * 3 * 128].view(np.float16).reshape(3, 128)
    xa[:] = rng.standard_normal((3, 128)).astype(np.float16)
    assert xa.ctypes.data % 16
    ours = qir.compile(b.graph, {"w": bufs}, backend="host")({"x": xa})["y"]
    ref = qir.interpret(b.graph, {"x": xa}, {"w": bufs})["y"]
    # The GEMV sums a run's products in f16 pairs: within about 1e-3 of the row's largest output.
    ref32 = ref.astype(np.float32)
    np.testing.assert_allclose(
        ours.astype(np.float32), ref32, rtol=2e-3, atol=2e-3 * float(np.abs(ref32).max())
    )
