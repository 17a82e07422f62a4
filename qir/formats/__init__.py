"""Weight formats: one module per format, registered by kind for the IR parser
(qir.formats.registry); importing the package loads them all."""

from __future__ import annotations

import importlib
import pkgutil

from qir.dtypes import DType
from qir.errors import FormatError
from qir.formats.base import WeightFormat
from qir.formats.registry import (
    ACT_QUANTIZERS,
    REGISTRY,
    ActQuantizer,
    parse_format,
    register,
    register_act_quantizer,
)


def _load_builtin() -> None:
    """Imports every format module; each registers itself."""
    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")


__all__ = [
    "ACT_QUANTIZERS",
    "REGISTRY",
    "ActQuantizer",
    "DType",
    "FormatError",
    "WeightFormat",
    "parse_format",
    "register",
    "register_act_quantizer",
]

_load_builtin()
