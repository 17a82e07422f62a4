"""A GGUF file's model as a checkpoint's: its metadata keys read into the config.json fields
qir reads (qir.models.config_fields), and its tensor names into the Hugging Face names the
block builder reads, for the families of qir.models.architectures whose row names GGUF
architectures (`Architecture.gguf`).

Keys are llama.cpp's (gguf-py `Keys`, `{arch}.` prefixed): embedding_length, block_count,
feed_forward_length, attention.head_count(_kv), attention.key_length / value_length,
attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count, rope.scaling.*,
context_length, attention.sliding_window, the soft-caps and the expert counts. What llama.cpp
hard-codes rather than reads is the family's `gguf_defaults` (Gemma 3's sliding pattern of 6
and local RoPE base), and, for Gemma, the attention scale llama.cpp uses: 1/sqrt(head_dim),
or 1/sqrt(hidden / heads) for the 27B models (46 layers for Gemma 2, 62 for Gemma 3).

RoPE: `rope_freqs.weight` (Llama 3.1's scaling, stored by the converter as a divisor per
frequency) and Phi-3's `rope_factors_long/short.weight` are LongRoPE's per-frequency factors
(qir.rope); rope.scaling.type linear and yarn map to rope_scaling. A rotation over fewer
dimensions than the head (rope.dimension_count) is refused when a block is built.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from qir.errors import FormatError
from qir.models.architectures import ARCHITECTURES, Architecture
from qir.models.experts import MOE_ARCHITECTURES
from qir.models.gguf_io import ARRAY, SCALARS, STRING, GGUFModel

_INTS = tuple(t for t, (name, _, _) in SCALARS.items() if name[0] in "ui")
_FLOATS = (6, 12)
BY_GGUF: dict[tuple[str, bool], Architecture] = {
    (g, a.experts): a for a in ARCHITECTURES for g in a.gguf
}
# GGUF layer tensors (blk.<i>.<name>) -> Hugging Face module paths below model.layers.<i>.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_sinks": "self_attn.sinks",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that are not weights of a module: what they say goes into the config.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def architecture(model: GGUFModel) -> tuple[str, Architecture]:
    """The GGUF architecture name and qir's row for it, or a refusal naming the key."""
    name = model.value("general.architecture", STRING)
    if name is None:
        raise FormatError(f"{model.path}: no general.architecture (the model's family)")
    count = model.value(f"{name}.expert_count", *_INTS) or 0
    arch = BY_GGUF.get((name, count > 0))
    if arch is None:
        known = sorted({g for g, _ in BY_GGUF})
        what = f" with {count} experts ({name}.expert_count)" if count else ""
        raise FormatError(
            f"{model.path}: general.architecture {name!r}{what} is not supported "
            f"(supported: {', '.join(known)})"
        )
    return name, arch


def module_names(arch: Architecture) -> dict[str, str]:
    """The Hugging Face module path of each GGUF layer tensor name, for `arch`."""
    names = dict(LAYER_NAMES)
    if arch.post_norms:  # Gemma: ffn_norm is the norm before the MLP
        names["ffn_norm"] = "pre_feedforward_layernorm"
    if "mlp.gate_up_proj" in arch.fused:  # Phi-3: ffn_up holds gate then up
        names["ffn_up"] = "mlp.gate_up_proj"
    moe = MOE_ARCHITECTURES.get(arch.model_types[0])
    if moe is not None:
        names["ffn_gate_inp"] = moe.router
        for proj in ("gate", "up", "down"):
            names[f"ffn_{proj}_exps"] = moe.stacked.format(w=f"{proj}_proj")
    return names


def hf_name(name: str, names: dict[str, str]) -> str | None:
    """A GGUF tensor's Hugging Face name, or None for one the model does not read as a
    module's (rope_freqs, unknown names)."""
    m = _LAYER.match(name)
    if m is not None:
        module = names.get(m[2])
        return None if module is None else f"model.layers.{m[1]}.{module}.{m[3]}"
    stem, _, suffix = name.rpartition(".")
    module = TOP_NAMES.get(stem)
    return None if module is None else f"{module}.{suffix}"


class _Keys:
    """Typed reads of `{arch}.` metadata keys, refusals naming the key."""

    def __init__(self, model: GGUFModel, prefix: str) -> None:
        self.model, self.prefix = model, prefix

    def get(
        self, key: str, vtypes: tuple[int, ...], check: Callable[[Any], bool], want: str
    ) -> Any:
        full = f"{self.prefix}.{key}"
        value = self.model.value(full, *vtypes)
        if value is not None and not check(value):
            raise FormatError(f"{self.model.path}: {full} is {value!r}, expected {want}")
        return value

    def int(self, key: str, at_least: int = 1, required: bool = False) -> int | None:
        full = f"{self.prefix}.{key}"
        if full in self.model.metadata and self.model.types[full][0] == ARRAY:
            raise FormatError(
                f"{self.model.path}: {full} is an array (a value per layer), which qir does "
                "not support"
            )
        value = self.get(key, _INTS, lambda v: v >= at_least, f"an integer >= {at_least}")
        if value is None and required:
            raise FormatError(f"{self.model.path}: no {full} (the model needs it)")
        return None if value is None else int(value)

    def float(self, key: str) -> float | None:
        value = self.get(key, _FLOATS, lambda v: np.isfinite(v) and v > 0, "a positive number")
        return None if value is None else float(value)


def config(model: GGUFModel) -> tuple[dict[str, Any], Architecture]:
    """The config.json qir would read for the model in `model`, and its architecture row."""
    name, arch = architecture(model)
    k = _Keys(model, name)
    cfg: dict[str, Any] = {
        "model_type": arch.model_types[0],
        "architectures": [arch.classes[0]],
        "torch_dtype": arch.gguf_act,
        "hidden_size": k.int("embedding_length", required=True),
        "num_hidden_layers": k.int("block_count", required=True),
        "num_attention_heads": k.int("attention.head_count", required=True),
    }
    heads = cfg["num_attention_heads"]
    kv = k.int("attention.head_count_kv")
    cfg["num_key_value_heads"] = kv or heads
    head_dim = k.int("attention.key_length")
    value_dim = k.int("attention.value_length")
    if head_dim is not None and value_dim not in (None, head_dim):
        raise FormatError(
            f"{model.path}: {name}.attention.value_length {value_dim} differs from "
            f"{name}.attention.key_length {head_dim}, which qir does not support"
        )
    head_dim = head_dim or cfg["hidden_size"] // heads
    cfg["head_dim"] = head_dim
    ff = k.int("feed_forward_length", at_least=0)
    moe_ff = k.int("expert_feed_forward_length")
    cfg["intermediate_size"] = ff or moe_ff or cfg["hidden_size"]
    cfg["rms_norm_eps"] = k.float("attention.layer_norm_rms_epsilon")
    cfg["rope_theta"] = k.float("rope.freq_base") or 10000.0
    cfg["max_position_embeddings"] = k.int("context_length")
    rot = k.int("rope.dimension_count")
    if rot is not None and rot != head_dim:
        cfg["partial_rotary_factor"] = rot / head_dim
    if "token_embd.weight" not in model:
        raise FormatError(f"{model.path}: no tensor 'token_embd.weight' (the embedding)")
    cfg["vocab_size"] = int(model.info("token_embd.weight").ne[-1])
    cfg["tie_word_embeddings"] = "output.weight" not in model
    rope = _rope_scaling(model, k, head_dim)
    if rope:
        cfg["rope_scaling"] = rope
    window = k.int("attention.sliding_window", at_least=0)
    if window and arch.sliding != "qwen":  # llama.cpp's Qwen2/3 slide nowhere
        cfg["sliding_window"] = window
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = k.float(key)
        if cap is not None:
            cfg[key] = cap
    if arch.attn_scalar:  # Gemma's attention scale as llama.cpp computes it
        big = {"gemma2": 46, "gemma3": 62}.get(name) == cfg["num_hidden_layers"]
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // heads if big else head_dim
    if arch.experts:
        experts = k.int("expert_count", required=True)
        cfg["num_experts" if arch.model_types[0] != "mixtral" else "num_local_experts"] = experts
        if arch.model_types[0] == "gpt_oss":
            cfg["num_local_experts"] = experts
        cfg["num_experts_per_tok"] = k.int("expert_used_count", required=True)
        cfg["moe_intermediate_size"] = moe_ff or ff
        # llama.cpp renormalises the chosen experts' weights of Qwen3-MoE (transformers'
        # norm_topk_prob) unless the file says otherwise
        norm = model.value(f"{name}.expert_weights_norm", 7)
        cfg["norm_topk_prob"] = True if norm is None else bool(norm)
        shared = k.int("expert_shared_feed_forward_length")
        if shared:
            cfg["shared_expert_intermediate_size"] = shared
    for key, value in arch.gguf_defaults.items():
        cfg.setdefault(key, value)
    base_swa = k.float("rope.freq_base_swa")
    if base_swa is not None and arch.local_rope:
        cfg["rope_local_base_freq"] = base_swa
    cfg.update(_tokens(model))
    return cfg, arch


def _rope_scaling(model: GGUFModel, k: _Keys, head_dim: int) -> dict[str, Any]:
    """rope_scaling of the file: its per-frequency factor tensors, else rope.scaling.*."""
    half = head_dim // 2
    factors = {}
    for name in ROPE_TENSORS:
        if name in model:
            t = model.get(name)
            if t.dtype != np.float32 or t.shape != (half,):
                raise FormatError(
                    f"{model.path}: tensor {name!r} is {t.dtype} {list(t.shape)}, expected "
                    f"float32 [{half}] (head_dim / 2)"
                )
            factors[name] = [float(f) for f in t]
    attn = k.float("rope.scaling.attn_factor")
    original = k.int("rope.scaling.original_context_length")
    if "rope_freqs.weight" in factors:  # Llama 3.1: divisors of the frequencies, no scale
        f = factors["rope_freqs.weight"]
        return {"rope_type": "longrope", "short_factor": f, "long_factor": f, "factor": 1.0,
                "attention_factor": 1.0}  # fmt: skip
    if factors:
        long = factors.get("rope_factors_long.weight")
        short = factors.get("rope_factors_short.weight", long)
        out: dict[str, Any] = {
            "rope_type": "longrope",
            "short_factor": short,
            "long_factor": long or short,
        }
        if attn is not None:
            out["attention_factor"] = attn
        if original is not None:
            out["original_max_position_embeddings"] = original
        return out
    kind = k.get("rope.scaling.type", (STRING,), lambda v: True, "")
    factor = k.float("rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return {}
    if kind not in ("linear", "yarn"):
        raise FormatError(
            f"{model.path}: {k.prefix}.rope.scaling.type {kind!r} is not supported (linear, yarn)"
        )
    out = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        if original is not None:
            out["original_max_position_embeddings"] = original
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            v = k.float(f"rope.scaling.{key}")
            if v is not None:
                out[hf] = v
        if attn is not None:
            out["attention_factor"] = attn
    return out


# Tokens llama.cpp ends a generation at by their text (llama-vocab.cpp's EOG list), which it
# makes control tokens whatever their token_type.
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "_<EOT>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's
    "<|return|>",
    "<|call|>",
)


def _tokens(model: GGUFModel) -> dict[str, Any]:
    """bos_token_id and eos_token_id (every id that ends a generation, as llama.cpp has them:
    eos, eot, eom and the tokens it knows by their text)."""
    out: dict[str, Any] = {}
    ids = {}
    for which in ("bos", "eos", "eot", "eom"):
        v = model.value(f"tokenizer.ggml.{which}_token_id", *_INTS)
        if v is not None:
            ids[which] = int(v)
    if "bos" in ids:
        out["bos_token_id"] = ids["bos"]
    eog = {ids[w] for w in ("eos", "eot", "eom") if w in ids}
    tokens = model.value("tokenizer.ggml.tokens", ARRAY)
    if tokens is not None:
        eog |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    if eog:
        out["eos_token_id"] = sorted(eog)
    return out
