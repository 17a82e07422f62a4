"""GPTQ checkpoints (`quant_method: "gptq"`): `<module>.qweight/.qzeros/.scales[/.g_idx]`,
repacked at load (see qir.formats.gptq)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qir.errors import FormatError
from qir.formats import gptq
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import (
    OUT_IN,
    Axes,
    Cut,
    QuantConvention,
    TensorReader,
    Unsliceable,
    register_convention,
)
from qir.models.quant_conventions.common import config_int, not_converted, quant_config, tensors
from qir.models.quant_conventions.dense import read_dense, stored_dense
from qir.types import QWeight

_TENSORS = ("qweight", "qzeros", "scales")


def matches_config(config: Mapping[str, Any]) -> bool:
    return quant_config(config, "gptq") is not None


def _gptq_linear(ck: CheckpointView, module: str) -> Linear:
    q = quant_config(ck.config, "gptq")
    assert q is not None  # the convention matched on it
    # HF writes `checkpoint_format`; GPTQModel's quantize_config.json calls it `format`.
    checkpoint_format = q.get("checkpoint_format", q.get("format", "gptq"))
    if checkpoint_format not in gptq.ZERO_OFFSET:
        raise FormatError(
            f"not supported: GPTQ checkpoint_format {checkpoint_format} "
            "(quantization_config.checkpoint_format)"
        )
    bits = config_int(q, "bits")
    if bits not in gptq.BITS:
        raise FormatError(f"not supported: GPTQ {bits}-bit (quantization_config.bits)")
    group_size = config_int(q, "group_size")
    if group_size < 1 and group_size != -1:
        raise FormatError(f"quantization_config.group_size: {group_size}, expected -1 or >= 1")
    if not_converted(q, module) or stored_dense(ck, module, "qweight"):
        return read_dense(ck, module)
    qweight, qzeros, scales = tensors(
        ck, module, _TENSORS, f"a GPTQ linear needs {', '.join(_TENSORS)}[, g_idx]"
    )
    g_idx = ck.store.get(f"{module}.g_idx") if f"{module}.g_idx" in ck.store else None
    fmt, out_features, in_features, bufs = gptq.repack(
        qweight, qzeros, scales, g_idx, bits, group_size, checkpoint_format, module
    )
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _files(config: Mapping[str, Any]) -> tuple[str, ...]:
    """auto-gptq's file: quantize_config's model_file_base_name, by default
    gptq_model-<bits>bit-<group_size>g (what its save_quantized writes and from_quantized reads)."""
    q = quant_config(config, "gptq")
    assert q is not None
    base = q.get("model_file_base_name") or f"gptq_model-{q.get('bits')}bit-{q.get('group_size')}g"
    return (f"{base}.safetensors",)


def _axes(config: Mapping[str, Any]) -> Axes:
    # qweight [I*bits/32, O]; qzeros [G, O*bits/32] and scales [G, O] one row per group of g
    # inputs (the last may be short), or one for the row (group_size -1: every K part's);
    # g_idx numbers groups of the whole weight (a part's is its slice: qir.formats.gptq).
    q = quant_config(config, "gptq") or {}
    group = q.get("group_size")
    groups = f"in/{group}" if isinstance(group, int) and group >= 1 else ""
    return {
        **OUT_IN,
        "qweight": ("in", "out"),
        "qzeros": (groups, "out"),
        "scales": (groups, "out"),
        "g_idx": ("in?",),
    }


def _parts(
    reader: TensorReader, config: Mapping[str, Any], module: str, cut: Cut
) -> dict[str, np.ndarray] | None:
    """A K part of a linear with g_idx: its codes in proportion, its slice of g_idx, and the
    zeros and scales of only the groups that slice names, as Gptq.columns cuts them. A slice
    whose inputs sit in their own groups in order (g_idx stored though trivial) reads as a
    plain part of those groups; otherwise (desc_act) the part's inputs may sit in any of the
    whole's groups, so it keeps the whole's group count, the rows of groups it does not use
    zeros and never read."""
    axis, start, stop, whole = cut
    g_name = f"{module}.g_idx"
    if axis != "in" or g_name not in reader:
        return None
    q = quant_config(config, "gptq") or {}
    group = q.get("group_size")
    if not isinstance(group, int) or group == 0 or group < -1:
        raise Unsliceable(g_name)  # read whole: the whole's error
    group = whole if group == -1 else group  # -1: one group per row, every part's
    g_idx = np.asarray(reader.read(g_name, (slice(start, stop),)))
    used = np.unique(g_idx)
    in_order = (start % group == 0 or group >= whole) and np.array_equal(
        g_idx, np.arange(start, stop) // group
    )
    out = {f"{module}.qweight": reader.proportional(f"{module}.qweight", cut)}
    out[g_name] = (g_idx - start // group).astype(np.int32) if in_order else g_idx
    for t in ("qzeros", "scales"):
        name = f"{module}.{t}"
        shape = reader.store.shape(name)
        if len(shape) != 2 or not 0 <= used[0] <= used[-1] < shape[0]:
            raise Unsliceable(name)  # read whole: the whole's error
        rows = reader.read(name, (used, slice(None)))  # the rows of `used` only
        if in_order:
            out[name] = rows
        else:
            out[name] = np.zeros(shape, reader.dtype(name))
            out[name][used] = rows
    bias = f"{module}.bias"
    if bias in reader:
        out[bias] = reader.proportional(bias, cut)
    return out


register_convention(QuantConvention("gptq", matches_config, _gptq_linear, _files, _axes, _parts))
