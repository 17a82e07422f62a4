"""Goldens for a multimodal checkpoint's text model (Gemma 3's Gemma3ForConditionalGeneration):
`python goldens_multimodal.py CASE` in the venv goldens.py uses.

The model is transformers' own `Gemma3ForConditionalGeneration.from_config(config.json)` in
float32 with eager attention, run on token ids alone (no image). Its text weights are the
tool's: the decoded linears of CASE/golden.npz (mlx_convert.py writes them from the text model
mlx-lm loads), every other text tensor read from the checkpoint (`language_model.model.*` as the
Hub stores them) and widened to float32; the vision tower and projector, which the tool drops
and a text-only forward never runs, keep their random init. Writes golden.npz (the inputs
x.M1/M5/M40 and layer 0's decoded weights) and golden_model.npz (embed, each layer's hidden
state, the first and last layer alone at M 1, 5, 40, logits, the greedy ids and each step's
logits), keys as goldens.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from goldens import (
    MS,
    PROJ,
    PROMPT,
    checkpoint_tensors,
    greedy,
    inputs,
    layer_alone,
    save_npz,
)
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


class _Text(torch.nn.Module):
    """The text model where goldens.layer_alone looks for a causal LM's (`.model.layers`)."""

    def __init__(self, text: torch.nn.Module) -> None:
        super().__init__()
        self.model = text

    def forward(self, **kwargs: object) -> object:
        return self.model(**kwargs)


def main(case_dir: str) -> None:
    case = Path(case_dir)
    raw = json.loads((case / "config.json").read_text())
    text_cfg = raw["text_config"]
    model = build(case)
    golden = dict(np.load(case / "golden.npz"))
    xs = inputs(text_cfg["hidden_size"])
    save_npz(
        case / "golden.npz",
        {**xs, **{k: v for k, v in golden.items() if k.startswith("W.0.")}},
    )
    vocab, layers = text_cfg["vocab_size"], text_cfg["num_hidden_layers"]
    tokens = (7 * np.arange(PROMPT) + 3) % vocab
    out: dict[str, np.ndarray] = {"tokens": tokens.astype(np.int64)}
    ids = torch.from_numpy(tokens)[None]
    text = model.model.language_model
    hidden: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(
            lambda m, a, o: hidden.append(o[0] if isinstance(o, tuple) else o)
        )
        for layer in text.layers
    ]
    with torch.no_grad():
        out["logits"] = model(ids, use_cache=False).logits[0].numpy()
        out["embed"] = text.embed_tokens(ids)[0].numpy()
    for h in hooks:
        h.remove()
    for layer in range(layers):
        out[f"hidden.{layer}"] = hidden[layer][0].numpy()
    for layer in sorted({0, layers - 1}):
        for m in MS:
            out[f"layer.{layer}.M{m}"] = layer_alone(_Text(text), layer, xs[f"x.M{m}"])
    out.update(greedy(model, ids))
    save_npz(case / "golden_model.npz", out)
    top2 = np.sort(out["step_logits"], axis=-1)[:, -2:]
    print(
        "greedy", out["greedy"].tolist(), "min top-2 margin", float((top2[:, 1] - top2[:, 0]).min())
    )


if __name__ == "__main__":
    main(sys.argv[1])
