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


# What each dim of a linear's checkpoint tensors is (tensor suffix -> one word per dim): "out"
# or "in" where the dim is that axis of the weight in proportion (packed codes, one scale per
# group), "in?" where it follows the inputs but not in proportion (padded groups, g_idx's
# global group numbers), "" where it is neither. qir.models.shard_read slices tensors before
# reading them by this; a tensor it does not list is read whole.
Axes = Mapping[str, tuple[str, ...]]
OUT_IN: Axes = {"weight": ("out", "in"), "bias": ("out",)}


def _dense_axes(config: Mapping[str, Any]) -> Axes:
    return OUT_IN


@dataclass(frozen=True)
class Family:
    name: str
    matches: Callable[[Mapping[str, Any]], bool]
    linear: Callable[[Checkpoint, str], Linear]
    # The producer's own name of a single-file checkpoint, tried after model.safetensors.
    files: Callable[[Mapping[str, Any]], tuple[str, ...]] = _no_files
    axes: Callable[[Mapping[str, Any]], Axes] = _dense_axes


# Tried in order; the first whose `matches` accepts config.json reads the checkpoint.
FAMILIES: list[Family] = []


def register_family(family: Family) -> Family:
    FAMILIES.append(family)
    return family


def load_all() -> None:
    """Imports every family module (each registers itself); idempotent."""
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
