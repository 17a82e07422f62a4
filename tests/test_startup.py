"""`import qir` and `qir --help` start at once: checked by what they import (not by time, which
benchmarks/startup.py measures), in a fresh interpreter each."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import qir
from qir import cli

ROOT = Path(__file__).resolve().parent.parent
# What `import qir` and `qir --help` may load of qir: the package, its logging and errors, the
# command dispatcher. Everything else (the IR, compiler, runtimes, models, serving) waits for use.
LIGHT = {"qir", "qir.cli", "qir.errors", "qir.logs"}
# Third-party modules that cost the most to import (ml_dtypes 0.7 alone takes about a second).
HEAVY = (
    "numpy",
    "ml_dtypes",
    "jinja2",
    "networkx",
    "cupy",
    "safetensors",
    "tokenizers",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "llguidance",
    "mpi4py",
)

SHOW_MODULES = "import json, sys; print(json.dumps(sorted(sys.modules)), file=sys.stderr)"


def modules_after(code: str, *argv: str) -> tuple[set[str], str]:
    """The modules loaded once `code` ran in a fresh interpreter in the repository root, and its
    standard output."""
    run = subprocess.run(
        [sys.executable, "-c", f"{code}\n{SHOW_MODULES}", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    loaded = json.loads(run.stderr.strip().splitlines()[-1])
    return set(loaded), run.stdout


def assert_light(loaded: set[str]) -> None:
    ours = {m for m in loaded if m == "qir" or m.startswith("qir.")}
    assert ours <= LIGHT, f"loaded beyond {sorted(LIGHT)}: {sorted(ours - LIGHT)}"
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"heavy modules loaded: {heavy}"


def test_import_qir_loads_nothing_heavy() -> None:
    loaded, _ = modules_after("import qir")
    assert "qir" in loaded
    assert_light(loaded)


# the console script's own code (pyproject's [project.scripts]: qir.cli:main), exit caught
CONSOLE = "import sys\nfrom qir.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass"


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_qir_help_and_version_load_nothing_heavy(flag: str) -> None:
    loaded, out = modules_after(CONSOLE, flag)
    assert_light(loaded)
    assert out.startswith("usage: qir" if flag == "--help" else "qir ")


def test_a_command_loads_its_group_only_when_it_runs() -> None:
    """The check above can fail: running a command imports its group and what it needs."""
    loaded, out = modules_after(CONSOLE, "inspect", "--help")
    assert "usage: qir inspect" in out
    assert "qir.cli.checkpoints" in loaded and "numpy" in loaded
    assert "qir.cli.serve" not in loaded


def test_the_lazy_listing_is_the_one_the_groups_register() -> None:
    """`qir --help` lists COMMANDS without importing the groups; each group's own help lines,
    registered in full, read the same (and no group registers a command COMMANDS lacks)."""
    assert cli.parser(None).format_help() == cli.parser().format_help()
    for command in cli.COMMANDS:
        assert cli.parser(command).format_help() == cli.parser().format_help()


def test_version_is_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"qir {metadata.version('qir')}\n"


def test_the_public_names_resolve_on_use() -> None:
    for name in qir.__all__:
        assert getattr(qir, name) is not None and name in dir(qir)
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        _ = qir.nonesuch  # type: ignore[attr-defined]


def test_the_interpret_function_is_not_hidden_by_its_submodule() -> None:
    """`qir.interpret` names the function even where the submodule qir.interpret was imported
    before anyone asked the package for it."""
    _, out = modules_after(
        "import qir.interpret\nfrom qir import interpret\nprint(callable(interpret), type(interpret).__name__)"
    )
    assert out.split() == ["True", "function"]
