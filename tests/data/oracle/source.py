"""Tiny random-init source models for the fixtures (transformers AutoConfig.for_model +
from_config, no downloads): `python source.py FAMILY OUT DTYPE`.

Linears are sized like a trained model's (std in_features^-1/2), so activations stay O(1)
through the layers; embeddings and lm_head have std 0.2 (logits of std ~3, tied or not; Gemma's
embeddings 0.05, which it scales by sqrt(hidden)); norms,
q/k norms and biases are randomised so that each feature moves the logits. A word-level
tokenizer of 256 ids is saved beside the model (mlx-lm's convert loads one; the fixtures drop
it). Runs with transformers 4.51 (auto-gptq's venv) and 5.x alike.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

COMMON = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FAMILIES = {
    "llama": {"tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen2": {"tie_word_embeddings": True, "rope_theta": 1000000.0, "use_sliding_window": False},
    "qwen3": {"tie_word_embeddings": False, "rope_theta": 1000000.0, "attention_bias": False},
    "mistral": {"tie_word_embeddings": False, "rope_theta": 10000.0, "sliding_window": 8},
    # Phi-3-mini-4k's shape of config: fused qkv_proj / gate_up_proj, a window on every layer
    "phi3": {
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "sliding_window": 16,
        "pad_token_id": 0,
        "original_max_position_embeddings": 128,
    },
    # Gemma 3's text model: norms x * (1 + w) with post-attention / post-feed-forward norms,
    # q/k norms, gelu_pytorch_tanh, embeddings scaled by sqrt(hidden), query_pre_attn_scalar
    # apart from head_dim, a sliding layer (window 8, its own RoPE base) before a full one, and
    # the final soft-cap set (Gemma 3 releases leave it null; here it moves the logits 6%)
    "gemma3_text": {
        "tie_word_embeddings": False,  # tied random embeddings make every step repeat its input
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 48,
        # transformers 5.24's Gemma3Attention never passes attn_logit_softcapping to its
        # attention function (nor does mlx-lm apply it): set, it would move nothing
        "attn_logit_softcapping": None,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "pad_token_id": 0,
        # scaled by sqrt(256) = 16 on the way in: std 0.8 there, like the layers' outputs
        "embed_std": 0.05,
    },
    # Gemma 2: Gemma 3's norms, activation, embedding scale and query_pre_attn_scalar, no q/k
    # norms, one RoPE base, Gemma2Config's layer_types (sliding on even layers: layer 0 of
    # 2, window 8), tied embeddings (Gemma 2's; mlx-lm's gemma2 always ties), and both caps
    # small enough to bend this model's scores (std ~1) and logits (std ~1): the attention
    # soft-cap is the feature this fixture is for. Half Gemma 3's widths (hidden 128,
    # intermediate 256; 4 heads of 64 stay): the fixture under 1 MB, and sqrt(128) is no bf16
    "gemma2": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "sliding_window": 8,
        "query_pre_attn_scalar": 48,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "pad_token_id": 0,
        "embed_std": 0.025,
    },
    # Qwen3 with linears that are not whole 128 x 128 blocks (hidden 320, intermediate 416):
    # the block FP8 fixtures' ragged scale blocks
    "qwen3_ragged": {
        "model_type": "qwen3",
        "hidden_size": 320,
        "intermediate_size": 416,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "attention_bias": False,
    },
}


def make(family: str, out: str, dtype: str) -> None:
    torch.manual_seed(0)
    spec = {**COMMON, **FAMILIES[family]}
    embed_std = spec.pop("embed_std", 0.2)
    cfg = AutoConfig.for_model(spec.pop("model_type", family), **spec)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm weights (q_norm/k_norm too)
                spread = 0.3 if ("q_norm" in name or "k_norm" in name) else 0.2
                # Gemma's norms scale by 1 + w (their weights start at 0), the others' by w
                one = 0.0 if cfg.model_type.startswith("gemma") else 1.0
                p.copy_(one + spread * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                p.copy_(embed_std * torch.randn_like(p))
            elif name == "lm_head.weight":
                p.copy_(0.2 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(256)}
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0"
    ).save_pretrained(out)


if __name__ == "__main__":
    make(*sys.argv[1:])
