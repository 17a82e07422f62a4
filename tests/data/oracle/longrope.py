"""The Phi-3 fixture with LongRoPE: `python longrope.py tests/data/mlx_affine4_phi3` in a venv
with mlx 0.32.4, mlx-lm 0.32.2, transformers 5.24.0 and torch 2.13.0+cpu.

Writes CASE/config_longrope.json: the fixture's config.json with Phi-3-mini-128k's spelling of
LongRoPE (`rope_scaling` {"type": "longrope", short_factor, long_factor}, top-level rope_theta and
original_max_position_embeddings) at this model's size: original_max_position_embeddings 16 of
max_position_embeddings 128 (factor 8, attention_factor sqrt(1 + ln 8 / ln 16) = 1.3229),
short factors 1 + 0.02 i, long factors 1 + 0.25 i (i = 0..31, head_dim 64). And
CASE/golden_longrope.npz, from transformers' own Phi3ForCausalLM (eager, float32) with that
config on the tool-decoded weights of every layer (mlx_convert.decoded):

- `rot.x` [24, 64] float32 N(0, 1), `rot.short` its rows 0..11 rotated at positions 0..11 by a
  12-position forward's cos/sin (short factors), `rot.long` all 24 rows at positions 0..23 by a
  24-position forward's (long factors), each by transformers' apply_rotary_pos_emb;
- `short.tokens` (12) and `short.logits`: a 12-token forward (at most 16 positions: short);
- `long.tokens` (24), `long.logits`, and 4 greedy steps with the KV cache after them
  (`long.greedy`, `long.step_logits`): every position past 16, so long factors throughout.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from goldens import build, save_npz
from mlx_convert import decoded
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

ORIGINAL, HEAD_DIM = 16, 64


def config(case: Path) -> dict:
    cfg = json.loads((case / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    pairs = range(HEAD_DIM // 2)
    return {
        **cfg,
        "rope_theta": theta,
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [round(1 + 0.02 * i, 2) for i in pairs],
            "long_factor": [1 + 0.25 * i for i in pairs],
        },
    }


def main(case_dir: str) -> None:
    case = Path(case_dir)
    cfg = config(case)
    (case / "config_longrope.json").write_text(json.dumps(cfg, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "case"
        shutil.copytree(case, work)
        (work / "config.json").write_text(json.dumps(cfg))
        model = build(work, decoded(case))
    out: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, HEAD_DIM), dtype=np.float32)
    out["rot.x"] = x
    for key, n in (("rot.short", 12), ("rot.long", 24)):
        pos = torch.arange(n)[None]
        xt = torch.from_numpy(x[:n])[None, None]  # [batch, heads, seq, head_dim]
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(xt, pos)
            rotated, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
        out[key] = rotated[0, 0].numpy()
    vocab = cfg["vocab_size"]
    for key, n in (("short", 12), ("long", 24)):
        tokens = (7 * np.arange(n) + 3) % vocab
        with torch.no_grad():
            res = model(torch.from_numpy(tokens)[None], use_cache=True)
        out[f"{key}.tokens"] = tokens.astype(np.int64)
        out[f"{key}.logits"] = res.logits[0].numpy()
    cache, logits, steps, chosen = res.past_key_values, res.logits[0, -1], [], []
    with torch.no_grad():
        for step in range(4):
            token = int(torch.argmax(logits))
            steps.append(logits.numpy().copy())
            chosen.append(token)
            if step < 3:
                res = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, logits = res.past_key_values, res.logits[0, -1]
    out["long.greedy"] = np.array(chosen, np.int64)
    out["long.step_logits"] = np.stack(steps).astype(np.float32)
    save_npz(case / "golden_longrope.npz", out)
    print("attention_factor", model.model.rotary_emb.attention_scaling, "greedy", chosen)


if __name__ == "__main__":
    main(sys.argv[1])
