"""ggml's plain float types (F32, F16, BF16) as qir's dense format: a GGUF tensor's rows are
the weight's rows as stored, read without a copy."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from qir.dtypes import BF16, F16, F32, DType
from qir.formats.base import FormatError, WeightFormat
from qir.formats.dense import Dense
from qir.formats.ggml_types import TYPES, GgmlReader, register_ggml


@dataclass(frozen=True)
class DenseReader(GgmlReader):
    type_id: int
    dtype: DType

    def format(self) -> WeightFormat:
        return Dense(self.dtype)

    def repack(
        self, raw: np.ndarray, out_features: int, in_features: int, where: str
    ) -> dict[str, np.ndarray]:
        row_bytes = TYPES[self.type_id].row_bytes(in_features)
        if raw.dtype != np.uint8 or raw.shape != (out_features, row_bytes):
            raise FormatError(
                f"{where}: {raw.dtype} {list(raw.shape)}, expected the uint8 rows "
                f"[{out_features}, {row_bytes}] of a {self.dtype} [{out_features}, {in_features}]"
            )
        return {"weight": np.ascontiguousarray(raw).view(self.dtype.np)}


for _id, _dtype in ((0, F32), (1, F16), (30, BF16)):
    register_ggml(_id)(partial(DenseReader, _id, _dtype))
