"""No silent skips in CI (tests/skip_policy.py): with QIR_CI=1 a skip of kind "here" fails the
run, in a test, a test module or a branch of a test (requires.have); skips only the GPU machine
or a system tool can avoid stay skips; every run counts its skips by kind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = """
from tests.requires import NEEDS, Need

pytest_plugins = ("tests.skip_policy",)
NEEDS["absent_here"] = Need("here", "something CI has", lambda: False)
NEEDS["absent_gpu"] = Need("gpu", "a CUDA GPU", lambda: False)
"""
TESTS = """
import pytest

from tests.requires import have, requires


@requires("absent_here")
def test_marked_here():
    pass


@requires("absent_gpu")
def test_marked_gpu():
    pass


def test_skips_itself():
    pytest.skip("no reason given")


def test_branch():
    if have("absent_here"):
        pass


@requires("gxx")
def test_runs():
    assert True
"""
MODULE = """
from tests.requires import import_or_skip

import_or_skip("no_such_module", "absent_here")


def test_never_collected():
    pass
"""


def run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a.py").write_text(TESTS)
    (tmp_path / "test_b.py").write_text(MODULE)
    env = {k: v for k, v in os.environ.items() if k != "QIR_CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci:
        env["QIR_CI"] = "1"
    argv = [sys.executable, "-m", "pytest", "-rfEs", "-p", "no:cacheprovider", "-p", "no:xdist"]
    argv.append("--continue-on-collection-errors")
    return subprocess.run(
        [*argv, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_without_qir_ci_skips_are_counted_by_kind(tmp_path: Path) -> None:
    p = run(tmp_path, ci=False)
    assert p.returncode == 0, p.stdout
    assert "skips by kind: 1 need the GPU machine, 3 other (QIR_CI unset)" in p.stdout
    assert "SKIPPED [1] test_b.py: needs something CI has" in p.stdout  # the module, by name
    assert "2 passed, 4 skipped" in p.stdout  # have() is False: the branch is not taken


def test_under_qir_ci_a_skip_this_machine_should_not_take_fails(tmp_path: Path) -> None:
    p = run(tmp_path, ci=True)
    assert p.returncode == 1, p.stdout
    out = p.stdout
    assert "skips by kind: 1 need the GPU machine (QIR_CI=1: any other skip fails)" in out
    # a mark skips at setup, so its failure is an error there
    assert "ERROR test_a.py::test_marked_here" in out and "ERROR test_b.py" in out
    assert "FAILED test_a.py::test_skips_itself" in out and "FAILED test_a.py::test_branch" in out
    assert "skipped, but CI's machine must run it: needs something CI has" in out
    assert "QIR_CI=1: CI's machine must meet this test's need: needs something CI has" in out
    assert "2 failed, 1 passed, 1 skipped, 2 errors" in out
