"""`qir tokenize MODEL`: a text's token ids by the checkpoint's own tokenizer (tokenizer.json, or
a GGUF model's tokenizer.ggml.*), its BOS/EOS added as the tokenizer adds them: `--text S`
prints the ids comma-separated; `--file strings.json --json` prints a JSON list of id lists,
one per string of the file's JSON list."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from qir.errors import UsageError
from qir.models import load


def _strings(path: Path) -> list[str]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--file {path}: cannot read a JSON list of strings ({e})") from None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise UsageError(f"--file {path}: expected a JSON list of strings")
    return value


def cmd_tokenize(args: argparse.Namespace) -> int:
    if (args.text is None) == (args.file is None):
        raise UsageError("tokenize: give one of --text S or --file strings.json")
    if args.json and args.file is None:
        raise UsageError("--json goes with --file (a JSON list of id lists)")
    tokenizer = load(args.checkpoint).tokenizer()
    special = not args.no_special
    if args.text is not None:
        print(",".join(str(i) for i in tokenizer.encode(args.text, add_special_tokens=special)))
        return 0
    ids = [tokenizer.encode(s, add_special_tokens=special) for s in _strings(args.file)]
    if args.json:
        print(json.dumps(ids))
    else:
        for row in ids:
            print(",".join(str(i) for i in row))
    return 0


def register(sub: Any) -> None:
    tok = sub.add_parser("tokenize", help="a text's token ids by the checkpoint's tokenizer")
    tok.add_argument("checkpoint", type=Path, help="checkpoint directory or .gguf file")
    tok.add_argument("--text", help="the text to tokenize")
    tok.add_argument("--file", type=Path, help="a JSON list of strings to tokenize")
    tok.add_argument("--json", action="store_true", help="with --file: one JSON list of id lists")
    tok.add_argument(
        "--no-special", action="store_true", help="no BOS/EOS around the text (ids of the text)"
    )
    tok.set_defaults(func=cmd_tokenize)
