"""The `qir` command: one module per command group, each registering its subcommands. Bad input
ends in one line on stderr and exit code 2, never a traceback.

A command group's module is imported only when its command runs: `qir --help` lists the commands
from `COMMANDS` (name, group module, one-line help) and imports none of them, so it starts without
numpy, the compiler or the serving stack. tests/test_startup.py holds the lazy listing equal to
the one the groups register.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from qir.errors import QirError
from qir.logs import LOGGER

EXIT_USAGE = 2

# Each command: the module under qir/cli/ that registers it, and its line in `qir --help` (the
# same text the module registers; a test compares them). The order is `qir --help`'s.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("blocks", "run a block of a checkpoint on an input"),
    "dump": ("blocks", "write the IR and the generated CUDA of a block"),
    "compile": ("blocks", "print the launch plan of a block as JSON"),
    "graph": ("blocks", "draw a block before and after the passes, each kernel launch boxed"),
    "generate": ("generate", "continue a prompt (text, one chat turn, or ids) with the KV cache"),
    "chat": ("generate", "talk to a model: its chat template, the KV cache kept between turns"),
    "serve": ("serve", "serve a checkpoint over the OpenAI HTTP API (chat and text completions)"),
    "demo": ("demo", "run the embedded checkpoints and check against the reference"),
    "inspect": ("checkpoints", "list a checkpoint's linears: format, bits, shape, bytes"),
    "dequant": ("checkpoints", "write one linear's weight as a float32 [out, in] .npy"),
    "tokenize": ("tokenize", "a text's token ids by the checkpoint's tokenizer"),
    "cache": ("cache", "show, clear or fill the compiled-kernel cache"),
}


class _Version(argparse.Action):
    """`qir --version`: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"qir {version()}")
        parser.exit()


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("qir")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _command_of(argv: Sequence[str]) -> str | None:
    """The command argv names: its first argument that is not an option (the top-level options
    take no values), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def parser(command: str | None = "") -> argparse.ArgumentParser:
    """The `qir` parser. `command` "" (the default): every group registered in full; a command's
    name: its group in full and the others listed only; None: every command listed only."""
    ap = argparse.ArgumentParser(prog="qir", description="Compile and run quantized LLM blocks.")
    ap.add_argument("--version", action=_Version, help="print qir's version and exit")
    talk = ap.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help="no compile progress lines")
    talk.add_argument(
        "-v", "--verbose", action="store_true", help="a line per kernel compile (debug records)"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    wanted = COMMANDS.get(command or "", ("", ""))[0]
    registered: set[str] = set()
    for name, (group, line) in COMMANDS.items():
        if command == "" or group == wanted:
            if group not in registered:
                importlib.import_module(f"qir.cli.{group}").register(sub)
                registered.add(group)
        else:
            sub.add_parser(name, help=line)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    args = parser(command if command in COMMANDS else None).parse_args(argv)
    logger = logging.getLogger(LOGGER)
    level = logger.level
    if args.quiet:  # else $QIR_LOG's level, info by default (see qir.logs)
        logger.setLevel(logging.WARNING)
    elif args.verbose:
        logger.setLevel(logging.DEBUG)
    try:
        code: int = args.func(args)
        return code
    except (QirError, FileNotFoundError, NotADirectoryError) as e:
        from qir.cli import tp

        first = str(e).strip().splitlines()
        where = tp.error_prefix()
        # one write: the ranks of a --tp launch share the terminal
        sys.stderr.write(f"qir: error: {where}{first[0] if first else type(e).__name__}\n")
        if len(first) > 1:
            # compile errors carry the compiler output and source excerpt on further lines
            print("\n".join(first[1:]), file=sys.stderr)
        return EXIT_USAGE
    finally:
        logger.setLevel(level)  # main() may be called in a process that goes on
