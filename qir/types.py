"""Value types of the IR: activation tensors with a symbolic batch dim, and quantized weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from qir.dtypes import F32, DType

if TYPE_CHECKING:
    import numpy as np

# A dimension is a concrete size or a symbol (the batch dim "M").
Dim = int | str


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: DType

    def __str__(self) -> str:
        return f"{self.dtype.name}[{', '.join(str(d) for d in self.shape)}]"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def concrete(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """Shape with symbols bound from `sizes` (e.g. {"M": 8})."""
        out = []
        for d in self.shape:
            if isinstance(d, str):
                if d not in sizes:
                    raise ValueError(f"symbolic dim {d!r} of {self} is not bound")
                out.append(sizes[d])
            else:
                out.append(d)
        return tuple(out)


class WeightFormat(Protocol):
    """A weight format as the compiler asks it: its spelling and kernel-layout buffers, the
    checks and the reference maths, its device fragment and what activations it takes, and the
    cuts tensor parallelism makes. The IR owns this interface so that it need not import a
    format: qir.formats.base.WeightFormat, the base class of every format, implements it."""

    def __hash__(self) -> int: ...

    def spell(self) -> str: ...

    def tag(self) -> str: ...

    def buffers(self, out_features: int, in_features: int) -> dict[str, TensorType]: ...

    def check_shape(self, out_features: int, in_features: int) -> None: ...

    def check_read_shape(self, out_features: int, in_features: int, tensor: str) -> None: ...

    def check_buffers(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int, where: str
    ) -> None: ...

    def dequantize(
        self, bufs: Mapping[str, np.ndarray], out_features: int, in_features: int
    ) -> np.ndarray: ...

    def bytes_per_weight(self) -> float: ...

    @property
    def fragment(self) -> str: ...

    def act_quant_scheme(self) -> str | None: ...

    def declared_act_bits(self) -> int: ...

    def act_quant_rule(self, bufs: Mapping[str, np.ndarray]) -> dict[str, float]: ...

    def act_scale_attr(self) -> str | None: ...

    def describe(self) -> dict[str, Any]: ...

    def rows(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
    ) -> dict[str, np.ndarray]: ...

    def row_unit(self) -> int: ...

    def column_unit(self, in_features: int) -> int: ...

    def column_part(self, in_features: int, start: int, stop: int) -> WeightFormat: ...

    def recast(
        self, fmt: WeightFormat, bufs: Mapping[str, np.ndarray], in_features: int
    ) -> dict[str, np.ndarray] | None: ...

    def columns(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
        where: str,
    ) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class QWeight:
    """A quantized (or plain) linear weight in nn.Linear orientation [out_features, in_features].

    With `bias`, the linear's bias travels with it: `qlinear(x, W)` is x W^T + b, b a float32
    buffer "bias" [out_features] beside the format's (a checkpoint's f16/bf16 bias widens to it
    exactly), added to the float32 sums before they round to the activation type. A weight
    carries its bias through every fusion that moves weights (merged q/k/v launches keep one per
    segment)."""

    format: WeightFormat
    out_features: int
    in_features: int
    bias: bool = False

    def __str__(self) -> str:
        bias = "+bias" if self.bias else ""
        return f"qweight<{self.format.spell()}>[{self.out_features}, {self.in_features}]{bias}"

    def buffers(self) -> dict[str, TensorType]:
        """The kernel-layout buffers: the format's, then the bias."""
        out = dict(self.format.buffers(self.out_features, self.in_features))
        if self.bias:
            out["bias"] = TensorType((self.out_features,), F32)
        return out


@dataclass(frozen=True)
class QExperts:
    """Stacked expert weights [E, out, in]: `count` weights of one type (format, shape), as one
    value. Each of the expert type's kernel-layout buffers gains a leading dim of `count`, so
    expert e's buffers start e times one expert's elements in (per-expert scalars such as an
    NVFP4 per-tensor scale become [E, 1]): a kernel reaches an expert by moving every buffer
    pointer, and each format's fragment reads it unchanged."""

    expert: QWeight
    count: int

    def __str__(self) -> str:
        return f"experts<{self.count}, {self.expert}>"

    @property
    def format(self) -> WeightFormat:
        return self.expert.format

    @property
    def out_features(self) -> int:
        return self.expert.out_features

    @property
    def in_features(self) -> int:
        return self.expert.in_features

    def expert_buffers(self) -> dict[str, TensorType]:
        """One expert's kernel-layout buffers."""
        return dict(self.expert.buffers())

    def buffers(self) -> dict[str, TensorType]:
        """The stacked buffers: each expert buffer with a leading dim of `count`."""
        return {
            n: TensorType((self.count, *t.shape), t.dtype) for n, t in self.expert_buffers().items()
        }


@dataclass(frozen=True)
class TupleType:
    """The results of a multi-output node (a merged gate/up or q/k/v qlinear); `get` projects."""

    elements: tuple[TensorType, ...]

    def __str__(self) -> str:
        return f"({', '.join(str(e) for e in self.elements)})"


@dataclass(frozen=True)
class QActType:
    """An activation quantized for W4A4 kernels: `source` is the 16-bit tensor it was made from.

    Storage is one byte buffer [M, row_bytes]: per row the packed E2M1 codes (K/2 bytes), then
    one float32 dequant factor per 16 elements (the E4M3 block scale folded with the global
    scale), so the GEMV reads codes and factors of a row with 16-byte loads."""

    scheme: str
    source: TensorType

    def __str__(self) -> str:
        return f"qact<{self.scheme}, {self.source}>"

    def concrete_rows(self, sizes: dict[str, int]) -> int:
        return self.source.concrete(sizes)[0]

    @property
    def row_bytes(self) -> int:
        k = self.source.shape[1]
        assert isinstance(k, int)
        return k // 2 + 4 * (k // 16)


ValueType = TensorType | QWeight | QExperts | TupleType | QActType
