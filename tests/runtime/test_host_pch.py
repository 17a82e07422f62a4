"""The host backend's precompiled qir_host.h: built once per flag set, used by every kernel,
and never the reason a kernel fails to build."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from qir.codegen.kernel import Kernel, KernelParam
from qir.runtime import host as host_mod
from qir.runtime.cache import PCH
from qir.runtime.host import HostBackend
from tests.requires import requires

pytestmark = requires("gxx")


def axpy(name: str) -> Kernel:
    params = (
        KernelParam("x", "const float*", "buffer"),
        KernelParam("y", "float*", "buffer"),
        KernelParam("n", "int", "int"),
    )
    body = "const int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) y[i] += 2.f * x[i];"
    src = f'extern "C" __global__ void {name}(const float* x, float* y, int n) {{\n  {body}\n}}\n'
    return Kernel(name, src, params, (64, 1, 1))


def run(be: HostBackend, kernel: Kernel) -> None:
    x = np.arange(100, dtype=np.float32)
    y = np.ones(100, np.float32)
    be.launch(be.load(kernel), (2, 1, 1), [x, y, 100])
    np.testing.assert_array_equal(y, 1 + 2 * x)


def gch_files(root: Path) -> list[Path]:
    return sorted((root / PCH).glob("*/*.gch"))


def test_kernels_compile_against_one_precompiled_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []
    real_run = host_mod.subprocess.run

    def spy(cmd: list[str], **kw: object):  # type: ignore[no-untyped-def]
        commands.append(list(cmd))
        return real_run(cmd, **kw)

    monkeypatch.setattr(host_mod.subprocess, "run", spy)
    be = HostBackend(cache_dir=tmp_path)
    run(be, axpy("axpy_a"))
    run(be, axpy("axpy_b"))
    (gch,) = gch_files(tmp_path)
    gxx = [c for c in commands if c[0] == host_mod.CXX and "--version" not in c]
    kernel_builds = [c for c in gxx if any(a.endswith(".cu") for a in c)]
    assert len(kernel_builds) == 2 and sum("c++-header" in c for c in gxx) == 1
    for cmd in kernel_builds:
        assert Path(cmd[cmd.index("-include") + 1]) == gch.with_suffix("")
    # A second backend (another process, say) on the same root finds it instead of building it.
    mtime = gch.stat().st_mtime_ns
    run(HostBackend(cache_dir=tmp_path), axpy("axpy_c"))
    assert gch_files(tmp_path) == [gch] and gch.stat().st_mtime_ns == mtime


def test_a_damaged_precompiled_header_is_replaced_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(HostBackend(cache_dir=tmp_path), axpy("axpy_a"))
    (gch,) = gch_files(tmp_path)
    gch.write_bytes(gch.read_bytes()[: 1 << 20])  # g++ refuses a truncated .gch outright
    with caplog.at_level(logging.WARNING, logger="qir.runtime"):
        be = HostBackend(cache_dir=tmp_path)
        run(be, axpy("axpy_b"))
    assert "precompiled header" in caplog.text and "unusable" in caplog.text
    run(be, axpy("axpy_c"))  # the next compile builds a good one again
    (rebuilt,) = gch_files(tmp_path)
    assert rebuilt.stat().st_size > 1 << 20


def test_sanitized_builds_parse_the_header_itself(tmp_path: Path) -> None:
    be = HostBackend(cache_dir=tmp_path, sanitize=True)
    flags = be._flags("axpy_a", tmp_path)
    assert Path(flags[flags.index("-include") + 1]) == host_mod.HEADER
    assert not gch_files(tmp_path)
