"""Unquantized linears: `<module>.weight` as stored in f16/bf16/f32.

Quantized conventions call `read_dense` for the modules their checkpoint leaves unquantized
(compressed-tensors `ignore`, HF `modules_to_not_convert`, ModelOpt `exclude_modules`, mlx-lm's
per-module `false`); `is_excluded` matches those lists, and `stored_dense` recognises the modules
a tool leaves unquantized without listing them. A checkpoint with no quantization config
at all is a convention of its own, read entirely as dense.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from qir.errors import FormatError
from qir.formats.dense import DTYPES, Dense
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import QuantConvention, register_convention
from qir.models.quant_conventions.common import regex_match
from qir.types import QWeight

# loader.load folds a ModelOpt hf_quant_config.json in as "hf_quant_config".
_QUANT_KEYS = ("quantization_config", "quantization", "hf_quant_config")


def is_excluded(module: str, patterns: Iterable[Any] | None) -> bool:
    """Whether an exclusion list names `module`. Producers spell entries three ways:
    - `re:<regex>` (compressed-tensors): the regex matches at the start of the module path;
    - globs with `*` (ModelOpt `exclude_modules`, gpt-oss `modules_to_not_convert`): the pattern
      matches the path or one of its parents (`model.layers.*.self_attn` covers its q_proj);
    - plain names: a run of whole path components (`lm_head`, `model.embed_tokens`,
      `self_attn.o_proj`), like transformers' substring test but never splitting a name.
    """
    for p in patterns or ():
        if not isinstance(p, str) or not p:
            continue
        if p.startswith("re:"):
            if regex_match(p, module):
                return True
        elif "*" in p or "?" in p:
            parts = module.split(".")
            if any(fnmatch.fnmatchcase(".".join(parts[:n]), p) for n in range(1, len(parts) + 1)):
                return True
        elif f".{p}." in f".{module}.":
            return True
    return False


def stored_dense(ck: CheckpointView, module: str, quantized: str) -> bool:
    """Whether `module` is stored unquantized although no exclusion list names it: no
    `<module>.<quantized>` (a tensor every quantized linear of the convention has) and a 16/32-bit
    `.weight`. Tools leave modules they never quantize off their lists (AutoAWQ and GPTQ skip
    lm_head; compressed-tensors' "Linear" target does not cover embeddings)."""
    name = f"{module}.weight"
    return (
        f"{module}.{quantized}" not in ck.store
        and name in ck.store
        and ck.store.dtype(name) in [d.np for d in DTYPES]
    )


def read_dense(ck: CheckpointView, module: str) -> Linear:
    """The unquantized linear `module`: its `.weight` [out, in] as stored, no copy."""
    name = f"{module}.weight"
    if name not in ck.store:
        raise FormatError(f"{name}: missing from {ck.path} (expected an unquantized linear)")
    w = ck.store.get(name)
    dtype = next((d for d in DTYPES if d.np == w.dtype), None)
    if dtype is None or w.ndim != 2:
        raise FormatError(
            f"{name}: {w.dtype} {list(w.shape)}, expected an unquantized "
            f"{'/'.join(d.name for d in DTYPES)} [out, in] weight"
        )
    fmt = Dense(dtype)
    out_features, in_features = w.shape
    fmt.check_read_shape(out_features, in_features, name)
    fmt.check_buffers({"weight": w}, out_features, in_features, where=module)
    return Linear(module, QWeight(fmt, out_features, in_features), {"weight": w})


def matches_config(config: Mapping[str, Any]) -> bool:
    """A checkpoint with no quantization config at all (plain HF / mlx-lm float weights)."""
    return all(config.get(key) is None for key in _QUANT_KEYS)


register_convention(QuantConvention("dense", matches_config, read_dense))
