"""Checkpoint directories: config.json, format detection, and lazily read quantized linears.

`load(dir)` reads config.json, checks every field qir reads against one table
(qir.models.config_fields) and validates every safetensors header; tensors are memory-mapped per
module when `linear()` asks for them, so opening a large checkpoint to build one block touches
just that block's bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from qir.dtypes import BF16, F16, F32, DType
from qir.errors import FormatError
from qir.formats.base import check_tensor
from qir.models.architectures import (
    LLAMA_LINEARS,
    Features,
    architecture_field,
    architecture_of,
    features,
    segment_rows,
)
from qir.models.checkpoint_view import Linear
from qir.models.config_fields import BY_KEY
from qir.models.quant_conventions import QuantConvention
from qir.models.safetensors_io import TensorStore
from qir.rope import REQUIRED, rope_problem, yarn_attention_factor

# The KV cache's default length: the config's max_position_embeddings, at most this (a 128k
# context would preallocate gigabytes of cache nobody asked for).
MAX_SEQ_CAP = 4096

# Gemma 3's sliding layers' RoPE base where its config names none (transformers' default).
GEMMA3_LOCAL_BASE = 10000.0

_ACT_DTYPES = {"bfloat16": BF16, "float16": F16, "float32": F32}

# Short names (as in golden.npz keys) of the HF Llama-style linears of one decoder layer.
LAYER_LINEARS = LLAMA_LINEARS
# The tensor that holds a quantized linear's codes, per convention (the inspect command's list).
_WEIGHT_TENSORS = ("weight", "qweight", "weight_packed")
_LAYER_MODULE = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)$"
)


def layer_module(layer: int, name: str, num_layers: int | None = None) -> str:
    """HF module path of a layer's linear; `name` is q/k/v/o/gate/up/down or q_proj, ..."""
    if layer < 0:
        raise FormatError(f"layer {layer} out of range: layer indices start at 0")
    if num_layers is not None and layer >= num_layers:
        raise FormatError(f"layer {layer} out of range: the checkpoint has {num_layers} layers")
    short = name.removesuffix("_proj")
    if short not in LAYER_LINEARS:
        raise FormatError(
            f"unknown layer linear {name!r}; known: {', '.join(LAYER_LINEARS)} (or *_proj)"
        )
    return f"model.layers.{layer}.{LAYER_LINEARS[short]}"


class Checkpoint:
    """An opened checkpoint: config.json facts plus per-module access to its quantized linears."""

    def __init__(
        self,
        path: Path,
        config: dict[str, Any],
        convention: QuantConvention,
        text_of: tuple[Callable[[str], str | None], str] | None = None,
        store: TensorStore | None = None,
    ) -> None:
        """`text_of`: a multimodal checkpoint's text model (qir.models.multimodal): the store's
        renaming and the line that says so. `store`: the tensors, where they are not the
        directory's safetensors (a GGUF model's)."""
        self.path = path
        self.config = config
        self.convention = convention
        self.text_of = text_of[1] if text_of else None
        if store is None:
            store = TensorStore(path, convention.files(config), text_of[0] if text_of else None)
        self.store: TensorStore = store
        self._fused: Linear | None = None  # the fused linear a block reads segments of

    def tokenizer(self) -> Any:
        """The checkpoint's qir.text.Tokenizer (a UsageError where it ships none)."""
        from qir.text import Tokenizer

        return Tokenizer.load(self.path)

    def field(self, key: str) -> Any:
        """config.json's `key`, a top-level entry of config_fields.FIELDS (checked when the
        checkpoint was opened); the entry's default where it is absent or null."""
        value = self.config.get(key)
        return BY_KEY[key].default if value is None else value

    @property
    def hidden_size(self) -> int:
        result: int = self.field("hidden_size")
        return result

    @property
    def intermediate_size(self) -> int:
        result: int = self.field("intermediate_size")
        return result

    @property
    def num_layers(self) -> int:
        result: int = self.field("num_hidden_layers")
        return result

    @property
    def num_heads(self) -> int:
        result: int = self.field("num_attention_heads")
        return result

    @property
    def num_kv_heads(self) -> int:
        return self.field("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        # Absent or null means the HF default, hidden_size / num_heads.
        return self.field("head_dim") or self.hidden_size // self.num_heads

    @property
    def act_dtype(self) -> DType:
        for key in ("torch_dtype", "dtype"):
            name = self.field(key)
            if name is not None:
                if name not in _ACT_DTYPES:
                    raise FormatError(
                        f"{self.path}/config.json: {key} {name!r} not supported "
                        f"(expected one of {', '.join(_ACT_DTYPES)})"
                    )
                return _ACT_DTYPES[name]
        return F16

    # ---- what a whole layer and model need (see qir.models.blocks) -------------------------
    # Types and ranges are config_fields' (checked at open); what qir does not support is
    # refused here, when a block needs it.
    def _where(self) -> str:
        return f"{self.path}/config.json"

    @property
    def rms_norm_eps(self) -> float:
        eps = self.field("rms_norm_eps")
        if eps is None:
            raise FormatError(f"{self._where()}: lacks rms_norm_eps (the layer's RMSNorm needs it)")
        return float(eps)

    @property
    def vocab_size(self) -> int:
        vocab = self.field("vocab_size")
        if vocab is None:
            raise FormatError(f"{self._where()}: lacks vocab_size (the embedding needs it)")
        return int(vocab)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.field("tie_word_embeddings"))

    @property
    def max_position_embeddings(self) -> int | None:
        value = self.field("max_position_embeddings")
        return None if value is None else int(value)

    @property
    def rope(self) -> dict[str, Any]:
        """The `rope` op's attributes (qir.rope) of a full-attention layer, for a KV cache of
        the default length."""
        return self.rope_of(sliding=False)

    def rope_of(self, sliding: bool, positions: int | None = None) -> dict[str, Any]:
        """The `rope` op's attributes (qir.rope) of a full or a sliding layer: transformers 5's
        `rope_parameters` (one dict, or one per layer type as it writes Gemma 3's), or the
        older top-level `rope_theta` with `rope_scaling` (Gemma 3: its sliding layers rotate by
        `rope_local_base_freq` without scaling). `positions`: the positions a sequence may
        reach (the KV cache's max_seq; default: default_max_seq), which picks
        longrope's factors (_longrope)."""
        kind_key = "sliding_attention" if sliding else "full_attention"
        params = self.field("rope_parameters")
        if isinstance(params, dict) and kind_key in params:
            where, params = f"rope_parameters.{kind_key}", params[kind_key]
            if not isinstance(params, dict):
                raise FormatError(f"{self._where()}: {where} must be an object, got {params!r}")
            theta = params.get("rope_theta", BY_KEY["rope_theta"].default)
        elif params is not None:
            where = "rope_parameters"
            theta = params.get("rope_theta", BY_KEY["rope_theta"].default)
        else:
            where, params = "rope_scaling", self.field("rope_scaling") or {}
            theta = self.field("rope_theta")
        if (
            sliding
            and self.features.arch.local_rope
            and where != "rope_parameters.sliding_attention"
        ):
            where, params = "rope_local_base_freq", {}
            theta = self.field("rope_local_base_freq") or GEMMA3_LOCAL_BASE
        if isinstance(theta, bool) or not isinstance(theta, int | float):
            raise FormatError(
                f"{self._where()}: {where} rope_theta must be a number, got {theta!r}"
            )
        kind = params.get("rope_type", params.get("type", "default"))
        kind = "longrope" if kind == "su" else kind  # LongRoPE's first name (transformers' too)
        if kind not in REQUIRED:
            raise FormatError(
                f"{self._where()}: {where} rope_type {kind!r} is not supported "
                f"(supported: {', '.join(REQUIRED)})"
            )
        partial = params.get("partial_rotary_factor", self.field("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise FormatError(
                f"{self._where()}: partial_rotary_factor {partial!r} is not supported"
            )
        attrs: dict[str, Any] = {
            "head_dim": self.head_dim,
            "theta": float(theta),
            "rope_type": kind,
        }
        if kind == "longrope":
            if positions is None:
                positions = default_max_seq(self)
            attrs.update(self._longrope(params, where, positions))
        if kind == "yarn":  # the defaults transformers fills in (standardize_rope_params and
            # _compute_yarn_parameters): a top-level original_max_position_embeddings first, else
            # max_position_embeddings
            factor = params.get("factor")
            old = self.config.get("original_max_position_embeddings")
            params = {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": True,
                "original_max_position_embeddings": self.field("max_position_embeddings"),
                **{k: v for k, v in params.items() if v is not None},
                **({"original_max_position_embeddings": old} if old is not None else {}),
            }
            if isinstance(factor, int | float) and params.get("attention_factor") is None:
                params["attention_factor"] = yarn_attention_factor(
                    float(factor), params.get("mscale"), params.get("mscale_all_dim")
                )
        for p in REQUIRED[kind] if kind != "longrope" else ():
            v = params.get(p)
            if v is None:
                raise FormatError(f"{self._where()}: {where} of type {kind} lacks {p}")
            if p == "truncate":
                attrs[p] = v
            else:
                attrs[p] = int(v) if p == "original_max_position_embeddings" else float(v)
        problem = rope_problem(attrs)
        if problem:
            raise FormatError(f"{self._where()}: {where}: {problem}")
        return attrs

    def _longrope(self, params: dict[str, Any], where: str, positions: int) -> dict[str, Any]:
        """longrope's `factors` and `attention_factor` (qir.rope) as transformers computes them
        (modeling_rope_utils' _compute_longrope_parameters): long_factor where the sequence is
        longer than original_max_position_embeddings, short_factor else; attention_factor, where
        the config sets none, sqrt(1 + ln(factor) / ln(original)) with factor
        max_position_embeddings / original (1 where that is <= 1). transformers picks per
        forward call by the longest position in it, and its generate() recomputes the cache
        with the long factors once a sequence passes original: qir's KV cache holds rotated
        keys, so the choice is static, by the positions the cache holds (long where `positions`
        passes original) -- transformers' numbers for every sequence when positions <= original,
        and for sequences longer than original otherwise."""
        n, spec = self.head_dim // 2, {}
        for key in ("short_factor", "long_factor"):
            v = params.get(key)
            if not isinstance(v, list) or len(v) != n:
                got = f"{len(v)}" if isinstance(v, list) else "nothing" if v is None else repr(v)
                raise FormatError(
                    f"{self._where()}: {where}.{key} must be a list of {n} numbers "
                    f"(head_dim / 2), got {got}"
                )
            spec[key] = tuple(float(f) for f in v)
        longest = self.max_position_embeddings
        original = (
            architecture_field(self.features.arch, self, "original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or longest
        )
        factor = params.get("factor")
        if factor is None and longest is not None and original is not None:
            factor = longest / original
        if original is None or factor is None:
            raise FormatError(
                f"{self._where()}: {where} of type longrope needs max_position_embeddings "
                "(or original_max_position_embeddings and factor)"
            )
        factor = float(factor)
        scale = params.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        which = "long_factor" if positions > original else "short_factor"
        return {"factors": spec[which], "attention_factor": float(scale)}

    @cached_property
    def features(self) -> Features:
        """What its decoder layers compute (qir.models.architectures), checked once."""
        return features(self)

    def layer_module(self, layer: int, name: str) -> str:
        return layer_module(layer, name, self.num_layers)

    def expected_shape(self, module: str) -> tuple[int, int] | None:
        """[out, in] that config.json implies for a known HF module name, else None."""
        m = _LAYER_MODULE.match(module)
        if not m:
            return None
        hidden, inter = self.hidden_size, self.intermediate_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "self_attn.q_proj": (q_out, hidden),
            "self_attn.k_proj": (kv_out, hidden),
            "self_attn.v_proj": (kv_out, hidden),
            "self_attn.o_proj": (hidden, q_out),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }[m.group(2)]

    def tensor(self, name: str) -> np.ndarray:
        """Any stored tensor (norm weights, ...), as a read-only view."""
        return self.store.get(name)

    def linear(self, module: str) -> Linear:
        """The linear at `module`, in its format's kernel layout; with its `bias` tensor, if the
        checkpoint has one (zeros included), widened to float32. A layer linear the architecture
        stores fused (Phi-3's q/k/v in qkv_proj, gate/up in gate_up_proj) is its rows of the
        fused one, views of its buffers (no copy)."""
        segment = self._segment(module)
        if segment is not None:
            fused, start, stop = segment
            whole = self._fused_linear(fused)
            w = whole.weight
            bufs = w.format.rows(whole.buffers, w.out_features, w.in_features, start, stop)
            if w.bias:
                bufs["bias"] = whole.buffers["bias"][start:stop]
            lin = Linear(module, replace(w, out_features=stop - start), bufs)
            self._check_shape(module, lin)
            return lin
        lin = self._read_linear(module)
        self._check_shape(module, lin)
        return lin

    def _check_shape(self, module: str, lin: Linear) -> None:
        want = self.expected_shape(module)
        got = (lin.weight.out_features, lin.weight.in_features)
        if want is not None and got != want:
            raise FormatError(
                f"{module}.weight: holds a {list(got)} weight in {lin.weight.format.spell()}, "
                f"but config.json implies {list(want)}"
            )

    def _segment(self, module: str) -> tuple[str, int, int] | None:
        """(fused module, first row, end row) where `module` is a layer linear the checkpoint
        stores inside a fused one (and not on its own), else None."""
        m = _LAYER_MODULE.match(module)
        if m is None or any(f"{module}.{s}" in self.store for s in _WEIGHT_TENSORS):
            return None
        try:
            arch = architecture_of(self.config, str(self.path / "config.json"))
        except FormatError:
            return None
        short = {v: k for k, v in LAYER_LINEARS.items()}[m.group(2)]
        for path, parts in arch.fused.items():
            fused = f"model.layers.{m.group(1)}.{path}"
            if short in parts and any(f"{fused}.{s}" in self.store for s in _WEIGHT_TENSORS):
                start = sum(segment_rows(self, p) for p in parts[: parts.index(short)])
                return fused, start, start + segment_rows(self, short)
        return None

    def _fused_linear(self, module: str) -> Linear:
        """A fused linear, read once for the segments a block takes of it in a row."""
        if self._fused is None or self._fused.module != module:
            lin = self._read_linear(module)
            want = (self.fused_rows(module), self.hidden_size)
            got = (lin.weight.out_features, lin.weight.in_features)
            if got != want:
                parts = self._fused_parts(module)
                raise FormatError(
                    f"{module}.weight: holds a {list(got)} weight in {lin.weight.format.spell()}, "
                    f"but config.json implies {list(want)} ({'+'.join(parts)})"
                )
            self._fused = lin
        return self._fused

    def _fused_parts(self, module: str) -> tuple[str, ...]:
        return next(p for path, p in self.features.arch.fused.items() if module.endswith(path))

    def fused_rows(self, module: str) -> int:
        """The rows of fused linear `module` that config.json implies (its segments' sum)."""
        return sum(segment_rows(self, s) for s in self._fused_parts(module))

    def _read_linear(self, module: str) -> Linear:
        lin = self.convention.linear(self, module)
        name = f"{module}.bias"
        if name not in self.store:
            return lin
        b = self.store.get(name)
        check_tensor(b, name, (lin.weight.out_features,), F16.np, BF16.np, F32.np)
        bufs = {**lin.buffers, "bias": b.astype(np.float32)}
        return Linear(module, replace(lin.weight, bias=True), bufs)


def default_max_seq(ck: Checkpoint) -> int:
    """The config's max_position_embeddings, capped at MAX_SEQ_CAP."""
    return min(ck.max_position_embeddings or MAX_SEQ_CAP, MAX_SEQ_CAP)
