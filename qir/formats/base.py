"""The interface every weight format implements.

A format is data and maths only: it knows its checkpoint tensors, its kernel-layout buffers,
how to repack one into the other, how to dequantize in numpy, how to quantize a float weight,
and which device dequant fragment codegen uses for it. It imports only the IR's dtypes/types, and
the base class here implements the interface the IR asks a format through (qir.types.WeightFormat).

What every format shares lives here: parameter validation from a declarative `allowed` table
(checked at construction), the weight-shape check (`input_multiple`), the checks of a float weight
handed to `quantize` and of the kernel-layout buffers, and `check_tensor` / `dtype_among` for
the checkpoint tensors a format's reader converts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
from numpy.typing import DTypeLike

import qir.types as ir
from qir.dtypes import DType
from qir.errors import FormatError as FormatError  # re-exported: formats raise it
from qir.types import TensorType


@dataclass(frozen=True)
class Allowed:
    """The values one format parameter may take: one of `values`, or (given `test`) whatever
    `test` accepts, `expected` saying what that is. A refused value raises
    "<kind>: <name>=<value> not supported; expected <expected>", or `refusal` when given (a
    str.format template of {value} and {expected})."""

    values: tuple[Any, ...] = ()
    test: Callable[[Any], bool] | None = None
    expected: str = ""
    refusal: str = ""

    def admits(self, value: Any) -> bool:
        return self.test(value) if self.test is not None else value in self.values

    def expectation(self) -> str:
        if self.expected or self.test is not None:
            return self.expected
        spelled = [_spell_value(v) for v in self.values]
        return spelled[0] if len(spelled) == 1 else f"one of {', '.join(spelled)}"

    def message(self, kind: str, name: str, value: Any) -> str:
        if self.refusal:
            return self.refusal.format(value=value, expected=self.expectation())
        shown = repr(value) if isinstance(value, str) else _spell_value(value)
        return f"{kind}: {name}={shown} not supported; expected {self.expectation()}"


# A format's `allowed` table: parameter name -> Allowed (a plain tuple: one of those values).
ParamTable = Mapping[str, Allowed | tuple[Any, ...]]


@dataclass(frozen=True)
class WeightFormat(ABC):
    # Registry key and IR spelling, e.g. "mlx_affine".
    kind: ClassVar[str]
    # The values each parameter may take, checked in this order when the format is constructed.
    allowed: ClassVar[ParamTable] = {}

    def __post_init__(self) -> None:
        for name, rule in self.allowed.items():
            rule = rule if isinstance(rule, Allowed) else Allowed(rule)
            value = getattr(self, name)
            if not rule.admits(value):
                raise FormatError(rule.message(self.kind, name, value))

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

    def input_multiple(self) -> tuple[int, str]:
        """What in_features must be a multiple of, and how errors name it ("" for no name).
        The default: the `group_size` parameter where there is one, else 8, because every GEMV
        reads weights and activations 8 at a time (16-byte loads)."""
        group = self.params().get("group_size")
        return (group, "the group size") if group else (8, "")

    def check_shape(self, out_features: int, in_features: int) -> None:
        """Raise FormatError if a weight of this shape cannot be held in this format: an empty
        weight, or in_features not a multiple of input_multiple()."""
        if out_features < 1 or in_features < 1:
            raise FormatError(f"{self.spell()}: empty weight [{out_features}, {in_features}]")
        n, what = self.input_multiple()
        if in_features % n:
            raise FormatError(
                f"{self.spell()}: in_features {in_features} is not a multiple of "
                f"{f'{what} ' if what else ''}{n}"
            )

    def check_read_shape(self, out_features: int, in_features: int, tensor: str) -> None:
        """check_shape of a shape read from the checkpoint tensor `tensor`, which errors name."""
        try:
            self.check_shape(out_features, in_features)
        except FormatError as e:
            raise FormatError(f"{tensor}: {e}") from None

    def _quantize_input(self, w: np.ndarray, finite: bool = True) -> np.ndarray:
        """The float32 [out, in] weight handed to quantize(), checked: 2-D, a shape this format
        holds and (with `finite`) no NaN or Inf."""
        w = np.asarray(w, dtype=np.float32)
        if w.ndim != 2:
            raise FormatError(f"{self.spell()}: quantize expects a 2-D weight, got {w.shape}")
        self.check_shape(*w.shape)
        if finite and not np.all(np.isfinite(w)):
            raise FormatError(f"{self.spell()}: quantize input contains NaN or Inf")
        return w

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

    def act_scale_attr(self) -> str | None:
        """The attribute act_quant_rule names its calibrated scale by (the weight's buffer of
        that scale is `input_scale`), or None where the format calibrated none."""
        return None

    def describe(self) -> dict[str, Any]:
        """Facts for `qir inspect`: `bits` per weight element, `group` (inputs per scale; None
        for one scale per row or tensor) and `w4a4` (calibrated for 4-bit activations). The
        default reads the usual parameter names; formats whose parameters say it otherwise
        override this."""
        p = self.params()
        w4a4 = self.declared_act_bits() == 4
        return {"bits": p.get("bits"), "group": p.get("group_size"), "w4a4": w4a4}

    def rows(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
    ) -> dict[str, np.ndarray]:
        """Rows start..stop of a weight's kernel-layout buffers, as views (no copy): every buffer
        that holds a row per output (a weight of stop - start rows has it shorter) is sliced,
        the rest (a per-tensor scale, GPTQ's g_idx) shared: Phi-3's fused q/k/v and gate/up
        read as the segments a merged launch takes."""
        full = self.buffers(out_features, in_features)
        part = self.buffers(stop - start, in_features)
        return {
            name: bufs[name][start:stop] if part[name].shape != t.shape else bufs[name]
            for name, t in full.items()
        }

    def row_unit(self) -> int:
        """What the first row of a row part (a column-parallel shard) must be a multiple of for
        the part to index its scales as the whole does: 1 where every row has its own."""
        return 1

    def column_unit(self, in_features: int) -> int:
        """What a K part's start and stop must be multiples of (its stop may also be
        in_features) to be exact: the group, block or packed word whose codes and scale one
        part holds whole. The default: input_multiple()."""
        return self.input_multiple()[0]

    def column_part(self, in_features: int, start: int, stop: int) -> WeightFormat:
        """The format of inputs start..stop (on column_unit boundaries) of a weight of
        in_features: this one, except where the whole's scales cover more than the part's own
        width would hold (GPTQ act-order, one group per row)."""
        return self

    def recast(
        self, fmt: ir.WeightFormat, bufs: Mapping[str, np.ndarray], in_features: int
    ) -> dict[str, np.ndarray] | None:
        """`bufs` of a weight in `fmt` as this format's buffers of the same weight, where that
        needs no requantizing (a shard read on its own may come out in a simpler variant of
        the whole's format); None where it cannot."""
        return dict(bufs) if fmt == self else None

    def columns(
        self,
        bufs: Mapping[str, np.ndarray],
        out_features: int,
        in_features: int,
        start: int,
        stop: int,
        where: str,
    ) -> dict[str, np.ndarray]:
        """Inputs start..stop of a weight's kernel-layout buffers (a row-parallel shard along K),
        as views where the layout allows: every buffer whose width follows in_features is cut in
        proportion (packed codes, one scale per group or block), the rest (per-row or
        per-tensor scales) shared. A cut that would split a group, block or packed word is
        refused in one line naming `where` (the tensor) and the group size: the shard would not
        be exact. Formats whose buffers pad or gather groups override this."""
        n, what = self.column_unit(in_features), self.input_multiple()[1]
        if start % n or stop % n or not 0 <= start < stop <= in_features:
            raise FormatError(
                f"{where}: a K split {start}..{stop} of in_features {in_features} is not on "
                f"{what or 'a packing unit'} {n} boundaries, so it cannot be exact"
            )
        full = self.buffers(out_features, in_features)
        part = self.buffers(out_features, stop - start)
        out: dict[str, np.ndarray] = {}
        for name, t in full.items():
            want, have = t.concrete({}), part[name].concrete({})
            if want == have:
                out[name] = bufs[name]
                continue
            axis = next(i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b)
            width = want[axis]
            lo, hi = start * width, stop * width
            if lo % in_features or hi % in_features or (hi - lo) // in_features != have[axis]:
                block = -(-in_features // width)
                raise FormatError(
                    f"{where}.{name}: a K split {start}..{stop} of in_features {in_features} is "
                    f"not on its blocks of {block} inputs, so it cannot be exact"
                )
            index = [slice(None)] * len(want)
            index[axis] = slice(lo // in_features, hi // in_features)
            out[name] = bufs[name][tuple(index)]
        return out

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


def check_tensor(a: np.ndarray, name: str, shape: tuple[int, ...], *dtypes: DTypeLike) -> None:
    """Refuse a checkpoint tensor `name` unless its dtype is one of `dtypes` (errors name the
    first), its shape is `shape` and, if it is float, it is finite."""
    if a.dtype not in [np.dtype(d) for d in dtypes]:
        raise FormatError(f"{name}: dtype {a.dtype}, expected {np.dtype(dtypes[0])}")
    if tuple(a.shape) != shape:
        raise FormatError(f"{name}: shape {list(a.shape)}, expected {list(shape)}")
    if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
        raise FormatError(f"{name}: contains NaN or Inf")


def refuse_codes(a: np.ndarray, codes: Iterable[int], name: str, what: str) -> None:
    """Refuse buffer `name` if any element of `a` is one of the byte `codes`, naming the first
    as a `what` code (e.g. "E8M0 NaN") and where it is."""
    a = np.asarray(a)
    hit = np.isin(a, list(codes))
    if hit.any():
        at = tuple(int(i) for i in np.argwhere(hit)[0])
        raise FormatError(f"{name}: {what} code 0x{int(a[at]):02X} at [{', '.join(map(str, at))}]")


def dtype_among(stored: np.dtype, choices: Iterable[DType], name: str) -> DType:
    """The DType among `choices` of checkpoint tensor `name`, stored as `stored`."""
    choices = tuple(choices)
    found = next((d for d in choices if d.np == stored), None)
    if found is None:
        names = ", ".join(d.np.name for d in choices)
        raise FormatError(f"{name}: dtype {stored}, expected one of {names}")
    return found


def _spell_value(v: Any) -> str:
    if isinstance(v, DType):
        return v.name
    return str(v)
