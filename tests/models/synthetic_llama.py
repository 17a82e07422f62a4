"""A tiny synthetic Llama checkpoint (MLX 4-bit, grouped-query attention, several layers) and an
independent float64 numpy forward of it, for what the 1-layer MHA fixtures do not cover.

The forward is written apart from qir's interpreter on purpose: kv heads are repeated with
np.repeat (qir groups query heads by reshaping), RoPE rotates pairs as complex numbers
(qir rotates halves), attention is masked with a triangular matrix over the whole sequence
(qir reads a KV cache by position), and the Llama 3 frequencies are computed per frequency in
plain Python floats.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from qir.dtypes import BF16
from qir.formats.mlx import MlxAffine

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 96,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA3,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization": {"group_size": 32, "bits": 4},
}


def write_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A checkpoint directory; `overrides` replace config.json keys (None deletes one)."""
    cfg = {**BASE, **overrides}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    rng = np.random.default_rng(seed)
    fmt = MlxAffine(cfg["quantization"]["bits"], cfg["quantization"]["group_size"], BF16)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {
        "self_attn.q_proj": (q_out, hidden),
        "self_attn.k_proj": (kv_out, hidden),
        "self_attn.v_proj": (kv_out, hidden),
        "self_attn.o_proj": (hidden, q_out),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    tensors: dict[str, np.ndarray] = {}

    def linear(module: str, shape: tuple[int, int], std: float) -> None:
        w = rng.standard_normal(shape, dtype=np.float32) * std
        tensors.update({f"{module}.{k}": v for k, v in fmt.quantize(w).items()})

    def norm(module: str) -> None:
        w = 1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)
        tensors[f"{module}.weight"] = w.astype(BF16.np)

    linear("model.embed_tokens", (cfg["vocab_size"], hidden), 1.0)
    # What the family implies besides Llama's tensors (transformers' modules for it).
    biased = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    if cfg.get("attention_bias"):
        biased.add("self_attn.o_proj")
    elif cfg.get("model_type") != "qwen2":
        biased = set()
    if cfg.get("mlp_bias"):
        biased |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for name, shape in shapes.items():
            linear(f"{prefix}.{name}", shape, shape[1] ** -0.5)
            if name in biased:
                b = 0.5 * rng.standard_normal(shape[0], dtype=np.float32)
                tensors[f"{prefix}.{name}.bias"] = b.astype(BF16.np)
        norm(f"{prefix}.input_layernorm")
        norm(f"{prefix}.post_attention_layernorm")
        if cfg.get("model_type") == "qwen3":
            for which in ("q_norm", "k_norm"):
                w = 1.0 + 0.3 * rng.standard_normal(cfg["head_dim"], dtype=np.float32)
                tensors[f"{prefix}.self_attn.{which}.weight"] = w.astype(BF16.np)
    norm("model.norm")
    if not cfg.get("tie_word_embeddings"):
        linear("lm_head", (cfg["vocab_size"], hidden), hidden**-0.5)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


class Forward:
    """float64 logits of a whole sequence of the checkpoint at `path` (no cache)."""

    def __init__(self, path: Path) -> None:
        from safetensors.numpy import load_file

        self.cfg = json.loads((path / "config.json").read_text())
        self.t = load_file(str(path / "model.safetensors"))

    def weight(self, module: str) -> np.ndarray:
        w = self.t[f"{module}.weight"]
        if f"{module}.scales" not in self.t:
            return w.astype(np.float64)
        words, scales, biases = w, self.t[f"{module}.scales"], self.t[f"{module}.biases"]
        bits, group = self.cfg["quantization"]["bits"], self.cfg["quantization"]["group_size"]
        # MLX: element j of a row is bits [j*bits, (j+1)*bits) of the row's uint32 words.
        shifts = np.arange(32 // bits, dtype=np.uint32) * bits
        codes = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
        codes = codes.reshape(words.shape[0], -1).astype(np.float64)
        s = np.repeat(scales.astype(np.float64), group, axis=1)
        b = np.repeat(biases.astype(np.float64), group, axis=1)
        return codes * s + b

    def linear(self, x: np.ndarray, module: str) -> np.ndarray:
        """x W^T, plus the bias where the checkpoint has one."""
        y = x @ self.weight(module).T
        b = self.t.get(f"{module}.bias")
        return y if b is None else y + b.astype(np.float64)

    def inv_freq(self) -> np.ndarray:
        cfg, d = self.cfg, self.cfg["head_dim"]
        scaling = cfg.get("rope_scaling") or {}
        out = []
        for i in range(0, d, 2):
            f = 1.0 / cfg["rope_theta"] ** (i / d)
            if scaling.get("rope_type") == "llama3":
                wavelen = 2 * math.pi / f
                old = scaling["original_max_position_embeddings"]
                lo, hi = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
                if wavelen > lo:
                    f = f / scaling["factor"]
                elif wavelen >= hi:
                    t = (old / wavelen - scaling["low_freq_factor"]) / (
                        scaling["high_freq_factor"] - scaling["low_freq_factor"]
                    )
                    f = (1 - t) * f / scaling["factor"] + t * f
            out.append(f)
        return np.array(out)

    def rope(self, x: np.ndarray) -> np.ndarray:
        """x [T, heads, D]: pairs (i, i + D/2) as complex numbers times e^(i pos freq)."""
        d = x.shape[-1]
        z = x[..., : d // 2] + 1j * x[..., d // 2 :]
        angle = np.arange(x.shape[0])[:, None] * self.inv_freq()[None, :]
        z = z * np.exp(1j * angle)[:, None, :]
        return np.concatenate([z.real, z.imag], axis=-1)

    def norm(self, x: np.ndarray, module: str) -> np.ndarray:
        w = self.t[f"{module}.weight"].astype(np.float64)
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + self.cfg["rms_norm_eps"]) * w

    def layer(self, x: np.ndarray, layer: int) -> np.ndarray:
        cfg, p = self.cfg, f"model.layers.{layer}"
        t, d = x.shape[0], cfg["head_dim"]
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        h = self.norm(x, f"{p}.input_layernorm")
        q = self.linear(h, f"{p}.self_attn.q_proj").reshape(t, heads, d)
        k = self.linear(h, f"{p}.self_attn.k_proj").reshape(t, kv, d)
        v = self.linear(h, f"{p}.self_attn.v_proj").reshape(t, kv, d)
        if f"{p}.self_attn.q_norm.weight" in self.t:  # Qwen3: each head normed before RoPE
            q, k = self.norm(q, f"{p}.self_attn.q_norm"), self.norm(k, f"{p}.self_attn.k_norm")
        q, k = self.rope(q), self.rope(k)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(d)
        scores = scores + np.triu(np.full((t, t), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", probs, v).reshape(t, heads * d)
        x = x + self.linear(a, f"{p}.self_attn.o_proj")
        h = self.norm(x, f"{p}.post_attention_layernorm")
        g = self.linear(h, f"{p}.mlp.gate_proj")
        u = self.linear(h, f"{p}.mlp.up_proj")
        return x + self.linear(g / (1 + np.exp(-g)) * u, f"{p}.mlp.down_proj")

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        x = self.weight("model.embed_tokens")[tokens]
        for layer in range(self.cfg["num_hidden_layers"]):
            x = self.layer(x, layer)
        head = "model.embed_tokens" if self.cfg.get("tie_word_embeddings") else "lm_head"
        return self.norm(x, "model.norm") @ self.weight(head).T
