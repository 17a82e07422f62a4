"""Lowering of the layer ops (rms_norm, rope, kv_append, attention, embedding): each returns
its launches and the temps they pass between them (see Plan.temps)."""

from __future__ import annotations

from collections.abc import Callable

from qir.codegen.lower import Launch
from qir.graph import Graph
from qir.types import TensorType

Lowered = tuple[list[Launch], dict[str, TensorType]]
LAYER_LOWERINGS: dict[str, Callable[[Graph, str], Lowered]] = {}
