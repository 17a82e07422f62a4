"""`qir generate` (a continuation of a prompt: text, one chat turn, or ids) and `qir chat` (an
interactive conversation that keeps its KV cache between turns). Both take --tp N (qir.cli.tp):
chat's rank 0 reads stdin and broadcasts each line to the other ranks."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from qir.cli import tp
from qir.cli.options import add_lowering, add_max_seq, model_of, token_ids
from qir.errors import UsageError
from qir.models import Model
from qir.runtime.backend import BACKENDS, best_backend

CHAT_HELP = "/reset forgets the conversation, /exit (or Ctrl-D) ends it, Ctrl-C stops a reply"


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options given on the command line (None: generation_config.json's)."""
    return {
        "do_sample": False if args.greedy else None,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
    }


def _model(args: argparse.Namespace) -> Model:
    backend = args.backend or best_backend()
    model = model_of(args, backend, tp.comm_of(args, backend))
    ignored = model.generation_config.not_applied()
    lead = model.comm is None or model.comm.rank == 0  # --tp: rank 0 alone says it
    if (
        ignored
        and lead
        and (args.prompt is not None or args.chat is not None or args.command == "chat")
    ):
        print(
            f"qir: {model.generation_config.origin} sets {', '.join(ignored)}, which qir does "
            "not apply",
            file=sys.stderr,
        )
    return model


def _show(pieces: Any, out: TextIO) -> None:
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    given = [f for f in ("tokens", "prompt", "chat") if getattr(args, f) is not None]
    if len(given) != 1:
        raise UsageError("generate: give one of --prompt TEXT, --chat TEXT or --tokens IDS")
    if args.system is not None and args.chat is None:
        raise UsageError("--system goes with --chat (a chat's system message)")
    if args.tokens is not None and args.stop:
        raise UsageError("--stop takes text: use --prompt or --chat, not --tokens")
    launched = tp.launch(args)
    if launched is not None:
        return launched
    sampling = _sampling(args)
    model = _model(args)
    keep = args.out is not None
    if args.tokens is not None:
        tokens = token_ids(args.tokens)
        gen = model.generate(
            tokens,
            args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            on_token=lambda t: print(t, end=" ", flush=True),
            keep_logits=keep,
            **sampling,
        )
        print()
    else:
        common = {"stream": True, "stop": args.stop, "keep_logits": keep, **sampling}
        if args.prompt is not None:
            text = model.generate(
                args.prompt, args.max_new_tokens, ignore_eos=args.ignore_eos, **common
            )
        else:
            messages = [{"role": "user", "content": args.chat}]
            if args.system is not None:
                messages.insert(0, {"role": "system", "content": args.system})
            text = model.chat(
                messages,
                args.max_new_tokens,
                template=args.template,
                ignore_eos=args.ignore_eos,
                **common,
            )
        _show(text, sys.stdout)
        gen = model.last
    if args.stats:
        print(f"qir: {model.stats.line()}", file=sys.stderr)
    if args.out:
        logits = gen.logits if gen.logits is not None else np.zeros((0, model.vocab_size))
        np.savez(args.out, tokens=gen.tokens, logits=logits.astype(np.float32))
        print(
            f"wrote {args.out}: tokens {list(gen.tokens.shape)}, logits {list(logits.shape)}",
            file=sys.stderr if args.tokens is None else sys.stdout,
        )
    return 0


def _lines(comm: Any) -> Callable[[], str]:
    """The chat's next line ("" at the end of stdin). Under --tp rank 0 reads stdin (mpiexec
    hands it to rank 0 alone) and broadcasts each line, so every rank runs the same turns and
    launches the same collectives."""
    if comm is None or comm.size == 1:
        return sys.stdin.readline
    if comm.rank == 0:
        return lambda: str(comm.bcast(sys.stdin.readline()))
    return lambda: str(comm.bcast(None))


def cmd_chat(args: argparse.Namespace) -> int:
    launched = tp.launch(args)
    if launched is not None:
        return launched
    model = _model(args)
    sampling = _sampling(args)
    model.chat_prompt([{"role": "user", "content": ""}], args.template)  # a template exists
    comm = model.comm
    lead = comm is None or comm.rank == 0  # under --tp the others run the turns, silently
    say: TextIO = sys.stderr if lead else open(os.devnull, "w")  # noqa: SIM115
    next_line = _lines(comm)
    # under --tp rank 0's stdin is mpiexec's pipe: the launching process said if it is a tty
    interactive = lead and (sys.stdin.isatty() or os.environ.get(tp.TTY_ENV) == "1")
    if interactive:
        print(f"qir chat: {args.checkpoint} ({CHAT_HELP})", file=say)
    history: list[dict[str, str]] = []
    if args.system is not None:
        history.append({"role": "system", "content": args.system})
    start = len(history)
    while True:
        if interactive:
            print(">>> ", end="", file=say, flush=True)
        line = next_line()
        if not line:  # Ctrl-D
            break
        line = line.rstrip("\n")
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            del history[start:]
            model.reset()
            print("qir: conversation reset", file=say)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        pieces = None
        try:
            pieces = model.chat(
                history,
                args.max_new_tokens,
                stream=True,
                stop=args.stop,
                template=args.template,
                **sampling,
            )
            _show(pieces, sys.stdout)
        except UsageError as e:  # the turn did not happen (past --max-seq): say so, go on
            history.pop()
            print(f"qir: error: {e} (/reset starts over)", file=say)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            if comm is not None and comm.size > 1:
                # each rank would stop after another step (another collective): end them all
                raise
            if pieces is not None:
                pieces.close()
            print("\n(interrupted)", file=sys.stderr)
        history.append({"role": "assistant", "content": model.last.text or ""})
        if args.stats:
            print(f"qir: {model.stats.line()}", file=say)
    return 0


def _sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling (default: the checkpoint's generation_config.json, as transformers reads it)"
    )
    g.add_argument("--max-new-tokens", type=int, help="ids to generate at most")
    g.add_argument("--greedy", action="store_true", help="always the most likely id")
    g.add_argument("--temperature", type=float, help="> 0 samples (turns sampling on), 0: greedy")
    g.add_argument("--top-k", type=int, help="keep the k most likely ids (0: off)")
    g.add_argument("--top-p", type=float, help="keep the nucleus of this mass, in (0, 1]")
    g.add_argument("--min-p", type=float, help="keep ids at least this likely relative to the top")
    g.add_argument("--seed", type=int, help="the draws' seed (default: a fresh one)")
    g.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="end at this text (repeatable)"
    )
    g.add_argument("--stats", action="store_true", help="prompt and decode tokens/s on stderr")


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="checkpoint directory")
    p.add_argument(
        "--backend", choices=BACKENDS, help="default: cuda if a GPU is present, else host"
    )
    p.add_argument(
        "--template", help="a named chat template of the checkpoint (default: its default)"
    )
    add_lowering(p)
    add_max_seq(p)


def register(sub: Any) -> None:
    gen = sub.add_parser(
        "generate",
        help="continue a prompt (text, one chat turn, or ids) with the KV cache",
        description="Continue a prompt: text as it is generated, or ids.",
    )
    _model_options(gen)
    what = gen.add_argument_group("prompt (one of)")
    what.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    what.add_argument("--chat", help="one user message, through the checkpoint's chat template")
    what.add_argument("--tokens", help="ids, comma-separated (3,10,17) or an int .npy; ids out")
    gen.add_argument("--system", help="--chat: a system message before it")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at eos_token_id")
    gen.add_argument(
        "--out", type=Path, help="G.npz: int64 tokens [N], float32 logits [N, vocab] they came from"
    )
    _sampling_options(gen)
    tp.add_tp(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="talk to a model: its chat template, the KV cache kept between turns",
        description=f"An interactive chat on stdin/stdout ({CHAT_HELP}).",
    )
    _model_options(chat)
    chat.add_argument("--system", help="a system message that starts the conversation")
    _sampling_options(chat)
    tp.add_tp(chat)
    chat.set_defaults(func=cmd_chat, prompt=None, chat=None)
