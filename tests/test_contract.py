"""What a user can reach fails as a QirError: one line on stderr and exit code 2 from the CLI,
never a traceback; and the package's metadata claims only what is tested."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

import qir.cli.tokenize
from qir.cli import main
from qir.codegen.layer_kernels import HEAD_DIMS
from qir.errors import QirError, Unsupported
from qir.graph import CycleError, Graph
from qir.runtime.nvrtc import SpillError
from tests.models.synthetic_llama import write_llama

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qir: error: "), err
    return err[0].removeprefix("qir: error: ")


@pytest.fixture(scope="module")
def head_dim_80(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose heads the attention kernels do not take (the reference runs it)."""
    assert 80 not in HEAD_DIMS
    return write_llama(tmp_path_factory.mktemp("hd80"), head_dim=80)


@pytest.mark.parametrize("block", ["layer", "model"])
def test_compile_refuses_an_unsupported_head_dim_in_one_line(
    head_dim_80: Path, block: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["-q", "compile", str(head_dim_80), "--block", block]) == 2
    assert one_line_error(capsys) == (
        "head_dim 80 has no attention kernel: they take head_dim 32, 64, 96, 128 or 256 "
        "(--backend reference runs any)"
    )


def test_the_host_backend_refuses_it_and_the_reference_runs_it(
    head_dim_80: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["-q", "run", str(head_dim_80), "--block", "model", "--tokens", "1,2,3"]
    assert main([*args, "--out", str(tmp_path / "h.npz"), "--backend", "host"]) == 2
    assert one_line_error(capsys).startswith("head_dim 80 has no attention kernel")
    assert main([*args, "--out", str(tmp_path / "r.npz"), "--backend", "reference"]) == 0
    assert np.load(tmp_path / "r.npz")["logits"].shape == (3, 96)


def test_an_empty_npy_is_a_usage_error(
    head_dim_80: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """numpy raises EOFError (neither OSError nor ValueError) for an empty file."""
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    out = str(tmp_path / "o.npz")
    run = ["-q", "run", str(head_dim_80), "--backend", "reference", "--out", out]
    assert main([*run, "--block", "mlp", "--input", str(empty)]) == 2
    assert (
        one_line_error(capsys)
        == f"--input {empty}: cannot read a .npy array (No data left in file)"
    )
    assert main([*run, "--block", "model", "--tokens", str(empty)]) == 2
    assert one_line_error(capsys).startswith(f"--tokens {empty}: cannot read a .npy array")


def cycle() -> CycleError:
    from qir.builder import Builder
    from qir.dtypes import F32

    b = Builder("loop")
    x = b.input("x", ("M", 4), F32)
    y = b.add(x, x)
    z = b.add(y, y)
    b.output("z", z)
    g: Graph = b.graph
    g.set_operands(y.name, (z.name, z.name))  # y <- z <- y
    with pytest.raises(CycleError) as info:
        g.order()
    return info.value


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(lambda: cycle(), id="CycleError"),
        pytest.param(
            lambda: SpillError("gemv", "sm_90", 24, "ptxas info: 24 bytes spill"), id="SpillError"
        ),
        pytest.param(lambda: Unsupported("no kernel for %y = op"), id="Unsupported"),
    ],
)
def test_compiler_errors_are_qir_errors_the_cli_reports_in_a_line(
    error, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    e = error()
    assert isinstance(e, QirError)

    def fails(_: object) -> int:
        raise e

    monkeypatch.setattr(qir.cli.tokenize, "cmd_tokenize", fails)
    assert main(["tokenize", ".", "--text", "hi"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first == f"qir: error: {str(e).splitlines()[0]}"


def test_unsupported_is_still_a_not_implemented_error() -> None:
    """Callers that catch NotImplementedError (Compiled's drawing of a reference block) still do."""
    assert issubclass(Unsupported, NotImplementedError)


def test_the_python_claimed_is_the_one_tested() -> None:
    """CI runs python3.11 (the tests import tomllib, new in 3.11): pyproject claims 3.11 onward,
    and mypy and ruff check the same version."""
    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.11"
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    assert PYPROJECT["tool"]["mypy"]["python_version"] == "3.11"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"


def test_license_metadata() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()


NVIDIA = re.compile(r"^(nvidia-[a-z-]+|cuda-bindings)(.*)$")


def test_nvidia_wheels_are_compatible_release_within_their_minor() -> None:
    """`~=13.0.96` (13.0.96 or a later 13.0 patch) rather than `==13.0.96`, which clashes with
    any other package pinning another 13.0 patch; nvdisasm has no 13.0 wheel (13.5, see
    pyproject)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    pins = {m[1]: m[2] for deps in extras.values() for d in deps if (m := NVIDIA.match(d))}
    assert set(pins) >= {"nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "cuda-bindings"}
    for name, spec in pins.items():
        minor = "13.5" if name == "nvidia-cuda-nvdisasm" else "13.0"
        assert re.fullmatch(rf"~={re.escape(minor)}\.\d+", spec), (name, spec)
