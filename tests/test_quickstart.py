"""docs/quickstart.md, run: every `qir` command of its sh blocks on a real checkpoint, its
Python block, and its install lines against the extras pyproject.toml defines."""

from __future__ import annotations

import io
import re
import shlex
import tomllib
from pathlib import Path

import numpy as np
import pytest

from qir.cli import main
from tests.conftest import DATA

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "quickstart.md"
CKPT = DATA / "mlx_affine4_g64_S"  # SentencePiece-style tokenizer, a chat template


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), re.S)


def commands() -> list[str]:
    return [
        line.split("  #")[0].strip()
        for block in blocks("sh")
        for line in block.splitlines()
        if line.strip()
    ]


def test_install_lines_name_real_extras() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    installs = [c for c in commands() if c.startswith("pip install")]
    assert installs
    for line in installs:
        extra = re.fullmatch(r"pip install 'qir\[(\w+)\]'", line)
        assert extra and extra.group(1) in extras, line


@pytest.mark.parametrize("command", [c for c in commands() if c.startswith("qir ")])
def test_every_command_runs(command, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\n/exit\n"))
    argv = shlex.split(command.replace("$CKPT", shlex.quote(str(CKPT))))[1:]
    assert main(["-q", *argv]) == 0, command
    out = capsys.readouterr().out
    if argv[0] in ("generate", "chat", "inspect", "compile"):
        assert out.strip(), command
    if "--out" in argv:
        assert (tmp_path / argv[argv.index("--out") + 1]).exists(), command
    if argv[0] == "generate" and "--tokens" in argv:
        assert len(out.split()[:8]) == 8 and np.load(tmp_path / "G.npz")["logits"].shape[0] == 8


def test_the_python_block_runs(tmp_path, monkeypatch, capsys) -> None:
    (code,) = blocks("python")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(PAGE), "exec"), {"CKPT": str(CKPT)})
    out = capsys.readouterr().out.splitlines()
    assert len(out) >= 4 and out[-2].startswith("prompt ") and "(4, 256)" in out[-1]
