"""transformers' float32 forward of each GGUF fixture: `python gguf_goldens.py DIR [FAMILY ...]`
(torch 2.13.0+cpu, transformers 5.25, gguf 0.19.0).

For each DIR/<family>/model-<ftype>.gguf, transformers loads the file itself
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., torch_dtype=float32)`: its GGUF
config tables, its reverse of the llama converter's q/k permutation and of Gemma's norm + 1,
gguf-py's dequantize of every tensor) and runs eager float32 attention:
- `<ftype>.logits`: float32 [12, vocab], one prefill of the prompt `(7 * j + 3) % vocab`;
- `<ftype>.greedy`: 8 greedy ids after the prompt, with the KV cache (eos not stopping);
- `<ftype>.step_logits`: float32 [8, vocab], the logits each greedy id was chosen from.
Saved as DIR/<family>/transformers.npz with `tokens` (the prompt).

What transformers' GGUF loader does not read and llama.cpp hard-codes is passed as config
keywords, so that the reference is llama.cpp's model: head_dim and moe_intermediate_size (the
file's attention.key_length and expert_feed_forward_length, which transformers reads for some
families only) and Qwen3-MoE's
norm_topk_prob (true: llama.cpp renormalises the chosen experts' weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

PROMPT_LEN, NEW = 12, 8
OVERRIDES = {"qwen3moe": {"norm_topk_prob": True}}


# File keys transformers' GGUF tables read for some families only -> their config keys.
UNREAD = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size"}


def unread(path: Path) -> dict[str, int]:
    """The config keys of UNREAD, from the file (head_dim: Qwen3's default would be 128;
    moe_intermediate_size: Qwen3-MoE's default 768)."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    keys = {hf: fields.get(f"{arch}.{k}") for k, hf in UNREAD.items()}
    return {hf: int(f.contents()) for hf, f in keys.items() if f is not None}


def forward(path: Path, family: str) -> dict[str, np.ndarray]:
    model = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        torch_dtype=torch.float32,
        attn_implementation="eager",
        **{**unread(path), **OVERRIDES.get(family, {})},
    ).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.tensor([[(7 * j + 3) % vocab for j in range(PROMPT_LEN)]])
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits = out.logits[0].float().numpy()
        past, step, greedy, steps = out.past_key_values, out.logits[:, -1], [], []
        for _ in range(NEW):
            nxt = int(step.argmax(-1))
            greedy.append(nxt)
            steps.append(step[0].float().numpy())
            out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, step = out.past_key_values, out.logits[:, -1]
    return {
        "tokens": ids[0].numpy(),
        "logits": logits,
        "greedy": np.array(greedy, np.int64),
        "step_logits": np.stack(steps),
    }


def run(family_dir: Path) -> None:
    out: dict[str, np.ndarray] = {}
    for path in sorted(family_dir.glob("model-*.gguf")):
        ftype = path.stem.removeprefix("model-")
        got = forward(path, family_dir.name)
        out["tokens"] = got.pop("tokens")
        out.update({f"{ftype}.{k}": v for k, v in got.items()})
    np.savez(family_dir / "transformers.npz", **out)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for family in sys.argv[2:] or sorted(p.name for p in root.iterdir() if p.is_dir()):
        run(root / family)
        print(family, "done")
