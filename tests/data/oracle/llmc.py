"""The llmcompressor fixtures: `python llmc.py SRC DST [SCHEME]` in a venv with llmcompressor
0.14.0.1 (compressed-tensors 0.19.0, transformers 5.17.0, torch 2.13.0+cpu); SCHEME W4A16 by
default (round-to-nearest int4, symmetric, group 128: no calibration data).

`oneshot(model=AutoModelForCausalLM.from_pretrained(SRC, dtype=bfloat16),
recipe=QuantizationModifier(targets="Linear", scheme=SCHEME, ignore=["lm_head"]))`, then
`save_pretrained(DST, save_compressed=True)`; tokenizer files dropped. DST/golden.npz gets
`W.<l>.<p>`: compressed-tensors' own `decompress()` of each module's tensors (local names, the
scheme parsed from config.json), with `weight_scale` widened to float32 first (decompress()
dequantizes in its dtype). Biases stay bf16 tensors in the checkpoint (goldens.py reads them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

PROJ = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
TOKENIZER = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


# Phi-3's fused linears: path -> the short names whose rows they stack.
FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}


def rows(config: dict, short: str) -> int:
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    sizes = {"q": heads * head_dim, "k": kv * head_dim, "v": kv * head_dim}
    return sizes.get(short, config["intermediate_size"])


def main(src: str, dst: str, scheme: str = "W4A16") -> None:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(dst, save_compressed=True)
    for name in TOKENIZER:
        (Path(dst) / name).unlink(missing_ok=True)
    config = json.loads((Path(dst) / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    (group,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(group.format or qc.format)
    tensors = {}
    for f in sorted(Path(dst).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, np.ndarray] = {}

    def decode(prefix: str) -> np.ndarray:
        local = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        local.pop("bias", None)
        local["weight_scale"] = local["weight_scale"].float()
        return compressor.decompress(local, group)["weight"].float().numpy()

    for layer in range(config["num_hidden_layers"]):
        paths = dict(PROJ)
        for path, parts in FUSED.items():  # Phi-3: split the fused rows as its module does
            prefix = f"model.layers.{layer}.{path}."
            if any(k.startswith(prefix) for k in tensors):
                w, start = decode(prefix), 0
                for short in parts:
                    out[f"W.{layer}.{short}"] = w[start : start + rows(config, short)]
                    start += rows(config, short)
                    paths.pop(short)
        for p, path in paths.items():
            out[f"W.{layer}.{p}"] = decode(f"model.layers.{layer}.{path}.")
    np.savez_compressed(Path(dst) / "golden.npz", **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
