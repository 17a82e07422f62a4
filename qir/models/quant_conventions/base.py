"""What a quantization convention is (how one producer stores a linear: how to recognise its
config.json, read a linear, cut a shard of one) and the registry the conventions fill as they
are imported. A module of its own below every convention, so that one registers itself without
importing the package that loads them; it reads a checkpoint only through
qir.models.checkpoint_view."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from qir.models.checkpoint_view import CheckpointView, Linear


def _no_files(config: Mapping[str, Any]) -> tuple[str, ...]:
    return ()


# What each dim of a linear's checkpoint tensors is (tensor suffix -> one word per dim): "out"
# or "in" where the dim is that axis of the weight in proportion (packed codes, one scale per
# group), "in?" where it follows the inputs but not in proportion (padded groups, g_idx's
# global group numbers), "out/<b>" or "in/<b>" one per block of b rows or inputs (a ragged
# last block included; the part takes the blocks it covers), "" where it is neither (a per-channel scale's dim of 1); ("shape",)
# for a tensor that holds the weight's [out, in] (compressed-tensors' weight_shape). A tensor
# of fewer dims than its words takes the leading ones (a per-channel scale stored [O] beside
# [O, 1]); one element is every shard's (a per-tensor scale). qir.models.shard_read slices
# tensors before reading them by this; a linear with a tensor it does not list is read whole.
Axes = Mapping[str, tuple[str, ...]]
OUT_IN: Axes = {"weight": ("out", "in"), "bias": ("out",)}

# (axis, start, stop, whole) of a shard: rows or inputs start..stop of `whole`.
Cut = tuple[str, int, int, int]


class TensorReader(Protocol):
    """What a convention's `parts` reads a shard through (qir.models.shard_read.TensorReader)."""

    store: Any

    def __contains__(self, name: object) -> bool: ...

    def read(self, name: str, index: tuple[Any, ...] | None = None) -> np.ndarray: ...

    def proportional(self, name: str, cut: Cut) -> np.ndarray: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> np.dtype: ...


class Unsliceable(Exception):
    """A linear's tensor that cannot be cut to a shard before reading (by the convention's axes or
    its own `parts`): qir.models.shard_read reads the linear whole and cuts it after."""


def _dense_axes(config: Mapping[str, Any]) -> Axes:
    return OUT_IN


def _proportional(
    reader: TensorReader, config: Mapping[str, Any], module: str, cut: Cut
) -> dict[str, np.ndarray] | None:
    return None


@dataclass(frozen=True)
class QuantConvention:
    name: str
    matches: Callable[[Mapping[str, Any]], bool]
    linear: Callable[[CheckpointView, str], Linear]
    # The producer's own name of a single-file checkpoint, tried after model.safetensors.
    files: Callable[[Mapping[str, Any]], tuple[str, ...]] = _no_files
    axes: Callable[[Mapping[str, Any]], Axes] = _dense_axes
    # The convention's own cut of a linear's tensors where its axes cannot say it (GPTQ's groups
    # gathered by g_idx, AWQ GEMV's padded groups): the module's tensors for `cut`, read through
    # reader.read (only the bytes indexed), as the convention's `linear` reads them; None for the
    # axes' proportional cut. It raises shard_read.Unsliceable where it cannot cut exactly.
    parts: Callable[[TensorReader, Mapping[str, Any], str, Cut], dict[str, np.ndarray] | None] = (
        _proportional
    )


# Tried in order; the first whose `matches` accepts config.json reads the checkpoint.
CONVENTIONS: list[QuantConvention] = []


def register_convention(convention: QuantConvention) -> QuantConvention:
    CONVENTIONS.append(convention)
    return convention
