"""Model architectures as data: what one decoder layer of each family computes, keyed by
config.json's `model_type` (or, without one, its `architectures` class names).

A row of ARCHITECTURES says what a family does always (its norm form and placement, per-head
q/k norms, q/k/v biases, its activation's config key and default, its embedding scale, where its
sliding windows come from, its checkpoint names); `features(ck)` reads the rest from the
checkpoint (biases present as tensors, the activation named, windows per layer, soft-caps, the
attention scale, RoPE) into one `Features` value that the block builder (qir.models.blocks)
follows. Every feature a checkpoint uses is a `Use` naming the config field (or tensor) it comes
from: `qir inspect` prints them, and the builder refuses, in one line naming that field, the
first one it does not implement. Adding a family is a row here plus its tests.

Families this table does not describe are refused by name (REFUSED) or as an unknown model_type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qir.errors import FormatError
from qir.models.checkpoint_view import CheckpointView

# A decoder layer's linears: short name -> module path below model.layers.<i> (Llama's names,
# which most architectures share).
LLAMA_LINEARS: Mapping[str, str] = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Architecture:
    """What a family's decoder layer does whatever its config says (one row of the table)."""

    name: str
    model_types: tuple[str, ...]
    classes: tuple[str, ...]  # config.json "architectures": the transformers classes
    # RMSNorm: "x*w", or Gemma's "x*(1+w)" (weights stored as offsets from 1).
    norm: str = "x*w"
    # Gemma: each block's output is normed again before its residual add (post_attention_layernorm
    # after attention, post_feedforward_layernorm after the MLP; pre_feedforward_layernorm before
    # the MLP).
    post_norms: bool = False
    qk_norm: bool = False  # a per-head RMSNorm of q and k (q_norm, k_norm) before RoPE
    # q/k/v always carry biases (Qwen2), whatever attention_bias says (unless qkv_bias is false)
    qkv_bias: bool = False
    # The config keys that may name the MLP activation (the first present wins), and its default.
    activation_keys: tuple[str, ...] = ("hidden_act",)
    activation: str = "silu"
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    # Where sliding windows come from: "none" (transformers ignores sliding_window), "all"
    # (Mistral: sliding_window, when set, on every layer), "qwen" (only with use_sliding_window:
    # layer_types, or the layers from max_window_layers on), "layer_types" (Gemma: layer_types,
    # or every sliding_window_pattern-th layer full), "types" (gpt-oss: layer_types, or sliding
    # and full alternating from a sliding layer 0, as GptOssConfig fills it).
    sliding: str = "none"
    # Gemma: query_pre_attn_scalar, where set, is the attention scale's (its -1/2 power).
    attn_scalar: bool = False
    # Gemma 3: sliding layers rotate by a RoPE base of their own (rope_local_base_freq).
    local_rope: bool = False
    # Gemma 2: attn_logit_softcapping caps attention scores (transformers' Gemma 3 ignores it).
    attn_softcap: bool = False
    # What the family's transformers config class fills in for keys config.json lacks (an
    # explicit null stays null: "off" for the soft-caps and the window).
    defaults: Mapping[str, Any] = field(default_factory=dict)
    linears: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_LINEARS))
    # Checkpoint linears holding several of the above, stacked along out_features (Phi-3:
    # qkv_proj = q, k, v; gate_up_proj = gate, up): path -> the short names it holds, in order.
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Routed experts in place of the MLP: where they live is a row of qir.models.experts'
    # MOE_ARCHITECTURES; without it, a config that counts experts is refused.
    experts: bool = False
    sinks: bool = False  # gpt-oss: a learned logit per head (self_attn.sinks) in attention
    # GGUF files (llama.cpp; qir.models.gguf_config): the general.architecture names of the
    # family's files (a row with `experts` takes those whose expert_count is positive);
    # whether llama.cpp's converter permuted the rows of q and k for its adjacent-pair RoPE
    # (qir un-permutes them); the config keys llama.cpp hard-codes for the family rather than
    # reading them from the file; the activation dtype (llama.cpp computes in float32: float16
    # unless the family's activations need bfloat16's range).
    gguf: tuple[str, ...] = ()
    gguf_permuted_qk: bool = False
    gguf_defaults: Mapping[str, Any] = field(default_factory=dict)
    gguf_act: str = "float16"


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "llama", ("llama",), ("LlamaForCausalLM",), gguf=("llama",), gguf_permuted_qk=True
    ),
    Architecture("mistral", ("mistral",), ("MistralForCausalLM",), sliding="all"),
    Architecture(
        "qwen2", ("qwen2",), ("Qwen2ForCausalLM",), qkv_bias=True, sliding="qwen", gguf=("qwen2",)
    ),
    Architecture(
        "qwen3", ("qwen3",), ("Qwen3ForCausalLM",), qk_norm=True, sliding="qwen", gguf=("qwen3",)
    ),
    Architecture(
        "mixtral",
        ("mixtral",),
        ("MixtralForCausalLM",),
        sliding="all",
        experts=True,
        gguf=("llama",),  # llama.cpp converts Mixtral as a llama with ffn_*_exps
        gguf_permuted_qk=True,
    ),
    Architecture(
        "qwen3_moe",
        ("qwen3_moe",),
        ("Qwen3MoeForCausalLM",),
        qk_norm=True,
        sliding="qwen",
        experts=True,
        gguf=("qwen3moe",),
    ),
    Architecture(
        "qwen2_moe",
        ("qwen2_moe",),
        ("Qwen2MoeForCausalLM",),
        qkv_bias=True,
        sliding="qwen",
        experts=True,
        gguf=("qwen2moe",),
    ),
    Architecture(
        "gpt_oss",
        ("gpt_oss",),
        ("GptOssForCausalLM",),
        sliding="types",
        experts=True,
        sinks=True,
        gguf=("gpt-oss",),
    ),
    Architecture(
        "phi3",
        ("phi3",),
        ("Phi3ForCausalLM",),
        sliding="all",
        fused={"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")},
        # Phi3Config's, which overrides rope_scaling's own for longrope
        defaults={"original_max_position_embeddings": 4096},
        gguf=("phi3",),
    ),
    Architecture(
        "gemma2",
        ("gemma2",),
        ("Gemma2ForCausalLM",),
        norm="x*(1+w)",
        post_norms=True,
        activation_keys=("hidden_activation", "hidden_act"),
        activation="gelu_pytorch_tanh",
        embed_scale=True,
        sliding="layer_types",
        attn_scalar=True,
        attn_softcap=True,
        defaults={
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "sliding_window_pattern": 2,  # layer_types' default: even layers slide
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        gguf=("gemma2",),
        gguf_act="bfloat16",
    ),
    Architecture(
        "gemma3",
        ("gemma3_text",),
        ("Gemma3ForCausalLM",),
        norm="x*(1+w)",
        post_norms=True,
        qk_norm=True,
        activation_keys=("hidden_activation", "hidden_act"),
        activation="gelu_pytorch_tanh",
        embed_scale=True,
        sliding="layer_types",
        attn_scalar=True,
        local_rope=True,
        defaults={"query_pre_attn_scalar": 256, "sliding_window": 4096},
        gguf=("gemma3",),
        # llama.cpp's Gemma 3: every 6th layer global, sliding layers at RoPE base 10000
        gguf_defaults={"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
        gguf_act="bfloat16",
    ),
)

# Families qir knows it cannot run: model_type -> (the config field that says why, what).
REFUSED: Mapping[str, tuple[str, str]] = {
    "gemma3n": ("model_type", "Gemma 3n's per-layer inputs"),
    "qwen3_next": ("layer_types", "Qwen3-Next's linear-attention layers"),
    "qwen3_5": ("layer_types", "Qwen3.5's linear-attention layers"),
    "deepseek_v2": ("kv_lora_rank", "DeepSeek's multi-head latent attention (MLA)"),
    "deepseek_v3": ("kv_lora_rank", "DeepSeek's multi-head latent attention (MLA)"),
}
# Config fields whose presence (a positive count) means mixture-of-experts layers.
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")

BY_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.model_types}
BY_CLASS = {c: a for a in ARCHITECTURES for c in a.classes}

# What each feature is, for refusals and `qir inspect`.
FEATURES: Mapping[str, str] = {
    "bias": "linear biases",
    "qk_norm": "per-head q/k RMSNorm",
    "activation": "MLP activation",  # not a Use of its own: Features.activation
    "norm_plus_one": "RMSNorm as x * (1 + w)",
    "post_norms": "norms before the residual adds",
    "embed_scale": "embedding scale",
    "attention_scale": "attention scale",
    "attn_softcap": "attention logit soft-capping",
    # set in a family whose reference never applies it (Gemma 3): refused, not guessed either way
    "attn_softcap_unused": "attention logit soft-capping, which this family's transformers "
    "code does not apply",
    "final_softcap": "final logit soft-capping",
    "sliding_window": "sliding-window attention",
    "local_rope": "a RoPE base of its own for sliding layers",
    "fused_linears": "fused projections",
    "sinks": "attention sinks",
}


@dataclass(frozen=True)
class Use:
    """One feature a checkpoint uses, with the config field (or tensor) it comes from."""

    feature: str  # a key of FEATURES
    where: str  # config field or tensor name
    value: Any

    def __str__(self) -> str:
        return f"{FEATURES[self.feature]} ({self.where} {self.value!r})"

    def refusal(self) -> str:
        return f"{self.where} {self.value!r} ({FEATURES[self.feature]}) is not supported"


@dataclass(frozen=True)
class Features:
    """What a checkpoint's decoder layers compute: its architecture's row, resolved against its
    config and tensors."""

    arch: Architecture
    activation: Use  # its value is the activation's name
    biases: tuple[str, ...]  # short names of the layer linears that carry a `bias` tensor
    windows: tuple[int | None, ...]  # per layer: its sliding window (keys seen), or None
    attention_scale: float
    uses: tuple[Use, ...]

    def used(self, feature: str) -> bool:
        return any(u.feature == feature for u in self.uses)

    def value(self, feature: str) -> Any:
        """The value of `feature`'s Use (a soft-cap), or None where it is not used."""
        return next((u.value for u in self.uses if u.feature == feature), None)

    def unsupported(self, supported: frozenset[str]) -> Use | None:
        """The first feature in use outside `supported`, or None."""
        return next((u for u in self.uses if u.feature not in supported), None)

    def describe(self) -> list[str]:
        """Lines for `qir inspect`."""
        a = self.arch
        lines = [f"architecture: {a.name} ({', '.join(a.classes)})"]
        lines.append(f"  RMSNorm {a.norm}, {'pre- and post-norms' if a.post_norms else 'pre-norm'}")
        lines.append(f"  {self.activation}")
        lines.extend(f"  {u}" for u in self.uses)
        return lines


def segment_rows(ck: CheckpointView, short: str) -> int:
    """Rows of a layer linear (q, k, v, gate, up) within a fused one."""
    sizes = {
        "q": ck.num_heads * ck.head_dim,
        "k": ck.num_kv_heads * ck.head_dim,
        "v": ck.num_kv_heads * ck.head_dim,
    }
    return sizes.get(short, ck.intermediate_size)


def architecture_of(config: Mapping[str, Any], where: str) -> Architecture:
    """The row of ARCHITECTURES for config.json, or a one-line refusal naming the field."""
    model_type = config.get("model_type")
    if isinstance(model_type, str):
        if model_type in REFUSED:
            key, what = REFUSED[model_type]
            raise FormatError(
                f"{where}: model_type {model_type!r}: {what} is not supported ({key})"
            )
        if model_type not in BY_MODEL_TYPE:
            raise FormatError(
                f"{where}: model_type {model_type!r} is not supported (supported: "
                f"{', '.join(sorted(BY_MODEL_TYPE))})"
            )
        return BY_MODEL_TYPE[model_type]
    classes = config.get("architectures") or []
    for c in classes:
        if c in BY_CLASS:
            return BY_CLASS[c]
    if classes:
        raise FormatError(f"{where}: architectures {classes!r} are not supported")
    raise FormatError(f"{where}: names no model_type or architectures (the model's family)")


def architecture_field(arch: Architecture, ck: CheckpointView, key: str) -> Any:
    """config.json's `key`; where it has no such key, the family's default (Architecture.defaults)
    or else config_fields' (an explicit null stays null)."""
    if key in ck.config or key not in arch.defaults:
        return ck.field(key)
    return arch.defaults[key]


def _windows(arch: Architecture, ck: CheckpointView) -> tuple[list[int | None], str]:
    """The sliding window of each layer and the config field it comes from."""
    n, window = ck.num_layers, architecture_field(arch, ck, "sliding_window")
    none: list[int | None] = [None] * n
    if arch.sliding == "none" or not window:  # None, or transformers 5's 0 for none
        return none, ""
    if arch.sliding == "all":
        return [window] * n, "sliding_window"
    types = ck.field("layer_types")
    if types is not None and len(types) != n:
        raise FormatError(
            f"{ck.path}/config.json: layer_types has {len(types)} entries for "
            f"{n} layers (num_hidden_layers)"
        )
    if arch.sliding == "qwen":
        if not ck.field("use_sliding_window"):
            return none, ""
        if types is None:
            first = ck.field("max_window_layers")
            return [window if i >= first else None for i in range(n)], "max_window_layers"
    elif types is None and arch.sliding == "types":  # gpt-oss: every other layer
        return [None if i % 2 else window for i in range(n)], "sliding_window"
    elif types is None:  # Gemma: every pattern-th layer is a full one
        pattern = architecture_field(arch, ck, "sliding_window_pattern")
        return [window if (i + 1) % pattern else None for i in range(n)], "sliding_window_pattern"
    return [window if t == "sliding_attention" else None for t in types], "layer_types"


def features(ck: CheckpointView) -> Features:
    """The features of `ck`'s decoder layers; refuses (naming the field) what the table cannot
    describe: an unknown or refused family, mixture-of-experts layers, an unknown layer type."""
    where = f"{ck.path}/config.json"
    arch = architecture_of(ck.config, where)
    for key in EXPERT_FIELDS:
        if ck.field(key) and not arch.experts:
            raise FormatError(
                f"{where}: {key} {ck.field(key)!r}: mixture-of-experts layers are not supported"
            )
    uses: list[Use] = []
    act_key = next((k for k in arch.activation_keys if ck.field(k) is not None), None)
    # Absent: the family's default, as transformers' config class fills it in.
    activation = Use(
        "activation",
        act_key or arch.activation_keys[0],
        ck.field(act_key) if act_key else arch.activation,
    )
    for path, parts in arch.fused.items():  # the family's checkpoints hold them so
        uses.append(Use("fused_linears", f"model.layers.0.{path}", "+".join(parts)))
    if arch.norm != "x*w":
        uses.append(Use("norm_plus_one", "model_type", ck.field("model_type")))
    if arch.post_norms:
        uses.append(Use("post_norms", "model_type", ck.field("model_type")))
    if arch.qk_norm:
        uses.append(Use("qk_norm", "model_type", ck.field("model_type")))
    biases = []
    for short, path in arch.linears.items():
        name = f"model.layers.0.{path}.bias"
        if name in ck.store:
            biases.append(short)
    # Qwen2-MoE's config may turn its q/k/v biases off (transformers 5's qkv_bias)
    qkv_bias = arch.qkv_bias and ck.field("qkv_bias") is not False
    if qkv_bias or ck.field("attention_bias"):
        why = "model_type" if qkv_bias else "attention_bias"
        want = ("q", "k", "v") if qkv_bias else ("q", "k", "v", "o")
        missing = [s for s in want if s not in biases and not _fused_holds(arch, s, ck)]
        if missing:
            name = f"model.layers.0.{arch.linears[missing[0]]}.bias"
            raise FormatError(f"{name}: missing ({why} {ck.field(why)!r} implies it)")
    if ck.field("mlp_bias"):
        missing = [s for s in ("gate", "up", "down") if s not in biases]
        if missing:
            name = f"model.layers.0.{arch.linears[missing[0]]}.bias"
            raise FormatError(f"{name}: missing (mlp_bias true implies it)")
    if biases:
        where_bias = f"model.layers.0.{arch.linears[biases[0]]}.bias"
        uses.append(Use("bias", where_bias, ",".join(biases)))
    if arch.embed_scale:
        uses.append(Use("embed_scale", "model_type", ck.field("model_type")))
    if arch.sinks:
        uses.append(Use("sinks", "model.layers.0.self_attn.sinks", f"[{ck.num_heads}]"))
    scale = float(ck.head_dim) ** -0.5
    scalar = architecture_field(arch, ck, "query_pre_attn_scalar")
    if scalar is not None and arch.attn_scalar:
        scale = float(scalar) ** -0.5
        uses.append(Use("attention_scale", "query_pre_attn_scalar", scalar))
    for key, feature in (
        ("attn_logit_softcapping", "attn_softcap" if arch.attn_softcap else "attn_softcap_unused"),
        ("final_logit_softcapping", "final_softcap"),
    ):
        cap = architecture_field(arch, ck, key)
        if cap is not None:
            uses.append(Use(feature, key, float(cap)))
    windows, window_key = _windows(arch, ck)
    types = ck.field("layer_types") or []
    unknown = sorted({t for t in types} - {"sliding_attention", "full_attention"})
    if unknown and arch.sliding in ("qwen", "layer_types", "types"):
        raise FormatError(f"{where}: layer_types {unknown[0]!r} is not supported")
    if any(w is not None for w in windows):
        sliding = sum(w is not None for w in windows)
        uses.append(
            Use(
                "sliding_window",
                "sliding_window" if window_key == "sliding_window" else window_key,
                f"{architecture_field(arch, ck, 'sliding_window')} on {sliding} of {len(windows)} layers",
            )
        )
        per_type = ck.field("rope_parameters")
        if isinstance(per_type, dict) and isinstance(per_type.get("sliding_attention"), dict):
            theta = per_type["sliding_attention"].get("rope_theta")
            uses.append(Use("local_rope", "rope_parameters.sliding_attention.rope_theta", theta))
        elif arch.local_rope:
            # Gemma 3's sliding layers rotate by their own base, transformers' default without one
            base = ck.field("rope_local_base_freq") or 10000.0
            uses.append(Use("local_rope", "rope_local_base_freq", base))
    return Features(arch, activation, tuple(biases), tuple(windows), scale, tuple(uses))


def _fused_holds(arch: Architecture, short: str, ck: CheckpointView) -> bool:
    """Whether a fused checkpoint linear that holds `short` carries a bias."""
    return any(
        short in parts and f"model.layers.0.{path}.bias" in ck.store
        for path, parts in arch.fused.items()
    )
