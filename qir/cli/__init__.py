"""The `qir` command: one module per command group, each registering its subcommands. Bad input
ends in one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from qir.cli import blocks, cache, checkpoints, demo, generate, serve, tokenize, tp
from qir.errors import QirError
from qir.logs import LOGGER

EXIT_USAGE = 2
GROUPS = (blocks, generate, serve, demo, checkpoints, tokenize, cache)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qir", description="Compile and run quantized LLM blocks.")
    talk = ap.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help="no compile progress lines")
    talk.add_argument(
        "-v", "--verbose", action="store_true", help="a line per kernel compile (debug records)"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
