"""`qir cache warm`: kernels compiled ahead of time, on a machine without a GPU, are the entries a
later process loads without compiling anything."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from qir.cli import main
from qir.codegen.lower import lower
from qir.errors import UsageError
from qir.models import load as load_checkpoint
from qir.models.blocks import build
from qir.passes.manager import run_pipeline
from qir.runtime.cache import KernelCache
from qir.runtime.cuda import CudaBackend
from qir.runtime.loading import load_kernels
from qir.runtime.nvrtc import check_arch
from tests.requires import requires
from tests.runtime.test_cache import seeded
from tests.runtime.test_cuda import fake_cupy
from tests.runtime.test_executor import needs_gxx

ROOT = Path(__file__).parent.parent.parent
CKPT = ROOT / "tests" / "data" / "ct_nvfp4_w4a4_S"  # W4A4: quantize_act kernels and 16-bit twins

needs_nvrtc = requires("nvrtc")

# A fresh process: q/k/v on the host backend, and the cubins a CudaBackend on an sm_90 GPU would
# load for them (it asks compile_cubin for its target's arch).
LATER = """
import json, sys
import qir
from qir.models import load
from qir.models.blocks import build
from qir.runtime.cache import KernelCache
from qir.runtime.nvrtc import compile_cubin

ck = load(sys.argv[1])
cache = KernelCache.at()
for name in ("qkv",):
    block = build(ck, name, 0)
    c = qir.compile(block.graph, block.weights, backend="host")
    for launch in c.plan.launches:
        compile_cubin(launch.kernel, "sm_90", cache)
print(json.dumps({"compiles": cache.compiles}))
"""


@needs_gxx
@needs_nvrtc
def test_a_warmed_cache_serves_a_later_process_without_compiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIR_CACHE_DIR", str(seeded(tmp_path)))
    argv = ["-q", "cache", "warm", str(CKPT), "--arch", "sm_90", "--host", "--blocks", "qkv"]
    assert main(argv) == 0
    out = [line.rsplit(" (", 1)[0] for line in capsys.readouterr().out.splitlines()]
    # quantize_act of x; the merged projection as a W4A4 GEMV, a W4A4 GEMM and a 16-bit GEMM
    # for M > 64.
    assert out[:2] == [
        "sm_90: 4 kernels, 4 compiled, 0 already cached",
        "host: 4 kernels, 4 compiled, 0 already cached",
    ]
    later = subprocess.run(
        [sys.executable, "-c", LATER, str(CKPT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert later.returncode == 0, later.stderr
    assert json.loads(later.stdout) == {"compiles": 0}
    assert "compiling" not in later.stderr
    # Warming again finds everything.
    assert main(["-q", "cache", "warm", str(CKPT), "--arch", "sm_90", "--blocks", "qkv"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("sm_90: 4 kernels, 0 compiled, 4 already cached")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_90a", "sm_100f", "sm_120"])
def test_arch_names_nvrtc_takes(arch: str) -> None:
    assert check_arch(arch) == arch


@needs_nvrtc
@pytest.mark.parametrize(
    "arch", ["sm_12", "sm90", "compute_90", "sm_90x", "90", "sm_80a", "sm_90f", "sm_75f"]
)
def test_an_arch_nvrtc_cannot_target_lists_those_it_can(arch: str) -> None:
    with pytest.raises(UsageError, match=rf"arch '{arch}': NVRTC \S+.* compiles for sm_75, "):
        check_arch(arch)


@needs_nvrtc
def test_a_bad_target_fails_before_anything_compiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIR_CACHE_DIR", str(tmp_path))
    assert main(["-q", "cache", "warm", str(CKPT), "--arch", "sm_90", "sm_12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qir: error: arch 'sm_12'")
    assert not (tmp_path / "cubin").exists()


def test_without_a_gpu_the_targets_must_be_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import qir.cli.cache

    monkeypatch.setattr(qir.cli.cache, "cuda_available", lambda: False)
    assert main(["-q", "cache", "warm", str(CKPT)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qir: error: cache warm: no GPU here") and "--arch sm_90" in err


def test_a_layer_out_of_range_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-q", "cache", "warm", str(CKPT), "--host", "--layers", "0", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qir: error: layer 3 is out of range: the checkpoint has 1 layer(s)"


@needs_nvrtc
def test_an_unwritable_cache_fails_the_warm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels kept in a temporary directory would vanish at exit: an image build must fail."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("QIR_CACHE_DIR", str(blocker / "cache"))
    assert main(["-q", "cache", "warm", str(CKPT), "--arch", "sm_90", "--blocks", "qkv"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qir: error: cache warm: cannot write to the cache directory {blocker}")
    assert "QIR_CACHE_DIR" in err


@needs_nvrtc
def test_a_cuda_backend_loads_warmed_cubins_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend names its arch after the device (compute capability "90": sm_90) and finds
    the cubins `cache warm --arch sm_90` wrote (CuPy faked: the driver only gets the bytes)."""
    monkeypatch.setenv("QIR_CACHE_DIR", str(tmp_path))
    assert main(["-q", "cache", "warm", str(CKPT), "--arch", "sm_90", "--blocks", "mlp"]) == 0
    KernelCache.at(tmp_path).forget()  # what a new process would have: the disk only
    loaded: list[bytes] = []

    class Module:
        def load(self, cubin: bytes) -> None:
            loaded.append(cubin)

        def get_function(self, name: str) -> str:
            return name

    monkeypatch.setitem(
        sys.modules, "cupy", fake_cupy(function=types.SimpleNamespace(Module=Module))
    )
    be = CudaBackend(cache_dir=tmp_path)
    assert be.arch == "sm_90"
    graph, _ = run_pipeline(build(load_checkpoint(CKPT), "mlp", 0).graph, "default")
    kernels = [launch.kernel for launch in lower(graph).launches]
    before = be.cache.compiles
    assert [k.function for k in load_kernels(be, kernels)] == [k.name for k in kernels]
    assert be.cache.compiles == before and len(loaded) == len(set(kernels))
