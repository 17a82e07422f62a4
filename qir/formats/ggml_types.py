"""ggml's tensor types, as GGUF files store them (llama.cpp, Ollama, LM Studio).

A tensor of type T and shape ne = [in_features, out_features] (ne[0] is contiguous) holds
out_features rows, each `in_features / T.block` blocks of `T.block_bytes` bytes, blocks running
along the inputs; so a row, or a run of whole rows, is a byte slice. Ids and sizes are ggml's
(include/ggml.h, GGML_QUANT_SIZES).

A weight format that reads a type registers a reader for its id (`register_ggml`); a GGUF
loader asks `reader(type_id)` for the format and its kernel-layout buffers of one tensor's raw
rows. The table itself imports no format, so formats and loaders can both import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qir.formats.base import FormatError, WeightFormat


@dataclass(frozen=True)
class GgmlType:
    id: int
    name: str
    block: int  # elements per block, along a row (the inputs)
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of `in_features` elements; refuses a row of partial blocks."""
        if in_features % self.block:
            raise FormatError(
                f"{self.name}: a row of {in_features} elements is not whole blocks of {self.block}"
            )
        return in_features // self.block * self.block_bytes


TYPES: dict[int, GgmlType] = {
    t.id: t
    for t in (
        GgmlType(0, "F32", 1, 4),
        GgmlType(1, "F16", 1, 2),
        GgmlType(2, "Q4_0", 32, 18),
        GgmlType(3, "Q4_1", 32, 20),
        GgmlType(6, "Q5_0", 32, 22),
        GgmlType(7, "Q5_1", 32, 24),
        GgmlType(8, "Q8_0", 32, 34),
        GgmlType(9, "Q8_1", 32, 40),
        GgmlType(10, "Q2_K", 256, 84),
        GgmlType(11, "Q3_K", 256, 110),
        GgmlType(12, "Q4_K", 256, 144),
        GgmlType(13, "Q5_K", 256, 176),
        GgmlType(14, "Q6_K", 256, 210),
        GgmlType(15, "Q8_K", 256, 292),
        GgmlType(16, "IQ2_XXS", 256, 66),
        GgmlType(17, "IQ2_XS", 256, 74),
        GgmlType(18, "IQ3_XXS", 256, 98),
        GgmlType(19, "IQ1_S", 256, 50),
        GgmlType(20, "IQ4_NL", 32, 18),
        GgmlType(21, "IQ3_S", 256, 110),
        GgmlType(22, "IQ2_S", 256, 82),
        GgmlType(23, "IQ4_XS", 256, 136),
        GgmlType(24, "I8", 1, 1),
        GgmlType(25, "I16", 1, 2),
        GgmlType(26, "I32", 1, 4),
        GgmlType(27, "I64", 1, 8),
        GgmlType(28, "F64", 1, 8),
        GgmlType(29, "IQ1_M", 256, 56),
        GgmlType(30, "BF16", 1, 2),
        GgmlType(34, "TQ1_0", 256, 54),
        GgmlType(35, "TQ2_0", 256, 66),
        GgmlType(39, "MXFP4", 32, 17),
        GgmlType(40, "NVFP4", 64, 36),
        GgmlType(41, "Q1_0", 128, 18),
    )
}


class GgmlReader(ABC):
    """How one ggml type becomes a qir weight: its format and the repack of a tensor's rows."""

    @abstractmethod
    def format(self) -> WeightFormat:
        """The weight format a tensor of this type is held in."""

    @abstractmethod
    def repack(
        self, raw: np.ndarray, out_features: int, in_features: int, where: str
    ) -> dict[str, np.ndarray]:
        """Kernel-layout buffers of `raw` (uint8 [out_features, row_bytes], the tensor's bytes as
        stored); bad data is refused naming `where` (the tensor)."""


READERS: dict[int, Callable[[], GgmlReader]] = {}


def register_ggml(type_id: int) -> Callable[[Callable[[], GgmlReader]], Callable[[], GgmlReader]]:
    """Registers the factory of type `type_id`'s reader (one per id)."""

    def deco(make: Callable[[], GgmlReader]) -> Callable[[], GgmlReader]:
        if type_id not in TYPES:
            raise ValueError(f"unknown ggml type id {type_id}")
        READERS[type_id] = make
        return make

    return deco


def type_of(type_id: int, where: str) -> GgmlType:
    """The type of id `type_id`, refused in one line naming `where` when ggml has none."""
    try:
        return TYPES[type_id]
    except KeyError:
        raise FormatError(f"{where}: unknown ggml type id {type_id}") from None


def reader(type_id: int, where: str) -> GgmlReader:
    """The reader of type `type_id`; a type qir does not read is refused naming `where`."""
    t = type_of(type_id, where)
    make = READERS.get(type_id)
    if make is None:
        readable = ", ".join(TYPES[i].name for i in sorted(READERS)) or "none yet"
        raise FormatError(f"{where}: ggml type {t.name} is not supported; qir reads {readable}")
    return make()
