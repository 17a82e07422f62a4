"""Quantization conventions: how one producer (AWQ, GPTQ, compressed-tensors, MLX, ModelOpt, ...)
stores a quantized linear in a checkpoint. One module each, registering how to recognise a
config.json and how to read one linear from the checkpoint's tensors into a format's kernel
layout; importing the package loads them all. What a convention is and the registry live in
`base`; what several share lives in modules that register none: `common` (quantization_config
lookups, checkpoint tensor reads) and `compressed_tensors` (its config groups and targets).
(An architecture, what a decoder layer does, is qir.models.architectures'.)"""

from __future__ import annotations

import importlib
import pkgutil

from qir.models.quant_conventions.base import (
    CONVENTIONS,
    OUT_IN,
    Axes,
    Cut,
    QuantConvention,
    TensorReader,
    Unsliceable,
    register_convention,
)

__all__ = [
    "CONVENTIONS",
    "OUT_IN",
    "Axes",
    "Cut",
    "QuantConvention",
    "TensorReader",
    "Unsliceable",
    "register_convention",
]


def load_all() -> None:
    """Imports every convention module (each registers itself); idempotent."""
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
