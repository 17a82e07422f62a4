"""The project's documentation, checked: the mkdocs site builds with --strict; every shell and
Python block of docs/*.md and the README runs (docs/quickstart.md's by tests/test_quickstart.py,
which also checks what they print); the README is short and starts with its two set-up
commands; nothing cites the developers' notes outside the repository.

A block this test does not run carries a marker on the line before its fence, which it reports:
  <!-- docs-test: run-by tests/a.py [tests/b.py] (why) -->   another test runs it (a server...)
  <!-- docs-test: not-run (why) -->                          nothing runs it (a GPU, minutes)
"""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from qir.cli import main
from tests.conftest import DATA
from tests.requires import requires

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
CKPT = DATA / "mlx_affine4_g64_S"  # SentencePiece-style tokenizer, a chat template
SHELL, PYTHON = ("sh", "bash", "shell"), ("python", "py")
# Blocks that nothing runs: each is a cost (the page may drift), so they stay few.
MOST_NOT_RUN = 3

FENCE = re.compile(
    r"(?:<!-- docs-test: (?P<mark>[^\n]*?) -->\n)?^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```",
    re.S | re.M,
)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    mark: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def lines(self) -> list[str]:
        return [ln.split("  #")[0].strip() for ln in self.body.splitlines() if ln.strip()]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start("lang")) + 1, m["lang"], m["body"], m["mark"])
        for m in FENCE.finditer(text)
    ]


ALL = [b for page in PAGES for b in blocks(page) if b.lang in SHELL + PYTHON]
# docs/quickstart.md is run by tests/test_quickstart.py, which checks its output too.
OURS = [b for b in ALL if b.mark is None and b.page.name != "quickstart.md"]


def test_every_block_is_run_or_says_why() -> None:
    marked = [b for b in ALL if b.mark is not None]
    for b in marked:
        kind, _, rest = b.mark.partition(" ")
        assert kind in ("run-by", "not-run"), f"{b.where}: unknown marker {b.mark!r}"
        assert re.search(r"\(.+\)$", rest), f"{b.where}: a marker says why, in parentheses"
        if kind == "run-by":
            tests = rest.split(" (")[0].split()
            for t in tests:
                assert (ROOT / t).is_file(), f"{b.where}: {t} does not exist"
            assert any(b.page.name in (ROOT / t).read_text() for t in tests), (
                f"{b.where}: none of {tests} reads {b.page.name}"
            )
    not_run = [b for b in marked if b.mark.startswith("not-run")]
    if marked:
        warnings.warn(
            "docs blocks not run by tests/test_docs.py: "
            + "; ".join(f"{b.where} {b.mark}" for b in marked),
            stacklevel=1,
        )
    assert len(not_run) <= MOST_NOT_RUN, [b.where for b in not_run]


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _argv(command: str) -> list[str]:
    argv = shlex.split(command.replace("$CKPT", shlex.quote(str(CKPT))))[1:]
    return [str(ROOT / a) if a.startswith("tests/data/") else a for a in argv]


def _run_shell_line(b: Block, command: str, tmp: Path) -> None:
    word = command.split()[0]
    if word == "qir" and "--tp" in command.split():  # mpiexec reruns the command line
        argv = _argv(command)
        run = subprocess.run(
            [sys.executable, "-m", "qir.cli", "-q", *argv],
            input="Hello!\n/exit\n",
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, f"{b.where}: {command}\n{run.stderr[-2000:]}"
        assert run.stdout.strip(), f"{b.where}: {command}"
    elif word == "qir":
        argv = _argv(command)
        assert main(["-q", *argv]) == 0, f"{b.where}: {command}"
        if "--out" in argv and argv[0] != "dump":
            assert (tmp / argv[argv.index("--out") + 1]).exists(), f"{b.where}: {command}"
    elif word == "pip":
        extra = re.fullmatch(r"pip install '?qir\[(\w+)\]'?", command)
        assert extra and extra[1] in _extras(), f"{b.where}: {command}"
    elif word == "make":
        target = command.split()[1]
        assert target in _make_targets(), f"{b.where}: {command}"
    else:
        raise AssertionError(
            f"{b.where}: `{command}` is not a command this test runs (qir, pip install "
            "'qir[...]', make): run it here, or mark the block"
        )


@requires("gxx")
@pytest.mark.parametrize(
    "page", sorted({b.page for b in OURS}), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_blocks_of_a_page_run_in_order(page: Path, tmp_path, monkeypatch, capsys) -> None:
    """Each page's blocks run top to bottom in one folder, so a block may use a file an
    earlier one wrote; `$CKPT` (or `CKPT` in Python) is a small real checkpoint."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello!\n/exit\n"))
    for b in (b for b in OURS if b.page == page):
        if b.lang in PYTHON:
            exec(compile(b.body, b.where, "exec"), {"CKPT": str(CKPT)})
        else:
            for command in b.lines:
                _run_shell_line(b, command, tmp_path)
        assert capsys.readouterr().out is not None


@requires("mkdocs")
def test_the_site_builds_strict(tmp_path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.glob("*.md"):
        assert f" {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_the_readme_is_short_and_starts_with_its_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    assert lines[0].startswith("# ")
    first = next(b for b in blocks(ROOT / "README.md"))
    assert first.line == 3 and first.lang == "sh", "the set-up commands follow the title"
    assert [c.split()[:2] for c in first.lines] == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: install\n\t\$\(BIN\)/qir demo$", makefile, re.M)
    assert re.search(r"^test: lint typecheck\n\t.*pytest", makefile, re.M)
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


# The developers' notes live outside the repository; the repository cites its own docs.
OUTSIDE = r"\.\./shared|shared/(design|formats|gguf|fixtures)|(design|formats|gguf)\.md §"


def test_nothing_cites_notes_outside_the_repository() -> None:
    found = subprocess.run(
        ["git", "grep", "-n", "-E", OUTSIDE, "--", ".", ":!tests/test_docs.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if found.returncode == 128:  # not a git checkout (an sdist): nothing to list
        return
    assert found.stdout == "", found.stdout
