"""Element types: one table mapping IR names to numpy (ml_dtypes) and C types."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # IR spelling, e.g. "f16"
    np_name: str  # numpy / ml_dtypes name
    c_type: str  # CUDA C spelling
    bits: int
    is_float: bool

    @property
    def np(self) -> np.dtype:
        return np.dtype(_NP[self.np_name])

    @property
    def itemsize(self) -> int:
        return self.np.itemsize

    def __str__(self) -> str:
        return self.name


_NP: dict[str, type] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
    "uint8": np.uint8,
    "uint32": np.uint32,
    "int32": np.int32,
    "int64": np.int64,
}

F32 = DType("f32", "float32", "float", 32, True)
F16 = DType("f16", "float16", "__half", 16, True)
BF16 = DType("bf16", "bfloat16", "__nv_bfloat16", 16, True)
E4M3 = DType("e4m3", "float8_e4m3fn", "__nv_fp8_e4m3", 8, True)
E8M0 = DType("e8m0", "float8_e8m0fnu", "uint8_t", 8, True)
E2M1 = DType("e2m1", "float4_e2m1fn", "uint8_t", 4, True)
U8 = DType("u8", "uint8", "uint8_t", 8, False)
U32 = DType("u32", "uint32", "uint32_t", 32, False)
I32 = DType("i32", "int32", "int32_t", 32, False)
I64 = DType("i64", "int64", "int64_t", 64, False)

ALL: tuple[DType, ...] = (F32, F16, BF16, E4M3, E8M0, E2M1, U8, U32, I32, I64)
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}
# Activation dtypes the kernels take as input/output.
ACTIVATION: tuple[DType, ...] = (F16, BF16, F32)


def by_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(BY_NAME)}") from None


def from_numpy(dt: np.dtype | type) -> DType:
    dt = np.dtype(dt)
    for d in ALL:
        if d.np == dt:
            return d
    raise ValueError(f"numpy dtype {dt} has no qir dtype")
