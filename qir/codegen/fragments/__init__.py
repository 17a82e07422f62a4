"""Per-format device dequant fragments: Python computes each fragment's constants and kernel
parameters from the format; the fragment template only substitutes them.

A fragment defines `qir_dequant_chunk(<weight params>, row, chunk, float (&wv)[chunk_elems])`,
which dequantizes weights [chunk*chunk_elems, (chunk+1)*chunk_elems) of one output row."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qir.codegen.kernel import KernelParam
from qir.formats.base import WeightFormat


@dataclass(frozen=True)
class Fragment:
    template: str
    params: tuple[KernelParam, ...]  # in the order of the format's buffers()
    buffers: tuple[str, ...]
    chunk_elems: int
    context: dict[str, Any]

    def chunks_per_row(self, in_features: int) -> int:
        return in_features // self.chunk_elems


# Per-lane register budget: a chunk is dequantized into this many floats at most.
MAX_CHUNK_ELEMS = 64

MakeFragment = Callable[[WeightFormat, int, int], Fragment]
FRAGMENTS: dict[str, MakeFragment] = {}


def register_fragment(name: str) -> Callable[[MakeFragment], MakeFragment]:
    """Registers the function that builds a format's fragment; one module per fragment."""

    def deco(fn: MakeFragment) -> MakeFragment:
        FRAGMENTS[name] = fn
        return fn

    return deco


def fragment_for(fmt: WeightFormat, out_features: int, in_features: int) -> Fragment:
    try:
        make = FRAGMENTS[fmt.fragment]
    except KeyError:
        raise NotImplementedError(f"no device dequant fragment for {fmt.spell()} yet") from None
    return make(fmt, out_features, in_features)


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


_load_all()
