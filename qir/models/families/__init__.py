"""Checkpoint format families: one module each, registering how to recognise a config.json and
how to read one linear from the checkpoint's tensors into a format's kernel layout. What several
families share lives in modules that register none: `common` (quantization_config lookups,
checkpoint tensor reads) and `compressed_tensors` (its config groups and targets)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qir.models.checkpoint import Checkpoint, Linear


def _no_files(config: Mapping[str, Any]) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Family:
    name: str
    matches: Callable[[Mapping[str, Any]], bool]
    linear: Callable[[Checkpoint, str], Linear]
    # The producer's own name of a single-file checkpoint, tried after model.safetensors.
    files: Callable[[Mapping[str, Any]], tuple[str, ...]] = _no_files


# Tried in order; the first whose `matches` accepts config.json reads the checkpoint.
FAMILIES: list[Family] = []


def register_family(family: Family) -> Family:
    FAMILIES.append(family)
    return family


def load_all() -> None:
    """Imports every family module (each registers itself); idempotent."""
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
