"""The interface every weight format implements.

A format is data and maths only: it knows its checkpoint tensors, its kernel-layout buffers,
how to repack one into the other, how to dequantize in numpy, how to quantize a float weight,
and which device dequant fragment codegen uses for it. It imports only the IR's dtypes/types.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from qir.dtypes import DType
from qir.errors import QirError
from qir.types import TensorType


class FormatError(QirError, ValueError):
    """Bad checkpoint or weight data; the message names the tensor and what is wrong."""


@dataclass(frozen=True)
class WeightFormat(ABC):
    # Registry key and IR spelling, e.g. "mlx_affine".
    kind: ClassVar[str]

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def spell(self) -> str:
        """IR text: kind<k=v,...>; parse_format() reads it back."""
        inner = ",".join(f"{k}={_spell_value(v)}" for k, v in self.params().items())
        return f"{self.kind}<{inner}>"

    @abstractmethod
    def tag(self) -> str:
        """Short name for kernel names, e.g. 'mlx4g64bf16'."""

    @abstractmethod
    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]:
        """Kernel-layout buffers (name -> type) of one weight of this shape."""

    @abstractmethod
    def check_shape(self, out_features: int, in_features: int) -> None:
        """Raise FormatError if a weight of this shape cannot be held in this format."""

    @abstractmethod
    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray:
        """float32 [out, in] weight from kernel-layout buffers."""

    @abstractmethod
    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """Kernel-layout buffers of a float [out, in] weight."""

    @abstractmethod
    def bytes_per_weight(self) -> float:
        """Bytes the kernel reads per weight element (packed codes plus scales)."""

    @property
    @abstractmethod
    def fragment(self) -> str:
        """Name of the device dequant fragment in codegen (templates/formats/<fragment>.cuh.j2)."""

    def act_quant_scheme(self) -> str | None:
        """The activation quantization this format's kernels can consume instead of 16-bit
        activations (e.g. "nvfp4" for W4A4), or None."""
        return None

    def declared_act_bits(self) -> int:
        """The activation width the checkpoint was calibrated for (4 = W4A4 declared)."""
        return 16

    def act_quant_rule(self, bufs: Mapping[str, np.ndarray]) -> dict[str, float]:
        """The calibrated activation scale of one weight, as IR attributes of its quantize_act
        (empty: a per-row scale computed at run time)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Facts for `qir inspect`: `bits` per weight element, `group` (inputs per scale; None
        for one scale per row or tensor) and `w4a4` (calibrated for 4-bit activations). The
        default reads the usual parameter names; formats whose parameters say it otherwise
        override this."""
        p = self.params()
        w4a4 = self.declared_act_bits() == 4
        return {"bits": p.get("bits"), "group": p.get("group_size"), "w4a4": w4a4}

    def check_buffers(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int, where: str
    ) -> None:
        """Check kernel-layout buffers against buffers(): names, shapes, dtypes, finite scales."""
        self.check_shape(out_features, in_features)
        want = self.buffers(out_features, in_features)
        for name, t in want.items():
            if name not in bufs:
                raise FormatError(
                    f"{where}.{name}: missing (format {self.spell()} needs {', '.join(want)})"
                )
            a = bufs[name]
            if tuple(a.shape) != t.shape:
                raise FormatError(
                    f"{where}.{name}: shape {list(a.shape)}, expected {list(t.shape)} for a "
                    f"[{out_features}, {in_features}] weight in {self.spell()}"
                )
            if a.dtype != t.dtype.np:
                raise FormatError(
                    f"{where}.{name}: dtype {a.dtype}, expected {t.dtype.np} ({t.dtype.name})"
                )
            if t.dtype.is_float and not np.all(np.isfinite(np.asarray(a, dtype=np.float32))):
                raise FormatError(f"{where}.{name}: contains NaN or Inf")


def _spell_value(v: Any) -> str:
    if isinstance(v, DType):
        return v.name
    return str(v)
