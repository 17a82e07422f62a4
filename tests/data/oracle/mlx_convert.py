"""The mlx-lm fixtures: `python mlx.py SRC DST [convert options]` in a venv with mlx 0.32.4,
mlx-lm 0.32.2 (mlx-cpu), numpy 2.4.6; default options `-q --q-bits 4 --q-group-size 64`.

Runs `python -m mlx_lm convert --hf-path SRC --mlx-path DST <options>` (offline), and writes DST/golden.npz: `W.<l>.<p>` for the seven linears of every layer and
`W.embed_tokens` / `W.lm_head` (mlx-lm quantizes those too; a tied lm_head has none), each
`mx.dequantize(weight, scales, biases, group_size, bits, mode, dtype=float32)` on the modules of
`mlx_lm.utils.load_model(DST)`, with the stored bf16 scales and biases widened to float32 first
(mx.dequantize evaluates in the scales' dtype); the linears' biases stay tensors in the
checkpoint (goldens.py reads them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

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


# Phi-3's fused linears: path -> the rows of the short names they stack (from config.json).
FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}


def rows(config: dict, short: str) -> int:
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    sizes = {"q": heads * head_dim, "k": kv * head_dim, "v": kv * head_dim}
    return sizes.get(short, config["intermediate_size"])


def decode(module: object) -> np.ndarray:
    scales = module.scales.astype(mx.float32)
    biases = module.get("biases")
    w = mx.dequantize(
        module.weight,
        scales,
        None if biases is None else biases.astype(mx.float32),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
        dtype=mx.float32,
    )
    return np.array(w, dtype=np.float32)


def main(src: str, dst: str, *options: str) -> None:
    opts = list(options) or ["-q", "--q-bits", "4", "--q-group-size", "64"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", src, "--mlx-path", dst, *opts]
    subprocess.run(cmd, check=True, env=env)
    for name in TOKENIZER:
        (Path(dst) / name).unlink(missing_ok=True)
    np.savez_compressed(Path(dst) / "golden.npz", **decoded(Path(dst)))


def decoded(dst: Path) -> dict[str, np.ndarray]:
    """The tool-decoded weights of every linear of the mlx-lm checkpoint at `dst` (golden.npz's
    `W.*`)."""
    model, _ = load_model(Path(dst))
    config = json.loads((Path(dst) / "config.json").read_text())
    # a multimodal checkpoint's text model (Gemma 3: model.language_model)
    lm = getattr(model, "language_model", model)
    inner = lm.model
    out: dict[str, np.ndarray] = {}
    for layer, block in enumerate(inner.layers):
        paths = dict(PROJ)
        for path, parts in FUSED.items():  # a fused linear's rows, split as its module splits
            if hasattr(getattr(block, path.split(".")[0]), path.split(".")[1]):
                w = decode(getattr(getattr(block, path.split(".")[0]), path.split(".")[1]))
                start = 0
                for short in parts:
                    out[f"W.{layer}.{short}"] = w[start : start + rows(config, short)]
                    start += rows(config, short)
                    paths.pop(short)
        for p, path in paths.items():
            mod = block
            for part in path.split("."):
                mod = getattr(mod, part)
            out[f"W.{layer}.{p}"] = decode(mod)
    out["W.embed_tokens"] = decode(inner.embed_tokens)
    if getattr(lm, "lm_head", None) is not None:
        out["W.lm_head"] = decode(lm.lm_head)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
