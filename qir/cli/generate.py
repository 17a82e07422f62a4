"""`qir generate`: a model's continuation of a prompt."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from qir.cli.options import add_lowering, add_max_seq, model_of, token_ids
from qir.runtime.backend import BACKENDS, best_backend


def cmd_generate(args: argparse.Namespace) -> int:
    tokens = token_ids(args.tokens)
    model = model_of(args, args.backend or best_backend())
    gen = model.generate(tokens, args.max_new_tokens, lambda t: print(t, end=" ", flush=True))
    print()
    if args.out:
        np.savez(args.out, tokens=gen.tokens, logits=gen.logits)
        print(f"wrote {args.out}: tokens {list(gen.tokens.shape)}, logits {list(gen.logits.shape)}")
    return 0


def register(sub: Any) -> None:
    gen = sub.add_parser(
        "generate", help="greedy generation: prefill the tokens, then decode with the KV cache"
    )
    gen.add_argument("checkpoint", type=Path, help="checkpoint directory")
    gen.add_argument(
        "--tokens", required=True, help="prompt ids, comma-separated (3,10,17) or an int .npy"
    )
    gen.add_argument("--max-new-tokens", type=int, required=True, help="ids to generate")
    gen.add_argument("--out", type=Path, help="G.npz: int64 tokens [N], float32 logits [N, vocab]")
    gen.add_argument(
        "--backend", choices=BACKENDS, help="default: cuda if a GPU is present, else host"
    )
    add_lowering(gen)
    add_max_seq(gen)
    gen.set_defaults(func=cmd_generate)
