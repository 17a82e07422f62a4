"""What a user sees when something goes wrong: compile errors with the kernel's name, the
compiler's message and numbered source lines; one line when the cuda backend cannot run; and the
`qir cache` subcommand."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from qir.cli import main
from qir.codegen.kernel import Kernel
from qir.models.goldens import embedded_checkpoints
from qir.runtime import host as host_mod
from qir.runtime import nvrtc as nvrtc_mod
from qir.runtime.cache import KernelCache, codegen_hash
from qir.runtime.errors import CompileError
from qir.runtime.host import HostBackend
from qir.runtime.nvrtc import compile_cubin
from qir.runtime.toolkit import toolkit_fingerprint
from tests.requires import requires
from tests.runtime.test_cache import seeded

BAD_LINE = "  y[i] = undeclared_thing * 2.0f;"
SOURCE = "\n".join(
    [
        "#include <cuda_fp16.h>",
        '#include "helpers.h"',
        'extern "C" __global__ void typo_kernel(float* y) {',
        "  int i = threadIdx.x;",
        BAD_LINE,
        "}",
    ]
)
# A header that compiles: only the kernel's own lines may show in the excerpt.
TYPO = Kernel("typo_kernel", SOURCE, (), (32, 1, 1), (("helpers.h", "#pragma once\n"),))


def _check(e: CompileError, compiler: str, position: str) -> None:
    text = str(e)
    assert e.kernel == "typo_kernel" and e.compiler == compiler
    assert text.startswith(f"{compiler} failed to compile kernel typo_kernel:")
    assert re.search(position, text)  # the compiler's message, with its position
    assert "undeclared_thing" in e.message
    excerpt = text.split("generated source:\n", 1)[1].splitlines()
    # Two lines of context either side of line 5, numbered (g++ also sees the host trampoline
    # appended after line 6).
    numbered = [f"  {n:5d} | {line}" for n, line in enumerate(SOURCE.splitlines(), 1)]
    assert excerpt[:4] == numbered[2:6]
    assert len(excerpt) <= 5


@requires("gxx")
def test_gxx_error_shows_kernel_message_and_numbered_lines(tmp_path: Path) -> None:
    with pytest.raises(CompileError) as info:
        HostBackend(cache_dir=seeded(tmp_path)).load(TYPO)
    _check(info.value, "g++", r"typo_kernel\.cu:5:\d+: error")


@requires("nvrtc")
def test_nvrtc_error_shows_kernel_message_and_numbered_lines(tmp_path: Path) -> None:
    with pytest.raises(CompileError) as info:
        compile_cubin(TYPO, "sm_90", KernelCache(tmp_path))
    _check(info.value, "nvrtc", r"typo_kernel\.cu\(5\): error")


def test_failed_compile_leaves_no_entry(tmp_path: Path) -> None:
    store = KernelCache(tmp_path)

    def fail() -> bytes:
        raise CompileError("k", "g++", "k.cu:1:1: error: nope", "int x")

    with pytest.raises(CompileError):
        store.fetch("host", "k", "0" * 64, ".so", fail, what="test")
    assert [p.name for p in (tmp_path / "host").iterdir()] == ["k-" + "0" * 32 + ".so.lock"]


@requires("no_gpu")
def test_cuda_backend_without_gpu_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 256), np.float16))
    ck = str(embedded_checkpoints()[0])
    argv = ["-q", "run", ck, "--block", "mlp", "--input", str(x), "--out", str(tmp_path / "o")]
    assert main([*argv, "--backend", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qir: error: ")
    assert "--backend host" in err[0]


def test_cache_info_and_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QIR_CACHE_DIR", str(tmp_path))
    KernelCache(tmp_path).fetch("cubin", "k", "1" * 64, ".cubin", lambda: b"x" * 100, what="t")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out
    assert re.search(r"cubin\s+1 entries", out) and re.search(r"host\s+0 entries", out)
    # What the keys depend on, to compare a build machine's cache with a server's.
    facts = dict(re.findall(r"^  (codegen|headers|g\+\+|nvrtc) +(.+)$", out, flags=re.M))
    assert facts["codegen"] == codegen_hash()[:16]
    assert facts["headers"].startswith(toolkit_fingerprint()[:16])
    assert facts["g++"] == host_mod.compiler_version().splitlines()[0]
    assert facts["nvrtc"] == (
        nvrtc_mod.nvrtc_version() if nvrtc_mod.available() else "no cuda-core 1.x (qir[compile])"
    )
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert not (tmp_path / "cubin").exists()


def test_host_backend_without_cuda_headers_says_what_to_install(monkeypatch) -> None:
    from qir.runtime.errors import BackendUnavailable

    monkeypatch.setattr(host_mod, "cuda_include_dirs", lambda: ())
    with pytest.raises(BackendUnavailable, match=r"cuda_fp16.h.*qir\[host\]"):
        host_mod.HostBackend()
