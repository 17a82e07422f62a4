"""The host backend: hand-written CUDA kernels compiled by g++, run as fibers, checked against
NumPy."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from qir.codegen.kernel import Kernel, KernelParam
from qir.errors import UsageError
from qir.runtime import host as host_module
from qir.runtime.errors import CompileError
from qir.runtime.host import HostBackend
from tests.requires import requires

pytestmark = requires("gxx")

PRELUDE = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <stdint.h>\n"


def buf(name: str, c_type: str) -> KernelParam:
    return KernelParam(name, c_type, "buffer")


def i32(name: str) -> KernelParam:
    return KernelParam(name, "int", "int")


def make(
    name: str, params: tuple[KernelParam, ...], body: str, block: tuple[int, int, int] = (128, 1, 1)
) -> Kernel:
    sig = ", ".join(f"{p.c_type} {p.name}" for p in params)
    src = f'{PRELUDE}\nextern "C" __global__ void {name}({sig}) {{\n{body}\n}}\n'
    return Kernel(name, src, params, block)


# One warp per row, butterfly reduction: the shape of a decode GEMV.
GEMV = make(
    "gemv_warp",
    (
        buf("w", "const float* __restrict__"),
        buf("x", "const float* __restrict__"),
        buf("y", "float* __restrict__"),
        i32("n"),
        i32("k"),
    ),
    """
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  float acc = 0.f;
  for (int j = lane; j < k; j += 32) acc += w[row * k + j] * x[j];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[row] = acc;
""",
    block=(256, 1, 1),
)


@pytest.fixture(scope="module")
def be(tmp_path_factory: pytest.TempPathFactory) -> HostBackend:
    return HostBackend(cache_dir=tmp_path_factory.mktemp("host-cache"))


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def test_warp_shuffle_gemv(be: HostBackend) -> None:
    n, k = 300, 200  # 300 rows is not a multiple of 8 warps per block: the last warps return
    w = rng().standard_normal((n, k)).astype(np.float32)
    x = rng().standard_normal(k).astype(np.float32)
    y = be.empty(n, np.float32)
    be.launch(be.load(GEMV), ((n + 7) // 8, 1, 1), [w, x, y, n, k])
    np.testing.assert_allclose(y, w @ x, rtol=1e-4, atol=1e-4)


def test_shuffle_variants_and_votes(be: HostBackend) -> None:
    kern = make(
        "shfl_variants",
        (buf("out", "int*"),),
        """
  const int lane = threadIdx.x % 32;
  int* o = out + 5 * threadIdx.x;
  o[0] = __shfl_down_sync(0xffffffffu, lane, 3);        // own value past the end
  o[1] = __shfl_sync(0xffffffffu, lane * 10, 7, 16);    // lane 7 of each 16-lane half
  o[2] = __shfl_xor_sync(0xffffffffu, lane, 8, 8);      // xor leaving the segment: own value
  o[3] = (int)__ballot_sync(0xffffffffu, lane % 2);
  o[4] = __shfl_up_sync(0xffffffffu, (unsigned)lane, 1);
""",
        block=(64, 1, 1),
    )
    out = np.zeros((64, 5), np.int32)
    be.launch(be.load(kern), (1, 1, 1), [out])
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(out[:, 0], np.where(lane + 3 < 32, lane + 3, lane))
    np.testing.assert_array_equal(out[:, 1], np.where(lane < 16, 70, 230))
    np.testing.assert_array_equal(out[:, 2], lane)
    np.testing.assert_array_equal(out[:, 3], np.full(64, np.int32(np.uint32(0xAAAAAAAA))))
    np.testing.assert_array_equal(out[:, 4], np.where(lane >= 1, lane - 1, lane))


def test_shared_memory_block_reduction(be: HostBackend) -> None:
    kern = BLOCK_SUM  # defined with the pool tests below
    n = 1000
    x = rng().standard_normal(n).astype(np.float32)
    blocks = (n + 127) // 128
    out = be.empty(blocks, np.float32)
    be.launch(be.load(kern), (blocks, 1, 1), [x, out, n])
    ref = np.pad(x, (0, blocks * 128 - n)).reshape(blocks, 128).sum(axis=1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_2d_grid_ragged_edges(be: HostBackend) -> None:
    kern = make(
        "add_2d",
        (buf("a", "const float*"), buf("b", "float*"), i32("rows"), i32("cols")),
        """
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y * blockDim.y + threadIdx.y;
  if (r >= rows || c >= cols) return;
  b[r * cols + c] = a[r * cols + c] * 2.f + (float)(gridDim.x * 1000 + blockDim.y);
""",
        block=(16, 8, 1),
    )
    rows, cols = 37, 53
    a = rng().standard_normal((rows, cols)).astype(np.float32)
    b = np.full((rows, cols), np.nan, np.float32)
    grid = ((cols + 15) // 16, (rows + 7) // 8, 1)
    be.launch(be.load(kern), grid, [a, b, rows, cols])
    np.testing.assert_allclose(b, a * 2 + grid[0] * 1000 + 8, rtol=1e-6)


def test_uint4_loads_and_half_bf16(be: HostBackend) -> None:
    # 8 halves per 128-bit load in, one bf16 sum per row out.
    kern = make(
        "half_rows_to_bf16",
        (buf("x", "const uint4* __restrict__"), buf("y", "__nv_bfloat16*"), i32("n")),
        """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint4 v = __ldg(&x[i]);
  const __half2* h = reinterpret_cast<const __half2*>(&v);
  float acc = 0.f;
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h[j]);
    acc += f.x + f.y;
  }
  y[i] = __float2bfloat16(acc);
""",
    )
    n = 333
    x = rng().standard_normal((n, 8)).astype(np.float16)
    y = be.empty(n, ml_dtypes.bfloat16)
    be.launch(be.load(kern), ((n + 127) // 128, 1, 1), [x, y, n])
    ref = x.astype(np.float32).sum(axis=1).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(y.astype(np.float32), ref.astype(np.float32))


def test_bf16_in_half_out(be: HostBackend) -> None:
    kern = make(
        "bf16_scale",
        (buf("x", "const __nv_bfloat16*"), buf("y", "__half*"), i32("n"), i32("scale")),
        """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2half(__bfloat162float(x[i]) * (float)scale);
""",
    )
    n = 200
    x = rng().standard_normal(n).astype(ml_dtypes.bfloat16)
    y = be.empty(n, np.float16)
    be.launch(be.load(kern), (2, 1, 1), [x, y, n, -3])
    np.testing.assert_array_equal(y, (x.astype(np.float32) * -3).astype(np.float16))


def test_atomic_add_across_blocks(be: HostBackend) -> None:
    kern = make(
        "atomics",
        (buf("x", "const float*"), buf("fsum", "float*"), buf("count", "int*"), i32("n")),
        """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  atomicAdd(fsum, x[i]);
  atomicAdd(count, 1);
""",
    )
    n = 5000
    x = np.ones(n, np.float32) * 0.5  # exactly representable partial sums: order-independent
    fsum, count = np.zeros(1, np.float32), np.zeros(1, np.int32)
    be.launch(be.load(kern), ((n + 127) // 128, 1, 1), [x, fsum, count, n])
    assert fsum[0] == n * 0.5
    assert count[0] == n


def test_deadlock_is_reported(be: HostBackend) -> None:
    kern = make(
        "early_return_then_sync",
        (buf("out", "float*"),),
        """
  __shared__ float s[128];
  if (threadIdx.x >= 100) return;  // these threads never reach the barrier
  s[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = s[0];
""",
    )
    out = be.empty(128, np.float32)
    with pytest.raises(
        RuntimeError,
        match=r"deadlock.*28 of 128 threads returned.*100 wait at "
        r"__syncthreads",
    ):
        be.launch(be.load(kern), (4, 1, 1), [out])


def test_divergent_warp_barrier_is_reported(be: HostBackend) -> None:
    kern = make(
        "warp_vs_block",
        (buf("out", "int*"),),
        """
  if (threadIdx.x < 16) __syncthreads();
  else out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
""",
        block=(32, 1, 1),
    )
    with pytest.raises(RuntimeError, match="16 wait at __syncthreads, 16 at a warp barrier"):
        be.launch(be.load(kern), (1, 1, 1), [np.zeros(32, np.int32)])


def test_compile_error_names_kernel_and_line(be: HostBackend) -> None:
    kern = make("broken_kernel", (buf("y", "float*"),), "  y[0] = undeclared_thing + 1.f;")
    with pytest.raises(CompileError) as e:
        be.load(kern)
    msg = str(e.value)
    assert "broken_kernel" in msg
    assert "y[0] = undeclared_thing + 1.f;" in msg
    assert e.value.compiler == "g++"


def test_argument_checks(be: HostBackend) -> None:
    k = be.load(GEMV)
    w, x, y = np.zeros((8, 32), np.float32), np.zeros(32, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="expected 5 arguments"):
        be.launch(k, (1, 1, 1), [w, x, y, 8])
    with pytest.raises(ValueError, match=r"param x .*numpy array"):
        be.launch(k, (1, 1, 1), [w, 3, y, 8, 32])
    with pytest.raises(ValueError, match="param w must be C-contiguous"):
        be.launch(k, (1, 1, 1), [w.T, x, y, 8, 32])
    with pytest.raises(ValueError, match=r"param k .*needs an int"):
        be.launch(k, (1, 1, 1), [w, x, y, 8, 32.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"param n=.*int32"):
        be.launch(k, (1, 1, 1), [w, x, y, 2**31, 32])


def test_gemv_speed(be: HostBackend) -> None:
    """512x256, one warp per row: 16384 fibers, 5 shuffles each. Loose bound, catches only a
    regression to a syscall per switch."""
    n, k = 512, 256
    w = rng().standard_normal((n, k)).astype(np.float32)
    x = rng().standard_normal(k).astype(np.float32)
    y = be.empty(n, np.float32)
    hk = be.load(GEMV)
    be.launch(hk, (n // 8, 1, 1), [w, x, y, n, k])
    t0 = time.perf_counter()
    be.launch(hk, (n // 8, 1, 1), [w, x, y, n, k])
    elapsed = time.perf_counter() - t0
    np.testing.assert_allclose(y, w @ x, rtol=1e-4, atol=1e-4)
    assert elapsed < 1.0


def test_sanitize_catches_out_of_bounds_write(tmp_path: Path) -> None:
    be = HostBackend(cache_dir=tmp_path, sanitize=True)
    kern = make(
        "off_by_one",
        (buf("y", "float*"), i32("n")),
        """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) y[i] = 1.f;  // bug: writes y[n]
""",
    )
    hk = be.load(kern)
    # The report names the kernel's own line (the build's -g1 line tables).
    with pytest.raises(
        RuntimeError, match=r"heap-buffer-overflow \S*off_by_one\.cu:8 in off_by_one"
    ):
        be.launch(hk, (1, 1, 1), [np.zeros(100, np.float32), 100])
    # In bounds, the sanitized run computes and copies results back.
    y = np.zeros(128, np.float32)
    be.launch(hk, (1, 1, 1), [y, 100])
    np.testing.assert_array_equal(y, np.r_[np.ones(101), np.zeros(27)])


# -- the persistent runtime: worker pool and fiber stacks reused across launches ----------------

BLOCK_SUM = make(
    "block_sum_shared",
    (buf("x", "const float*"), buf("out", "float*"), i32("n")),
    """
  __shared__ float s[128];
  const int i = blockIdx.x * 128 + threadIdx.x;
  s[threadIdx.x] = i < n ? x[i] : 0.f;
  __syncthreads();
  for (int stride = 64; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
""",
)


def block_sums(x: np.ndarray) -> np.ndarray:
    blocks = (x.size + 127) // 128
    return np.pad(x, (0, blocks * 128 - x.size)).reshape(blocks, 128).sum(axis=1)


def run_gemv(be: HostBackend, seed: int, n: int = 96, k: int = 160) -> None:
    g = np.random.default_rng(seed)
    w = g.standard_normal((n, k)).astype(np.float32)
    x = g.standard_normal(k).astype(np.float32)
    y = np.full(n, np.nan, np.float32)
    be.launch(be.load(GEMV), ((n + 7) // 8, 1, 1), [w, x, y, n, k])
    np.testing.assert_allclose(y, w @ x, rtol=1e-4, atol=1e-4)


def run_block_sum(be: HostBackend, seed: int, n: int = 1000) -> None:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    out = np.full((n + 127) // 128, np.nan, np.float32)
    be.launch(be.load(BLOCK_SUM), (out.size, 1, 1), [x, out, n])
    np.testing.assert_allclose(out, block_sums(x), rtol=1e-5, atol=1e-5)


def test_many_consecutive_launches_stay_correct(be: HostBackend) -> None:
    # Two libraries with different block sizes (256 and 128 threads) interleaved on the same
    # reused fibers, each launch with fresh data.
    for i in range(200):
        (run_gemv if i % 2 else run_block_sum)(be, i)


def test_launches_from_two_python_threads_at_once(be: HostBackend) -> None:
    be.load(GEMV), be.load(BLOCK_SUM)  # compile first: the threads should race on launches
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(offset: int) -> None:
        try:
            start.wait()
            for i in range(60):
                # Both threads launch both kernels: same library concurrently, too.
                (run_gemv if (i + offset) % 2 else run_block_sum)(be, 1000 * offset + i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_launch_errors_are_per_thread(be: HostBackend) -> None:
    # A failing launch on one Python thread does not leak its message into another's.
    kern = make(
        "always_deadlocks",
        (buf("out", "float*"),),
        "  if (threadIdx.x == 0) return;\n  __syncthreads();\n  out[0] = 1.f;",
        block=(32, 1, 1),
    )
    hk = be.load(kern)
    ok: list[bool] = []

    def good() -> None:
        for i in range(20):
            run_block_sum(be, i)
        ok.append(True)

    t = threading.Thread(target=good)
    t.start()
    for _ in range(20):
        with pytest.raises(RuntimeError, match="deadlock"):
            be.launch(hk, (3, 1, 1), [np.zeros(1, np.float32)])
    t.join()
    assert ok == [True]


def test_single_worker_thread(be: HostBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QIR_HOST_THREADS", "1")
    for i in range(5):
        run_block_sum(be, i, n=5000)
        run_gemv(be, i)


def test_launches_after_a_deadlock_start_from_fresh_fibers(be: HostBackend) -> None:
    kern = make(
        "half_deadlock",
        (buf("out", "float*"),),
        """
  if (threadIdx.x < 64) return;
  __syncthreads();  // the other 64 park here for good
  out[threadIdx.x] = 1.f;
""",
    )
    with pytest.raises(RuntimeError, match="deadlock"):
        be.launch(be.load(kern), (8, 1, 1), [np.zeros(128, np.float32)])
    # The fibers parked mid-kernel must not be resumed by the next launches, of any kernel.
    run_block_sum(be, 1)
    run_gemv(be, 2)


def test_stack_overflow_is_reported_and_later_launches_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Thread 1 writes 72 KiB into its 64 KiB stack: down past its canary into thread 0's stack
    # (already done and parked), never below the arena. That holds for -O2's frame (what users
    # build); -O1's reaches below the arena and faults, so this one builds at -O2.
    monkeypatch.setenv("QIR_HOST_OPT", "2")
    be = HostBackend()
    kern = make(
        "deep_stack",
        (buf("out", "int*"),),
        """
  if (threadIdx.x != 1) return;
  volatile char big[72 * 1024];
  for (int i = 0; i < (int)sizeof(big); ++i) big[i] = (char)i;
  out[0] = big[100];
""",
        block=(2, 1, 1),
    )
    with pytest.raises(RuntimeError, match=r"thread \(1,0,0\) of block \(0,0,0\) overflowed"):
        be.launch(be.load(kern), (1, 1, 1), [np.zeros(1, np.int32)])
    run_block_sum(be, 3)
    run_gemv(be, 4)


def test_loaded_libraries_share_one_runtime(be: HostBackend) -> None:
    # One worker pool and one set of fiber stacks per thread however many kernels are loaded.
    def runtime_of(lib: ctypes.CDLL | None) -> int | None:
        assert lib is not None
        fn = lib.qir_host_runtime
        fn.restype = ctypes.c_void_p
        return fn()

    first, second = be.load(GEMV), be.load(BLOCK_SUM)
    assert first.lib is not second.lib
    assert runtime_of(first.lib) == runtime_of(second.lib) is not None
    # The runtime library's: kernel libraries are built without a pool of their own.
    assert runtime_of(first.lib) in {ptr for ptr, _ in host_module._RUNTIMES.values()}


def test_a_kernel_library_loaded_outside_the_backend_refuses_to_launch(
    be: HostBackend, tmp_path: Path
) -> None:
    """A copy of a kernel library that nobody gave a runtime fails its launch with a message
    (it has no worker pool of its own) instead of crashing."""
    copy = tmp_path / "copy.so"
    shutil.copy(be.load(BLOCK_SUM).path, copy)
    lib = ctypes.CDLL(str(copy))
    launch = getattr(lib, f"qir_launch_{BLOCK_SUM.name}")
    launch.restype = ctypes.c_int
    dims = (ctypes.c_uint * 3)(1, 1, 1)
    values = [ctypes.c_uint64(0) for _ in BLOCK_SUM.params]
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    assert launch(dims, (ctypes.c_uint * 3)(32, 1, 1), params, 0) == 1
    lib.qir_host_error.restype = ctypes.c_char_p
    assert b"no runtime" in lib.qir_host_error()


EXIT_SCRIPT = """
import os, sys, threading, time
import numpy as np
sys.path.insert(0, {here!r})
from test_host import GEMV, BLOCK_SUM, run_gemv, run_block_sum
from qir.runtime import host as host_module
from qir.runtime.host import HostBackend
be = HostBackend(cache_dir={cache!r})
run_gemv(be, 0)
run_block_sum(be, 1)
if os.fork() == 0:  # a child of fork() starts without the parent's workers
    run_gemv(be, 2)
    run_block_sum(be, 3)
    os._exit(0)
assert os.wait()[1] == 0
# A daemon thread still launching when the interpreter exits.
threading.Thread(target=lambda: [run_gemv(be, i) for i in range(10**6)], daemon=True).start()
time.sleep(0.2)
print("done")
"""


def test_interpreter_exits_cleanly_with_workers_parked(be: HostBackend, tmp_path: Path) -> None:
    script = EXIT_SCRIPT.format(here=str(Path(__file__).parent), cache=str(be.cache.root))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"


# Each thread reads its right neighbour's slot with no barrier between write and read: on a
# GPU the result depends on warp timing. Forward order runs the reader before its neighbour
# writes; reverse order runs the neighbour first.
NEIGHBOUR_RACE = make(
    "neighbour_race",
    (buf("out", "int*"),),
    """
  __shared__ int s[129];
  s[threadIdx.x] = -1;
  s[128] = 128;
  __syncthreads();
  s[threadIdx.x] = threadIdx.x;  // missing __syncthreads() after this write
  out[threadIdx.x] = s[threadIdx.x + 1];
""",
)
# The same with the barrier: race-free, so both orders agree.
NEIGHBOUR_SYNCED = make(
    "neighbour_synced",
    (buf("out", "int*"),),
    """
  __shared__ int s[129];
  s[threadIdx.x] = threadIdx.x;
  s[128] = 128;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x + 1];
""",
)


@pytest.mark.parametrize(("schedule", "stale"), [("forward", True), ("reverse", False)])
def test_schedule_exposes_a_missing_barrier(
    be: HostBackend, monkeypatch: pytest.MonkeyPatch, schedule: str, stale: bool
) -> None:
    monkeypatch.setenv("QIR_HOST_SCHEDULE", schedule)
    out = be.empty(128, np.int32)
    be.launch(be.load(NEIGHBOUR_RACE), (1, 1, 1), [out])
    synced = be.empty(128, np.int32)
    be.launch(be.load(NEIGHBOUR_SYNCED), (1, 1, 1), [synced])
    np.testing.assert_array_equal(synced, np.arange(1, 129))
    # Forward: every reader runs before its neighbour writes and sees the -1 fill; reverse:
    # the neighbour has written. The last thread reads the constant slot either way.
    want = np.where(np.arange(128) < 127, -1, 128) if stale else np.arange(1, 129)
    np.testing.assert_array_equal(out, want)


def test_reverse_schedule_runs_blocks_last_to_first(
    be: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    kern = make(
        "block_order",
        (buf("order", "int*"), buf("ticket", "int*")),
        "if (threadIdx.x == 0) order[blockIdx.x] = atomicAdd(ticket, 1);",
    )
    monkeypatch.setenv("QIR_HOST_THREADS", "1")  # one worker: tickets follow the run order
    for schedule, want in (("forward", np.arange(6)), ("reverse", np.arange(6)[::-1])):
        monkeypatch.setenv("QIR_HOST_SCHEDULE", schedule)
        order, ticket = be.empty(6, np.int32), np.zeros(1, np.int32)
        be.launch(be.load(kern), (6, 1, 1), [order, ticket])
        np.testing.assert_array_equal(order, want)


def test_unknown_schedule_is_a_clear_error(
    be: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIR_HOST_SCHEDULE", "sideways")
    with pytest.raises(RuntimeError, match="QIR_HOST_SCHEDULE=sideways not supported"):
        be.launch(be.load(NEIGHBOUR_SYNCED), (1, 1, 1), [be.empty(128, np.int32)])


def test_the_optimisation_level_changes_no_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite builds kernels at -O1 without the unroll pragmas (QIR_HOST_OPT, QIR_HOST_UNROLL,
    tests/conftest.py), users get -O3 with them: the same bytes from W4A4's quantize_act, GEMV
    and GEMM and the 16-bit GEMM on FP4 codes (exact integer sums, f16 pair sums, the MMA
    emulation, float epilogues). -O2 stands in for -O3 (the same unrolled code, a faster build).
    A bad level or unroll mode is refused."""
    from qir.codegen.lower import lower
    from qir.formats.nvfp4 import Nvfp4
    from qir.passes.manager import run_pipeline
    from qir.runtime.executor import CompiledBlock
    from tests.runtime.test_every_format import block, inputs

    graph, weights = block(Nvfp4("div", 4))
    plan = lower(run_pipeline(graph, "default")[0])
    builds = {"suite": ("1", "0"), "user": ("2", "1")}
    runs = {}
    for name, (level, unroll) in builds.items():
        monkeypatch.setenv("QIR_HOST_OPT", level)
        monkeypatch.setenv("QIR_HOST_UNROLL", unroll)
        be = HostBackend()
        runs[name] = CompiledBlock(plan, be, weights)
        source = be.source(plan.launches[0].kernel)
        assert ("#pragma GCC unroll" in source) == (unroll == "1"), name
    for m in (1, 33, 70):
        x = inputs(m)
        suite, user = (runs[name].run(x) for name in builds)
        for name, value in suite.items():
            assert value.tobytes() == user[name].tobytes(), (m, name)
    monkeypatch.setenv("QIR_HOST_OPT", "-O3")
    with pytest.raises(UsageError, match=r"QIR_HOST_OPT='-O3': expected one of 0, 1, 2, 3"):
        HostBackend()
    monkeypatch.setenv("QIR_HOST_OPT", "1")
    monkeypatch.setenv("QIR_HOST_UNROLL", "yes")
    with pytest.raises(UsageError, match=r"QIR_HOST_UNROLL='yes': expected 1"):
        HostBackend()


# Threads that never wait for one another: the generator may say so (Kernel.collectives).
RAGGED_SCALE = make(
    "ragged_scale",
    (buf("x", "const float*"), buf("y", "float*"), i32("n")),
    """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * (float)(threadIdx.x + 1) + (float)blockIdx.x;
""",
)


def test_a_kernel_without_collectives_runs_as_loops_with_the_same_bytes(
    be: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast mode runs its blocks as plain loops over the threads (forward and reversed), the
    check mode on fibers; all give the same bytes, and equal numpy."""
    n = 1000  # 8 blocks of 128, the last ragged
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    want = x * (np.arange(n) % 128 + 1).astype(np.float32) + (np.arange(n) // 128)
    loops = replace(RAGGED_SCALE, collectives=False)
    outs = {}
    for mode, schedule in (("fast", "forward"), ("fast", "reverse"), ("check", "forward")):
        monkeypatch.setenv("QIR_HOST_MODE", mode)
        monkeypatch.setenv("QIR_HOST_SCHEDULE", schedule)
        b = HostBackend()
        assert b._loops(loops) == (mode == "fast")
        y = b.empty(n, np.float32)
        b.launch(b.load(loops), (8, 1, 1), [x, y, n])
        outs[mode, schedule] = y.tobytes()
        np.testing.assert_array_equal(y, want.astype(np.float32))
    assert len(set(outs.values())) == 1


def test_a_collective_in_a_kernel_generated_without_any_fails_the_launch(be: HostBackend) -> None:
    kern = replace(
        make(
            "sync_anyway",
            (buf("out", "float*"),),
            """
  __shared__ float s[128];
  s[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = s[127 - threadIdx.x];
""",
        ),
        collectives=False,
    )
    with pytest.raises(RuntimeError, match=r"no collectives .* reached __syncthreads"):
        be.launch(be.load(kern), (1, 1, 1), [be.empty(128, np.float32)])
