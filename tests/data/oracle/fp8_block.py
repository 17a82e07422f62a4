"""The block-wise FP8 fixture in the HF layout of the Qwen3-*-FP8 and DeepSeek-V3 releases:
`python fp8_block.py SRC DST` in a venv with transformers 5.24.0 and torch 2.13.0+cpu.

No tool writes this layout on a CPU (transformers' FineGrainedFP8 quantizes on load only on a
GPU), so it is written here from the documented layout: each of the seven linears of every layer
becomes `weight` float8_e4m3fn [O, I] and `weight_scale_inv` float32 [ceil(O/128), ceil(I/128)],
scale = amax / 448 of each 128 x 128 block (a ragged last block is as wide as what is left),
codes = e4m3(w / scale) in torch (round to nearest even, clamped at 448); embeddings, norms and
lm_head stay bf16; config.json gets `quantization_config = {"quant_method": "fp8", "fmt":
"e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
"modules_to_not_convert": ["lm_head"]}` as Qwen3-8B-FP8's.

DST/golden.npz gets `W.<l>.<p>`: transformers' own decode, the weights of
`AutoModelForCausalLM.from_pretrained(DST, dtype=float32)` (without a GPU it dequantizes the FP8
linears on load; needs accelerate), checked here to equal e4m3 * scale in float32 exactly. That
CPU dequant refuses weights that are not whole 128 x 128 blocks ("not divisible by scale grid"),
so this fixture's source has whole blocks; ragged blocks are covered by the compressed-tensors
FP8_BLOCK fixture (llmc.py ... FP8_BLOCK), whose decompress() handles them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
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
BLOCK = 128
QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
    "modules_to_not_convert": ["lm_head"],
}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    out, inp = w.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            amax = block.abs().max()
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
    full = scale.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inp]
    codes = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scale


def main(src: str, dst: str) -> None:
    s, d = Path(src), Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(s / "model.safetensors"))
    config = json.loads((s / "config.json").read_text())
    decoded = {}
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        parts = module.split(".")
        short = {v: k for k, v in PROJ.items()}.get(".".join(parts[3:]))
        if name.startswith("model.layers.") and name.endswith(".weight") and short:
            codes, scale = quantize(t)
            out[name], out[f"{module}.weight_scale_inv"] = codes, scale
            full = scale.repeat_interleave(BLOCK, 0)[: t.shape[0]]
            full = full.repeat_interleave(BLOCK, 1)[:, : t.shape[1]]
            decoded[f"W.{parts[2]}.{short}"] = codes.float() * full
        else:
            out[name] = t
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = QUANT
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(s / "generation_config.json", d / "generation_config.json")

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    state = model.state_dict()
    golden = {}
    for key, want in decoded.items():
        _, layer, short = key.split(".")
        got = state[f"model.layers.{layer}.{PROJ[short]}.weight"]
        assert got.dtype == torch.float32 and torch.equal(got, want), key
        golden[key] = got.numpy()
    import numpy as np

    np.savez_compressed(d / "golden.npz", **golden)
    print("transformers' decode equals e4m3 * scale for", len(golden), "linears")


if __name__ == "__main__":
    main(*sys.argv[1:])
