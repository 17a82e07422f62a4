"""The config.json fields qir reads, with their types and ranges: one table, checked whole when a
checkpoint is opened, so every command (`inspect` as much as `run`) refuses the same bad value
with the same one-line error before anything uses it.

To read a new field, add a `Field` to FIELDS and read it with `Checkpoint.field(key)` (which
returns the entry's default when the field is absent or null); nothing else needs code. Keys are
dotted paths into config.json; `*` stands for every key of an object (config groups, mlx-lm's
per-module overrides). An entry applies wherever its parent object exists: a path through a
missing or non-object value is skipped (the parent's own entry, if any, checks its type).
`null` means absent everywhere, as Hugging Face configs write it.

The quantization entries check what the quantization conventions' matchers and readers look at
(types and plain ranges); whether qir supports a value (AWQ 3-bit, an MLX mode) stays with the
convention, which refuses it as "not supported: ...". ModelOpt's hf_quant_config.json is checked
as the `hf_quant_config` object it is folded into.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from qir.errors import FormatError

_KINDS: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list",
    dict: "an object",
}


@dataclass(frozen=True)
class Field:
    key: str  # dotted path; "*" matches every key of an object
    kind: type  # int, float (an integer is a number too), str, bool, list or dict
    required: bool = False  # present and not null wherever its parent object is
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    choices: tuple[Any, ...] | None = None
    items: type | None = None  # a list's element kind
    default: Any = None  # what Checkpoint.field returns when the field is absent or null

    def expected(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        what = _KINDS[self.kind]
        if self.items is not None:
            what += " of " + _KINDS[self.items].split(" ", 1)[1] + "s"
        bounds = [(">=", self.at_least), (">", self.above), ("<=", self.at_most)]
        return " ".join([what, *(f"{op} {b:g}" for op, b in bounds if b is not None)])

    def accepts(self, value: Any) -> bool:
        if self.choices is not None:
            return any(type(value) is type(c) and value == c for c in self.choices)
        if not _is(value, self.kind):
            return False
        if self.items is not None and not all(_is(v, self.items) for v in value):
            return False
        return (
            (self.at_least is None or value >= self.at_least)
            and (self.above is None or value > self.above)
            and (self.at_most is None or value <= self.at_most)
        )


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return type(value) in (int, float)
    if kind in (int, bool):
        return type(value) is kind  # True is no integer, 4.0 no integer
    return isinstance(value, kind)


def _int(key: str, **range_: Any) -> Field:
    return Field(key, int, **range_)


# One quantization section: HF's quantization_config (AWQ, GPTQ, compressed-tensors, ModelOpt,
# mlx-lm) or the `quantization` object of ModelOpt's hf_quant_config.json.
_SECTION: tuple[Field, ...] = (
    Field("quant_method", str),
    Field("quant_algo", str),  # ModelOpt
    _int("bits", at_least=1),
    _int("group_size", at_least=-1),  # GPTQ's -1: one group per row
    Field("version", str),
    Field("format", str),
    Field("checkpoint_format", str),
    Field("model_file_base_name", str),  # auto-gptq's file name
    Field("zero_point", bool),
    Field("modules_to_not_convert", list, items=str),
    Field("ignore", list, items=str),
    Field("exclude_modules", list, items=str),
    Field("quantization_status", str),
    Field("mode", str),
    # compressed-tensors config groups (ModelOpt writes them too)
    Field("config_groups", dict),
    Field("config_groups.*", dict),
    Field("config_groups.*.format", str),
    Field("config_groups.*.targets", list, items=str),
    *(
        field
        for side in ("weights", "input_activations")
        for field in (
            Field(f"config_groups.*.{side}", dict),
            _int(f"config_groups.*.{side}.num_bits", at_least=1),
            _int(f"config_groups.*.{side}.group_size", at_least=-1),  # -1: per channel
            Field(f"config_groups.*.{side}.type", str),
            Field(f"config_groups.*.{side}.strategy", str),
            Field(f"config_groups.*.{side}.symmetric", bool),
        )
    ),
)

FIELDS: tuple[Field, ...] = (
    # the model (checkpoint.Checkpoint's properties)
    _int("hidden_size", required=True, at_least=1),
    _int("intermediate_size", required=True, at_least=1),
    _int("num_hidden_layers", required=True, at_least=1),
    _int("num_attention_heads", required=True, at_least=1),
    _int("num_key_value_heads", at_least=1),  # absent: num_attention_heads
    _int("head_dim", at_least=1),  # absent: hidden_size // num_attention_heads
    Field("torch_dtype", str),  # the activation dtype; transformers 5 writes "dtype"
    Field("dtype", str),
    # a whole layer and model (Checkpoint.rms_norm_eps, .rope, .attention_problem, ...): what a
    # block without attention does not need is not required
    Field("rms_norm_eps", float, above=0),
    _int("vocab_size", at_least=1),
    Field("tie_word_embeddings", bool, default=False),  # transformers' Llama default
    _int("max_position_embeddings", at_least=1),
    _int("original_max_position_embeddings", at_least=1),  # Phi-3's; yarn takes it first
    Field("rope_theta", float, above=0, default=10000.0),  # transformers' Llama default
    Field("partial_rotary_factor", float, above=0),
    *(
        field
        for section in ("rope_scaling", "rope_parameters")  # transformers 5: rope_parameters
        for field in (
            Field(section, dict),
            Field(f"{section}.rope_type", str),
            Field(f"{section}.type", str),  # older spelling of rope_type
            Field(f"{section}.rope_theta", float, above=0),
            Field(f"{section}.factor", float, above=0),
            Field(f"{section}.low_freq_factor", float, above=0),
            Field(f"{section}.high_freq_factor", float, above=0),
            _int(f"{section}.original_max_position_embeddings", at_least=1),
            Field(f"{section}.partial_rotary_factor", float, above=0),
            # longrope (Phi-3's LongRoPE; "su" in older configs)
            Field(f"{section}.short_factor", list, items=float),
            Field(f"{section}.long_factor", list, items=float),
            Field(f"{section}.attention_factor", float, above=0),
            # yarn (gpt-oss: truncate false)
            Field(f"{section}.beta_fast", float, above=0),
            Field(f"{section}.beta_slow", float, above=0),
            Field(f"{section}.truncate", bool),
            Field(f"{section}.mscale", float, above=0),
            Field(f"{section}.mscale_all_dim", float, above=0),
        )
    ),
    _int("original_max_position_embeddings", at_least=1),  # Phi-3's, outside rope_scaling
    # the family (qir.models.architectures) and what its layers use
    Field("model_type", str),
    Field("architectures", list, items=str),
    Field("attention_bias", bool, default=False),
    Field("mlp_bias", bool, default=False),
    # 0: none (transformers 5 writes it so for Qwen2-MoE without use_sliding_window)
    _int("sliding_window", at_least=0),
    Field("use_sliding_window", bool, default=False),  # Qwen2/3's switch (their default)
    _int("max_window_layers", at_least=0, default=28),  # Qwen2/3: sliding from this layer on
    Field("layer_types", list, items=str),
    _int("sliding_window_pattern", at_least=1, default=6),  # Gemma 3 without layer_types
    Field("rope_local_base_freq", float, above=0),  # Gemma 3's sliding layers' RoPE base
    Field("query_pre_attn_scalar", float, above=0),
    Field("attn_logit_softcapping", float, above=0),
    Field("final_logit_softcapping", float, above=0),
    Field("hidden_act", str),
    Field("hidden_activation", str),
    *(_int(key, at_least=0) for key in ("num_experts", "num_local_experts", "n_routed_experts")),
    # mixture-of-experts layers (qir.models.experts)
    _int("num_experts_per_tok", at_least=1),
    _int("moe_intermediate_size", at_least=1),
    _int("shared_expert_intermediate_size", at_least=1),  # Qwen2-MoE's shared expert
    Field("qkv_bias", bool),  # Qwen2-MoE (transformers 5): its q/k/v biases, default true
    Field("norm_topk_prob", bool),
    _int("decoder_sparse_step", at_least=1, default=1),
    Field("mlp_only_layers", list, items=int),
    # gpt-oss's clamped SwiGLU in its experts
    Field("swiglu_limit", float, above=0),
    Field("swiglu_alpha", float, above=0),
    # where each producer writes its quantization (the conventions' matchers look at these)
    Field("quantization_config", dict),
    Field("quantization", dict),  # mlx-lm
    Field("hf_quant_config", dict),  # ModelOpt's hf_quant_config.json
    Field("hf_quant_config.quantization", dict),
    *(
        replace(f, key=f"{section}.{f.key}")
        for section in ("quantization_config", "hf_quant_config.quantization")
        for f in _SECTION
    ),
    # mlx-lm's parameters: at the top of `quantization` and in its per-module overrides (mlx-lm
    # writes the same dict as quantization_config too)
    *(
        Field(f"{where}.{key}", kind, at_least=low)
        for where in ("quantization", "quantization.*", "quantization_config.*")
        for key, kind, low in (("bits", int, 1), ("group_size", int, 1), ("mode", str, None))
    ),
)

BY_KEY: dict[str, Field] = {f.key: f for f in FIELDS}


def _values(node: Any, parts: list[str], path: str) -> Iterator[tuple[str, Any]]:
    """(path, value) for each place `parts` reaches below `node`; value None where the last key is
    absent from an object that exists."""
    if not isinstance(node, Mapping):
        return
    head, rest = parts[0], parts[1:]
    keys = list(node) if head == "*" else [head]
    for k in keys:
        where = f"{path}.{k}" if path else k
        if rest:
            yield from _values(node.get(k), rest, where)
        else:
            yield where, node.get(k)


def check_config(config: Mapping[str, Any], where: str, fields: tuple[Field, ...] = FIELDS) -> None:
    """Refuses, naming the key, the first field of `fields` that `config` breaks."""
    for f in fields:
        for path, value in _values(config, f.key.split("."), ""):
            if value is None:
                if f.required:
                    raise FormatError(f"{where}: {path} is missing, expected {f.expected()}")
            elif not f.accepts(value):
                shown = repr(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise FormatError(f"{where}: {path} is {shown}, expected {f.expected()}")
