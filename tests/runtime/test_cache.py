"""The compile cache, with no GPU: the host backend (g++) and compile-only NVRTC."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path

import numpy as np
import pytest

from qir.codegen.kernel import Kernel
from qir.errors import UsageError
from qir.runtime import cache as cache_mod
from qir.runtime import host as host_mod
from qir.runtime import nvrtc as nvrtc_mod
from qir.runtime.cache import KernelCache, key, read_entry
from qir.runtime.errors import CompileError
from qir.runtime.host import HostBackend, HostKernel
from qir.runtime.loading import compile_jobs, load_kernels
from tests.requires import requires
from tests.runtime.test_host import GEMV
from tests.runtime.test_nvrtc import HALF_SUM

needs_gxx = requires("gxx")
needs_nvrtc = requires("nvrtc")


@cache
def _session_cache() -> Path:
    """The session cache, holding its precompiled qir_host.h and the host runtime library
    (both built by loading a kernel there)."""
    be = HostBackend()
    be.load(GEMV)
    return be.cache.root


def seeded(root: Path, runtime: bool = True) -> Path:
    """`root`, a fresh cache root, holding the session's precompiled header and (with
    `runtime`) its host runtime library: these tests are about kernel entries, and those two
    (tests/runtime/test_host_pch.py has the header's) would cost each of them seconds of g++
    again."""
    return host_mod.seed_cache(_session_cache(), root, runtime)


def run_gemv(k: HostKernel) -> np.ndarray:
    y = np.zeros(8, np.float32)
    args = [np.ones((8, 32), np.float32), np.ones(32, np.float32), y, 8, 32]
    HostBackend().launch(k, (1, 1, 1), args)
    return y


def entry(root: Path, name: str) -> Path:
    (path,) = (p for p in (root / "host").glob(f"{name}-*.so"))
    return path


def lock_path(root: Path) -> Path:
    be = HostBackend()
    parts = be.key_parts(GEMV, be.source(GEMV))
    return root / "host" / f"gemv_warp-{key(parts)[:32]}.so.lock"


# -- the key ---------------------------------------------------------------------------------

HOST_PARTS = ("source", "headers", "runtime_header", "options", "compiler", "toolkit", "cpu")


def test_the_runtime_header_key_reads_every_part_it_includes() -> None:
    """qir_host.h's parts key host builds as the header does: an edit to any of them rebuilds."""
    included = re.findall(r'^#include "([^"]+)"$', host_mod.HEADER.read_text(), re.MULTILINE)
    assert included and sorted(included) == [p.name for p in host_mod.HEADER_PARTS]
    text = host_mod.header_text()
    assert all(p.read_text() in text for p in host_mod.HEADER_PARTS)


@needs_gxx
def test_host_key_covers_every_input() -> None:
    be = HostBackend()
    parts = be.key_parts(GEMV, GEMV.source)
    assert set(parts) == set(HOST_PARTS)
    assert "g++" in parts["compiler"] or "GCC" in parts["compiler"]
    assert parts["options"] != HostBackend(sanitize=True).key_parts(GEMV, GEMV.source)["options"]
    with_header = Kernel(GEMV.name, GEMV.source, GEMV.params, GEMV.block, (("a.h", "//"),))
    assert be.key_parts(with_header, GEMV.source)["headers"] != parts["headers"]


@needs_nvrtc
def test_nvrtc_key_covers_every_input() -> None:
    parts = nvrtc_mod.key_parts(HALF_SUM, "sm_90")
    assert set(parts) == {*HOST_PARTS, "arch"} - {"runtime_header", "cpu"}
    assert parts["compiler"].startswith("nvrtc ")
    assert nvrtc_mod.key_parts(HALF_SUM, "sm_80")["arch"] == "sm_80"


@pytest.mark.parametrize("part", [*HOST_PARTS, "arch"])
def test_changing_any_part_changes_the_key(part: str) -> None:
    parts = {p: f"value of {p}" for p in (*HOST_PARTS, "arch")}
    assert key({**parts, part: parts[part] + "!"}) != key(parts)


def test_codegen_hash_and_payload_version_are_in_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = {"source": "x"}
    before = key(parts)
    monkeypatch.setattr(cache_mod, "PAYLOAD_VERSION", cache_mod.PAYLOAD_VERSION + 1)
    after_payload = key(parts)
    monkeypatch.setattr(cache_mod, "codegen_hash", lambda: "another codegen")
    assert len({before, after_payload, key(parts)}) == 3


def test_codegen_hash_covers_sources_and_templates() -> None:
    assert cache_mod.codegen_hash() == cache_mod.codegen_hash()
    files = {p.suffix for p in cache_mod._CODEGEN.rglob("*") if p.is_file()}
    assert {".py", ".j2"} <= files  # both kinds exist, and rglob walks into templates/


# -- hits and misses ---------------------------------------------------------------------------


@needs_gxx
def test_miss_then_process_hit_then_disk_hit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    be = HostBackend(cache_dir=seeded(tmp_path))
    # Per-kernel compile lines are debug records (one progress line per batch is info).
    caplog.set_level(logging.DEBUG, logger="qir.runtime")
    k = be.load(GEMV)
    assert be.cache.compiles == 1
    assert be.load(GEMV) is k  # in-process
    messages = [r.getMessage() for r in caplog.records]
    assert sum("compiling gemv_warp (host g++)" in m for m in messages) == 1
    assert any(m.startswith("compiled gemv_warp (host g++) in ") for m in messages)
    be.cache.forget()
    k2 = HostBackend(cache_dir=seeded(tmp_path)).load(GEMV)
    assert k2 is not k and be.cache.compiles == 1  # read back from disk
    np.testing.assert_array_equal(run_gemv(k2), 32)


@needs_gxx
def test_new_compiler_version_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    be = HostBackend(cache_dir=seeded(tmp_path))
    be.load(GEMV)
    be.cache.forget()
    monkeypatch.setattr(host_mod, "compiler_version", lambda: "g++ (imaginary) 99.0")
    be.load(GEMV)
    assert be.cache.compiles == 2
    assert len(list((tmp_path / "host").glob("gemv_warp-*.so"))) == 2


@needs_gxx
@pytest.mark.parametrize("damage", ["corrupt", "truncated", "empty", "trailer only"])
def test_damaged_entry_is_a_miss_and_is_rewritten(tmp_path: Path, damage: str) -> None:
    be = HostBackend(cache_dir=seeded(tmp_path))
    be.load(GEMV)
    path = entry(tmp_path, "gemv_warp")
    data = path.read_bytes()
    damaged = {
        "corrupt": data[:100] + bytes([data[100] ^ 1]) + data[101:],
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "trailer only": data[-cache_mod._TRAILER.size :],
    }[damage]
    # A new file in its place, as a crash or a bad disk would leave it: writing into the same
    # inode would also change the library this process has mapped, which crashes it at exit.
    tmp = path.with_suffix(".damaged")
    tmp.write_bytes(damaged)
    os.replace(tmp, path)
    assert read_entry(path) is None
    # A fresh root holding the damaged copy: the loader would otherwise hand back the library
    # this process already opened from `path`.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "host", other / "host")
    be2 = HostBackend(cache_dir=seeded(other))
    np.testing.assert_array_equal(run_gemv(be2.load(GEMV)), 32)
    assert be2.cache.compiles == 1
    assert read_entry(entry(other, "gemv_warp")) is not None


# -- unwritable roots --------------------------------------------------------------------------


def _readonly(monkeypatch: pytest.MonkeyPatch, root: Path, err: int) -> None:
    """Make `root` unwritable. Tests run as root here, which ignores chmod, so creating files or
    directories under it fails the way a read-only mount or a full disk does."""
    if os.geteuid() != 0:
        root.chmod(0o555)
        return
    real_open, real_mkdir = os.open, os.mkdir

    def guarded_open(path: str | os.PathLike[str], flags: int, *a: object, **kw: object) -> int:
        if Path(path).is_relative_to(root) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, flags, *a, **kw)  # type: ignore[arg-type]

    def guarded_mkdir(path: str | os.PathLike[str], *a: object, **kw: object) -> None:
        if Path(path).is_relative_to(root):
            raise OSError(err, os.strerror(err), str(path))
        real_mkdir(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", guarded_open)
    monkeypatch.setattr(os, "mkdir", guarded_mkdir)


@needs_gxx
@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC], ids=["read-only", "full"])
def test_unwritable_root_degrades_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, err: int
) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    _readonly(monkeypatch, root, err)
    caplog.set_level(logging.WARNING, logger="qir.runtime")
    be = HostBackend(cache_dir=root)
    np.testing.assert_array_equal(run_gemv(be.load(GEMV)), 32)
    be.load(Kernel("gemv2", GEMV.source.replace("gemv_warp", "gemv2"), GEMV.params, GEMV.block))
    assert be.cache.degraded and be.cache.compiles == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not writable" in warnings[0]
    assert not any(root.rglob("*.so"))


@needs_gxx
def test_read_only_root_still_serves_its_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    HostBackend(cache_dir=seeded(tmp_path)).load(GEMV)
    ro = tmp_path / "ro"
    shutil.copytree(tmp_path / "host", ro / "host")
    _readonly(monkeypatch, ro, errno.EROFS)
    caplog.set_level(logging.WARNING, logger="qir.runtime")
    caplog.clear()  # the compile above logged
    be = HostBackend(cache_dir=ro)
    np.testing.assert_array_equal(run_gemv(be.load(GEMV)), 32)
    assert be.cache.compiles == 0 and not be.cache.degraded and not caplog.records


# -- locking -----------------------------------------------------------------------------------

CHILD = """
import logging, sys, time
sys.path.insert(0, {tests!r})
logging.basicConfig(level=logging.INFO, format="%(message)s")
import numpy as np
from test_host import GEMV
from qir.runtime.host import HostBackend
time.sleep(max(0.0, {start} - time.time()))  # all four reach the cache together
be = HostBackend()
y = np.zeros(8, np.float32)
be.launch(be.load(GEMV), (1, 1, 1), [np.ones((8, 32), np.float32), np.ones(32, np.float32), y, 8, 32])
print(y.sum())
"""


@needs_gxx
def test_four_processes_compile_once(tmp_path: Path) -> None:
    script = CHILD.format(tests=str(Path(__file__).parent), start=time.time() + 3.0)
    env = {**os.environ, "QIR_CACHE_DIR": str(seeded(tmp_path)), "QIR_LOG": "debug"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err.decode() for _, err in outs]
    assert [float(out) for out, _ in outs] == [256.0] * 4
    logs = b"".join(err for _, err in outs).decode()
    assert logs.count("compiling gemv_warp") == 1, logs
    assert "Traceback" not in logs


@needs_gxx
def test_lock_of_a_killed_process_is_not_stale(tmp_path: Path) -> None:
    """flock dies with its holder: a compile killed mid-way blocks nobody."""
    lock = lock_path(tmp_path)
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
    holder.kill()
    holder.wait()
    be = HostBackend(cache_dir=seeded(tmp_path))
    be.cache.lock_timeout = 60
    t0 = time.monotonic()
    np.testing.assert_array_equal(run_gemv(be.load(GEMV)), 32)
    assert time.monotonic() - t0 < 30 and be.cache.compiles == 1


@needs_gxx
def test_lock_held_past_the_timeout_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    be = HostBackend(cache_dir=seeded(tmp_path))
    be.cache.lock_timeout = 0.2
    lock = lock_path(tmp_path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a second open file description: conflicts with ours
    try:
        caplog.set_level(logging.WARNING, logger="qir.runtime")
        np.testing.assert_array_equal(run_gemv(be.load(GEMV)), 32)
    finally:
        os.close(fd)
    assert any("compiling anyway" in r.getMessage() for r in caplog.records)


# -- NVRTC, compile-only -----------------------------------------------------------------------


@needs_nvrtc
def test_nvrtc_cubins_are_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = KernelCache(tmp_path)
    first = nvrtc_mod.compile_cubin(HALF_SUM, "sm_80", store)
    assert store.compiles == 1
    assert nvrtc_mod.compile_cubin(HALF_SUM, "sm_80", store) is first
    store.forget()
    again = nvrtc_mod.compile_cubin(HALF_SUM, "sm_80", store)
    assert store.compiles == 1 and again == first  # cubin, registers, spills and log
    nvrtc_mod.compile_cubin(HALF_SUM, "sm_90", store)
    assert store.compiles == 2  # arch
    store.forget()
    monkeypatch.setattr(nvrtc_mod, "nvrtc_version", lambda: "99.9.0 imaginary")
    nvrtc_mod.compile_cubin(HALF_SUM, "sm_90", store)
    assert store.compiles == 3  # compiler version


@needs_nvrtc
def test_nvrtc_damaged_entry_is_rewritten(tmp_path: Path) -> None:
    store = KernelCache(tmp_path)
    good = nvrtc_mod.compile_cubin(HALF_SUM, "sm_80", store)
    (path,) = (tmp_path / "cubin").glob("half_sum8-*.sm_80.cubin")
    path.write_bytes(path.read_bytes()[:-10])
    store.forget()
    again = nvrtc_mod.compile_cubin(HALF_SUM, "sm_80", store)
    assert (again.cubin, again.registers) == (good.cubin, good.registers)
    assert store.compiles == 2 and read_entry(path) is not None


def test_info_and_clear(tmp_path: Path) -> None:
    store = KernelCache(tmp_path)
    store.fetch("host", "k", "0" * 64, ".so", lambda: b"payload", what="test")
    (tmp_path / "unrelated.txt").write_text("not ours")
    (tmp_path / "host-pch" / "abc").mkdir(parents=True)
    (tmp_path / "host-pch" / "abc" / "qir_host.h").write_text("// header")
    (tmp_path / "host-pch" / "abc" / "qir_host.h.gch").write_bytes(b"pch")
    (ns_host, ns_cubin, ns_pch) = cache_mod.info(tmp_path)
    assert (ns_host.name, ns_host.entries) == ("host", 1) and ns_host.bytes > len(b"payload")
    assert (ns_cubin.name, ns_cubin.entries, ns_cubin.bytes) == ("cubin", 0, 0)
    assert (ns_pch.name, ns_pch.entries, ns_pch.bytes) == ("host-pch", 1, 12)
    assert cache_mod.clear(tmp_path) == 2
    assert [ns.entries for ns in cache_mod.info(tmp_path)] == [0, 0, 0]
    assert (tmp_path / "unrelated.txt").exists()  # the root may be shared: only our namespaces go


def test_default_root_is_outside_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QIR_CACHE_DIR", "/somewhere/qir")
    assert cache_mod.default_root() == Path("/somewhere/qir")
    monkeypatch.delenv("QIR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_mod.default_root() == Path("/xdg/qir")


# -- parallel compiles -------------------------------------------------------------------------


def gemv_named(name: str) -> Kernel:
    return Kernel(name, GEMV.source.replace("gemv_warp", name), GEMV.params, GEMV.block)


def test_distinct_specs_load_at_once_and_one_spec_loads_once(tmp_path: Path) -> None:
    store = KernelCache(tmp_path)
    # Both loads must be inside load() together to pass the barrier: one lock for every spec
    # would keep the second out, and the barrier would time out.
    barrier = threading.Barrier(2, timeout=20)
    calls: Counter[str] = Counter()

    def load(spec: str) -> object:
        calls[spec] += 1
        barrier.wait()
        time.sleep(0.05)  # the other threads asking for this spec arrive meanwhile
        return object()

    specs = ["a", "b"] * 4
    with ThreadPoolExecutor(len(specs)) as pool:
        got = list(pool.map(lambda s: store.loaded(s, partial(load, s)), specs))
    assert calls == {"a": 1, "b": 1}
    assert all(g is got[0] for g in got[0::2]) and all(g is got[1] for g in got[1::2])


def test_after_a_failed_load_retries_still_load_one_at_a_time(tmp_path: Path) -> None:
    store = KernelCache(tmp_path)
    guard = threading.Lock()
    running, most, calls = 0, 0, 0

    def load() -> object:
        nonlocal running, most, calls
        with guard:
            running += 1
            calls += 1
            first, most = calls == 1, max(most, running)
        time.sleep(0.1)  # every other thread asks meanwhile
        with guard:
            running -= 1
        if first:
            raise RuntimeError("the first load fails")
        return object()

    def ask(_: int) -> object:
        try:
            return store.loaded("spec", load)
        except RuntimeError:
            return None

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    assert most == 1 and calls == 2
    assert got.count(None) == 1
    assert len({id(g) for g in got if g is not None}) == 1


@needs_gxx
def test_a_blocks_kernels_compile_on_threads_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("QIR_COMPILE_JOBS", "3")
    caplog.set_level(logging.INFO, logger="qir.runtime")
    be = HostBackend(cache_dir=seeded(tmp_path))
    threads: set[str] = set()
    compile_one = be._compile

    def spy(kernel: Kernel, source: str) -> bytes:
        threads.add(threading.current_thread().name)
        return compile_one(kernel, source)

    monkeypatch.setattr(be, "_compile", spy)
    a, b, c = (gemv_named(f"gemv_par{i}") for i in range(3))
    loaded = load_kernels(be, [a, b, a, c, b])
    assert be.cache.compiles == 3
    assert [k.kernel for k in loaded] == [a, b, a, c, b]
    assert loaded[0] is loaded[2] and loaded[1] is loaded[4]
    assert threads and all(t.startswith("qir-compile") for t in threads)
    for k in loaded:
        np.testing.assert_array_equal(run_gemv(k), 32)
    summary = [r.getMessage() for r in caplog.records if "kernels compiled in" in r.getMessage()]
    assert len(summary) == 1 and summary[0].startswith("3 of 3 kernels compiled in")
    assert summary[0].endswith("(3 threads)")
    caplog.clear()
    load_kernels(be, [a, b, c])  # all loaded: no compile, no summary
    assert be.cache.compiles == 3 and not caplog.records
    # From disk: the compile threads read and check each entry, and loading takes what they
    # read instead of reading it again.
    be.cache.forget()
    reads: list[Path] = []
    read = cache_mod.read_entry
    monkeypatch.setattr(cache_mod, "read_entry", lambda path: reads.append(path) or read(path))
    again = load_kernels(be, [a, b, c])
    assert be.cache.compiles == 3 and len(reads) == 3 and len(set(reads)) == 3
    for k in again:
        np.testing.assert_array_equal(run_gemv(k), 32)


@needs_gxx
def test_a_compile_error_on_a_compile_thread_reaches_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIR_COMPILE_JOBS", "2")
    broken = Kernel(
        "broken_par", 'extern "C" __global__ void broken_par() { int x = ; }', (), (1, 1, 1)
    )
    be = HostBackend(cache_dir=seeded(tmp_path))

    def load(kernel: Kernel) -> None:  # the error must come from the compile threads
        raise AssertionError(f"{kernel.name} reached load")

    monkeypatch.setattr(be, "load", load)
    with pytest.raises(CompileError, match="broken_par") as e:
        load_kernels(be, [gemv_named("gemv_ok"), broken])
    assert "int x = ;" in str(e.value)  # the offending source line comes along


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", "\u00b2", "\u0663"])
def test_compile_jobs_must_be_a_positive_integer(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("QIR_COMPILE_JOBS", value)
    with pytest.raises(
        UsageError, match=f"QIR_COMPILE_JOBS must be a positive integer, got '{value}'"
    ):
        compile_jobs()


def test_compile_jobs_defaults_to_the_usable_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QIR_COMPILE_JOBS", raising=False)
    assert compile_jobs() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("QIR_COMPILE_JOBS", "5")
    assert compile_jobs() == 5
