"""Goldens for a multimodal checkpoint's text model (Gemma 3's Gemma3ForConditionalGeneration):
`python goldens_multimodal.py CASE` in the venv goldens.py uses.

The model is transformers' own `Gemma3ForConditionalGeneration.from_config(config.json)` in
float32 with eager attention, run on token ids alone (no image). Its text weights are the
tool's: the decoded linears of CASE/golden.npz (mlx_convert.py writes them from the text model
mlx-lm loads), every other text tensor read from the checkpoint (`language_model.model.*` as the
Hub stores them) and widened to float32; the vision tower and projector, which the tool drops
and a text-only forward never runs, keep their random init. Writes golden_model.npz: tokens,
logits, the greedy ids and each step's logits (keys as goldens.py's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from goldens import PROJ, PROMPT, STEPS, checkpoint_tensors, save_npz
from transformers import AutoConfig, Gemma3ForConditionalGeneration


def build(case: Path) -> torch.nn.Module:
    golden = dict(np.load(case / "golden.npz"))
    cfg = AutoConfig.from_pretrained(case)
    for key in ("quantization_config", "quantization"):
        if hasattr(cfg, key):
            delattr(cfg, key)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    ).eval()
    stored = checkpoint_tensors(case)
    short = {v: k for k, v in PROJ.items()}
    state = {}
    for name in model.state_dict():
        if not name.startswith(("model.language_model.", "lm_head.")):
            continue  # the vision tower and projector
        if name == "lm_head.weight":
            state[name] = torch.from_numpy(golden["W.lm_head"])
            continue
        rest = name.removeprefix("model.language_model.")
        parts = rest.split(".")
        if rest == "embed_tokens.weight":
            state[name] = torch.from_numpy(golden["W.embed_tokens"])
        elif parts[0] == "layers" and ".".join(parts[2:-1]) in short and parts[-1] == "weight":
            state[name] = torch.from_numpy(golden[f"W.{parts[1]}.{short['.'.join(parts[2:-1])]}"])
        else:
            state[name] = stored[f"language_model.model.{rest}"].float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    text_missing = [k for k in missing if k.startswith(("model.language_model.", "lm_head."))]
    assert not text_missing and not unexpected, (text_missing, unexpected)
    return model


def main(case_dir: str) -> None:
    case = Path(case_dir)
    raw = json.loads((case / "config.json").read_text())
    model = build(case)
    vocab = raw["text_config"]["vocab_size"]
    tokens = (7 * np.arange(PROMPT) + 3) % vocab
    out: dict[str, np.ndarray] = {"tokens": tokens.astype(np.int64)}
    ids = torch.from_numpy(tokens)[None]
    steps, chosen = [], []
    with torch.no_grad():
        out["logits"] = model(ids, use_cache=False).logits[0].numpy()
        res = model(ids, use_cache=True)
        cache, logits = res.past_key_values, res.logits[0, -1]
        for step in range(STEPS):
            token = int(torch.argmax(logits))
            steps.append(logits.numpy().copy())
            chosen.append(token)
            if step + 1 < STEPS:
                res = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, logits = res.past_key_values, res.logits[0, -1]
    out["greedy"] = np.array(chosen, np.int64)
    out["step_logits"] = np.stack(steps).astype(np.float32)
    save_npz(case / "golden_model.npz", out)
    top2 = np.sort(out["step_logits"], axis=-1)[:, -2:]
    print("greedy", chosen, "min top-2 margin", float((top2[:, 1] - top2[:, 0]).min()))


if __name__ == "__main__":
    main(sys.argv[1])
