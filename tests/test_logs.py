"""Compile lines reach the user of the Python API, not only the CLI's: a cold compile takes
seconds, and a silent pause that long looks like a hang (see qir.logs). Each case runs in a
fresh interpreter, because where the lines go is decided when qir is imported."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import DATA
from tests.runtime.test_cache import seeded
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
    environ |= {"QIR_CACHE_DIR": str(seeded(tmp_path / "cache")), **env}
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
def test_api_users_see_one_line_per_compile_batch_by_default(tmp_path: Path) -> None:
    p = run(tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ran (3, 24)"
    (line,) = compile_lines(p.stderr)
    assert line.startswith("qir: 1 of 1 kernels compiled in ") and line.endswith("(1 thread)")


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
    assert sum("kernels compiled in" in line for line in lines) == 1


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


# A batch's progress on a terminal: stderr replaced by a TTY stand-in before qir is imported.
TTY = """
import io, logging, sys
class Tty(io.StringIO):
    def isatty(self):
        return True
sys.stderr = err = Tty()
from qir.logs import Progress
p = Progress(logging.getLogger("qir.runtime"), "compiling kernels", 4)
p.step(show=False)  # a cache hit before anything compiled: no bar yet
p.step()
p.step()
p.step()
p.finish("3 of 4 kernels compiled in 1.00 s (2 threads)")
sys.__stdout__.write(repr(err.getvalue()))
"""


def test_progress_is_a_bar_redrawn_in_place_then_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "QIR_LOG"}
    p = subprocess.run(
        [sys.executable, "-c", TTY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    out: str = eval(p.stdout)  # the repr of what reached the terminal
    frames = out.split("\r")
    bars = [f for f in frames if f.startswith("qir: compiling kernels [")]
    assert [b.split("] ")[1].split()[0] for b in bars] == ["2/4", "3/4", "4/4"]
    assert "[############............]" in bars[0] and "[########################]" in bars[2]
    # the bar is blanked, then the summary is the only line that stays
    assert frames[-1] == "qir: 3 of 4 kernels compiled in 1.00 s (2 threads)\n"
    assert frames[-2].strip() == "" and out.count("\n") == 1


@needs_gxx
def test_cli_run_prints_one_line_per_batch_and_v_adds_a_line_per_kernel(tmp_path: Path) -> None:
    ckpt = DATA / "mlx_affine4_g64_S"
    np.save(tmp_path / "x.npy", np.ones((2, 256), np.float16))
    env = {k: v for k, v in os.environ.items() if k != "QIR_LOG"}

    def run_cli(*flags: str, block: str, runtime: bool = True) -> list[str]:
        args = ["run", str(ckpt), "--block", block, "--input", str(tmp_path / "x.npy")]
        args += ["--out", str(tmp_path / "y.npz"), "--backend", "host"]
        # cold: every kernel compiles (the precompiled header, and the runtime library unless
        # `runtime` is False, are seeded: neither is a kernel)
        env["QIR_CACHE_DIR"] = str(seeded(tmp_path / f"cache-{block}", runtime=runtime))
        p = subprocess.run(
            [sys.executable, "-m", "qir.cli", *flags, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
        return p.stderr.strip().splitlines()

    (line,) = run_cli(block="mlp")  # two kernels, one line
    assert line.startswith("qir: 2 of 2 kernels compiled in ")
    verbose = run_cli("-v", block="qkv", runtime=False)
    # The host's runtime library (built once per cache, with the first kernel) is no kernel: it
    # says "building", and the count leaves it out.
    runtime = [ln.split()[1] for ln in verbose if "qir_host_runtime" in ln]
    kernels = [ln.split()[1] for ln in verbose if "qir_host_runtime" not in ln]
    assert kernels == ["compiling", "compiled", "1"] and runtime == ["building", "built"], verbose
