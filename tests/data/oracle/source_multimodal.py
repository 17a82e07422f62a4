"""Gemma 3's multimodal source model: `python source_multimodal.py TEXT OUT` puts the text model
that `source.py gemma3_text TEXT bfloat16` made inside a Gemma3ForConditionalGeneration (a tiny
random SigLIP vision tower) and saves it as transformers writes it (`language_model.model.*`).

text_config's final_logit_softcapping is null, as in the releases: transformers'
Gemma3ForConditionalGeneration never applies it (its text model and mlx-lm would). The top
level's vocab_size is set for mlx-lm, whose default is the release's 262208.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3ForConditionalGeneration


def main(src: str, out: str) -> None:
    torch.manual_seed(1)
    text = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tc = text.config.to_dict()
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        tc.pop(key, None)
    tc["final_logit_softcapping"] = None
    cfg = AutoConfig.for_model(
        "gemma3",
        text_config=tc,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        image_token_index=255,
        boi_token_index=253,
        eoi_token_index=254,
        tie_word_embeddings=False,
    )
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    state = text.state_dict()
    with torch.no_grad():
        model.model.language_model.load_state_dict(
            {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        )
        model.lm_head.weight.copy_(state["lm_head.weight"])
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    config = json.loads((Path(out) / "config.json").read_text())
    config["vocab_size"] = config["text_config"]["vocab_size"]
    (Path(out) / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(src) / name).exists():  # mlx-lm's convert loads a tokenizer
            shutil.copy(Path(src) / name, Path(out) / name)


if __name__ == "__main__":
    main(*sys.argv[1:])
