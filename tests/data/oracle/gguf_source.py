"""Tiny random Hugging Face models converted to GGUF by llama.cpp's own convert_hf_to_gguf.py:
`python gguf_source.py CONVERT_DIR OUT_DIR [FAMILY ...]` (torch 2.13.0+cpu, transformers 5.25,
sentencepiece, tokenizers; CONVERT_DIR is llama.cpp's convert_hf_to_gguf.py with its
conversion/ and gguf-py/ beside it, as vendored by llama-cpp-python 0.3.36's sdist).

Each family is one decoder layer of widths that are multiples of 256 (hidden 256, every MLP and
expert 256), so llama-quantize's K-quants apply to every matrix; linears N(0, 1/in), embeddings
and lm_head N(0, 0.2^2) (Gemma's embeddings 0.05: it scales them by 16), norms and biases
randomised so each moves the logits. OUT_DIR/<family>/hf holds the source model (not
committed), OUT_DIR/<family>/model-F16.gguf the converter's output (`--outtype f16`: matrices
F16, vectors F32).

Tokenizers are trained here on a few paragraphs of text (no downloads):
- a byte-level BPE of 320 ids (tokenizers' BpeTrainer, the GPT-2 byte alphabet, specials
  <|endoftext|>, <|im_start|>, <|im_end|>) for llama, qwen2, qwen3 and qwen3moe. The converter
  names a BPE pre-tokenizer by hashing its output on a probe text, which knows only released
  tokenizers: `get_vocab_base_pre` is replaced to name llama.cpp's own: llama-bpe (llama), qwen2
  (the Qwens);
- a SentencePiece BPE of 384 pieces with byte fallback (sentencepiece's trainer; user-defined
  <|im_start|>, <|im_end|>) for phi3 and gemma3, which the converter reads from
  tokenizer.model.

Config choices that keep the three references on one model (llama.cpp hard-codes what the
file does not say): Gemma 3 with head_dim 256 (llama.cpp scales attention by head_dim^-1/2,
transformers' GGUF loader by query_pre_attn_scalar, default 256), a sliding window of 8 on its
layer 0 (sliding by the pattern of 6 all three use) and RoPE local base 10000; Qwen3-MoE with
norm_topk_prob true (llama.cpp renormalises; transformers' GGUF loader does not read it, so
gguf_goldens.py passes it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

TEXT = """The quick brown fox jumps over the lazy dog. Numbers like 12345 and 3.14159 appear
in text, as do names: Alice, Bob and Charlie went to Paris in 2024. Code has tabs\tand
    indented lines, def f(x): return x * 2, and symbols {}[]()<>!?@#$%^&*.
Le café est très bon. Über Straßen fahren Autos. 日本語のテキストも少しある。
A tokenizer learns which pieces of text come often: the, and, of, to, in, is, that, it.
Once upon a time there was a small model that answered questions about capitals.
What is the capital of France? The capital of France is Paris.
"""
SPM_VOCAB = 384
COMMON = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "llama": ("bpe", "llama-bpe", {"model_type": "llama", "rope_theta": 10000.0}),
    "qwen2": ("bpe", "qwen2", {"model_type": "qwen2", "rope_theta": 1e6, "tie_word_embeddings": True}),
    "qwen3": ("bpe", "qwen2", {"model_type": "qwen3", "rope_theta": 1e6}),
    "qwen3moe": (
        "bpe",
        "qwen2",
        {
            "model_type": "qwen3_moe",
            "rope_theta": 1e6,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
        },
    ),
    "phi3": ("spm", None, {"model_type": "phi3", "rope_theta": 10000.0, "sliding_window": 2047, "pad_token_id": 0}),
    "gemma3": (
        "spm",
        None,
        {
            "model_type": "gemma3_text",
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "rope_theta": 1e6,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 8,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "pad_token_id": 0,
        },
    ),
}  # fmt: skip


def bpe_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token=None
    ).save_pretrained(out)


def spm_tokenizer(out: Path) -> None:
    import sentencepiece as spm

    text = out / "text.txt"
    text.write_text(TEXT * 4)
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(out / "tokenizer"),
        model_type="bpe",
        vocab_size=SPM_VOCAB,
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        hard_vocab_limit=False,
        bos_id=1,
        eos_id=2,
        unk_id=0,
    )
    text.unlink()
    (out / "tokenizer.vocab").unlink()


def make(family: str, out: Path, convert: Path) -> Path:
    kind, pre, spec = FAMILIES[family]
    if kind == "spm":  # 256 byte pieces, the text's characters, a few merges
        spec = {**spec, "vocab_size": SPM_VOCAB}
    hf = out / family / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    spec = {**COMMON, **spec}
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    gemma = cfg.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                p.copy_((0.05 if gemma else 0.2) * torch.randn_like(p))
            elif name == "lm_head.weight":
                p.copy_(0.2 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model.save_pretrained(hf, safe_serialization=True)
    (bpe_tokenizer if kind == "bpe" else spm_tokenizer)(hf)
    gguf = out / family / "model-F16.gguf"
    # The converter, its pre-tokenizer hash replaced by the name chosen above (module doc).
    patch = (
        "import sys, runpy; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py'];"
        "import conversion.base as b;"
        f"b.TextModel.get_vocab_base_pre = lambda self, tok: {pre!r};"
        "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py'] + sys.argv[2:];"
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    cmd = [sys.executable, "-c", patch, str(convert), str(hf), "--outtype", "f16"]
    subprocess.run([*cmd, "--outfile", str(gguf)], check=True)
    return gguf


if __name__ == "__main__":
    convert, out = Path(sys.argv[1]), Path(sys.argv[2])
    for family in sys.argv[3:] or FAMILIES:
        print(make(family, out, convert))
