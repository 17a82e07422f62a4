"""Compile lines reach the user of the Python API, not only the CLI's: a cold compile takes
seconds, and a silent pause that long looks like a hang (see qir.logs). Each case runs in a
fresh interpreter, because where the lines go is decided when qir is imported."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.test_executor import needs_gxx

ROOT = Path(__file__).parent.parent

# One dense projection (one small kernel) compiled into an empty cache, then run.
SCRIPT = """
import logging, sys
{configure}
import numpy as np
import qir
from qir.dtypes import F16
from qir.formats.dense import Dense
from tests.conftest import random_weight

b = qir.Builder("proj")
qw, w = random_weight(np.random.default_rng(0), 24, 64, Dense(F16))
b.output("y", b.qlinear(b.input("x", ("M", 64), F16), b.weight("w", qw)))
y = qir.compile(b.graph, {{"w": w}}, backend="host")({{"x": np.ones((3, 64), np.float16)}})["y"]
print("ran", y.shape)
"""


def run(tmp_path: Path, configure: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "QIR_LOG"}
    environ |= {"QIR_CACHE_DIR": str(tmp_path / "cache"), **env}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(configure=configure)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def compile_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "compil" in line]


@needs_gxx
def test_api_users_see_compile_lines_by_default(tmp_path: Path) -> None:
    p = run(tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ran (3, 24)"
    lines = compile_lines(p.stderr)
    assert any(line.startswith("qir: compiling qgemv_") for line in lines), p.stderr
    assert any(line.startswith("qir: compiled qgemv_") and " in " in line for line in lines)
    assert any(line.startswith("qir: 1 of 1 kernels compiled in") for line in lines)


@needs_gxx
def test_qir_log_warning_silences_them(tmp_path: Path) -> None:
    p = run(tmp_path, QIR_LOG="warning")
    assert p.returncode == 0 and p.stdout.strip() == "ran (3, 24)", p.stderr
    assert compile_lines(p.stderr) == []


@needs_gxx
def test_an_application_that_configures_logging_gets_them_once_in_its_format(
    tmp_path: Path,
) -> None:
    configure = 'logging.basicConfig(format="app| %(name)s %(message)s", stream=sys.stderr)'
    p = run(tmp_path, configure)
    assert p.returncode == 0, p.stderr
    lines = compile_lines(p.stderr)
    assert lines and all(line.startswith("app| qir.runtime ") for line in lines), p.stderr
    assert sum("compiling qgemv_" in line for line in lines) == 1


@needs_gxx
def test_a_handler_the_application_put_on_qir_gets_them_once(tmp_path: Path) -> None:
    configure = (
        'h = logging.StreamHandler(sys.stderr); h.setFormatter(logging.Formatter("mine| %(message)s"));'
        ' logging.getLogger("qir").addHandler(h)'
    )
    p = run(tmp_path, configure)
    assert p.returncode == 0, p.stderr
    lines = compile_lines(p.stderr)
    assert lines and all(line.startswith("mine| ") for line in lines), p.stderr


def test_a_level_set_before_import_is_kept() -> None:
    code = (
        'import logging; logging.getLogger("qir").setLevel(logging.ERROR); import qir;'
        ' print(logging.getLevelName(logging.getLogger("qir").level))'
    )
    env = {k: v for k, v in os.environ.items() if k != "QIR_LOG"}
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert (p.returncode, p.stdout.strip()) == (0, "ERROR"), p.stderr


def test_cli_quiet_lasts_one_call() -> None:
    from qir.cli import main

    logger = logging.getLogger("qir")
    before = logger.level
    assert main(["-q", "cache", "info"]) == 0
    assert logger.level == before


def test_an_unknown_qir_log_level_is_named() -> None:
    p = subprocess.run(
        [sys.executable, "-c", "import qir"],
        cwd=ROOT,
        env={**os.environ, "QIR_LOG": "loud"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0
    assert p.stderr.strip() == (
        "qir: QIR_LOG=loud is not one of debug, info, warning, error; logging at info"
    )


@pytest.mark.parametrize("level", ["debug", "INFO", "warning", "error"])
def test_qir_log_levels(level: str) -> None:
    code = 'import logging, qir; print(logging.getLevelName(logging.getLogger("qir").level))'
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "QIR_LOG": level},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (p.returncode, p.stdout.strip(), p.stderr) == (0, level.upper(), "")
