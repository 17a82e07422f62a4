"""The registries the formats fill as they are imported: formats by kind (for the IR parser) and
activation quantizers by scheme. A module of its own, below every format, so that a format
registers itself without importing the package that loads it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields

import numpy as np

from qir.dtypes import by_name
from qir.formats.base import WeightFormat

REGISTRY: dict[str, type[WeightFormat]] = {}


# Activation quantizers by scheme: fn(x_f32 [M, K], **rule) -> fake-quantized float32 [M, K],
# where rule is a quantize_act's scale attributes (none: per-row scale at run time).
ActQuantizer = Callable[..., np.ndarray]
ACT_QUANTIZERS: dict[str, ActQuantizer] = {}


def register_act_quantizer(scheme: str, fn: ActQuantizer) -> None:
    ACT_QUANTIZERS[scheme] = fn


def register(cls: type[WeightFormat]) -> type[WeightFormat]:
    REGISTRY[cls.kind] = cls
    return cls


_SPELLING = re.compile(r"^(\w+)<(.*)>$")


def parse_format(text: str) -> WeightFormat:
    """Inverse of WeightFormat.spell(): 'mlx_affine<bits=4,group_size=64,scale_dtype=bf16>'."""
    m = _SPELLING.match(text.strip())
    if not m:
        raise ValueError(f"bad weight format spelling {text!r}; expected kind<key=value,...>")
    kind, inner = m.groups()
    if kind not in REGISTRY:
        raise ValueError(f"unknown weight format {kind!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[kind]
    kinds = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, object] = {}
    for item in filter(None, inner.split(",")):
        key, _, value = item.partition("=")
        if key not in kinds:
            raise ValueError(f"weight format {kind!r} has no parameter {key!r}")
        t = str(kinds[key])
        kwargs[key] = by_name(value) if "DType" in t else int(value) if "int" in t else value
    return cls(**kwargs)
