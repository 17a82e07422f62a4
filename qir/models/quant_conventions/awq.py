"""AutoAWQ checkpoints (`quant_method: "awq"`): GEMM ones are repacked at load, GEMV ones read as
stored (see qir.formats.awq)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qir.errors import FormatError
from qir.formats import awq
from qir.formats.bitstream import pack_codes, unpack_codes
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
    return quant_config(config, "awq") is not None


def _awq_linear(ck: CheckpointView, module: str) -> Linear:
    q = quant_config(ck.config, "awq")
    assert q is not None  # the convention matched on it
    # transformers 5 calls the packing `format`; AutoAWQ and transformers 4 wrote `version`.
    version = str(q.get("version") or q.get("format") or "gemm").lower()
    if version not in ("gemm", "gemv"):
        raise FormatError(f"not supported: AWQ version {version} (quantization_config.version)")
    if q.get("zero_point", True) is not True:
        raise FormatError("not supported: AWQ zero_point false (quantization_config.zero_point)")
    bits = config_int(q, "bits")
    if bits != 4:
        raise FormatError(f"not supported: AWQ {bits}-bit (quantization_config.bits)")
    if not_converted(q, module) or stored_dense(ck, module, "qweight"):
        return read_dense(ck, module)
    qweight, qzeros, scales = tensors(
        ck, module, _TENSORS, f"an AWQ linear needs {', '.join(_TENSORS)}"
    )
    read = awq.repack_gemm if version == "gemm" else awq.read_gemv
    try:
        fmt, out_features, in_features, bufs = read(
            qweight, qzeros, scales, config_int(q, "group_size"), module
        )
    except FormatError as e:
        if str(e).startswith(module):
            raise
        raise FormatError(f"{module}: {e}") from None
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _gemv(config: Mapping[str, Any]) -> bool:
    q = quant_config(config, "awq") or {}
    return str(q.get("version") or q.get("format") or "gemm").lower() == "gemv"


def _axes(config: Mapping[str, Any]) -> Axes:
    if _gemv(config):
        # qweight [O, I/8]; qzeros and scales padded to whole words of groups
        return {
            **OUT_IN,
            "qweight": ("out", "in"),
            "qzeros": ("out", "in?"),
            "scales": ("out", "in?"),
        }
    # GEMM: qweight and qzeros [I or I/g, O/8], scales [I/g, O]
    io = ("in", "out")
    return {**OUT_IN, "qweight": io, "qzeros": io, "scales": io}


def _parts(
    reader: TensorReader, config: Mapping[str, Any], module: str, cut: Cut
) -> dict[str, np.ndarray] | None:
    """A K part of a GEMV linear: the codes in proportion, the scales of its groups and the
    qzeros words that hold them (eight groups a word: at most a word per row more than its
    own), laid out in the part's own padded widths as AutoAWQ would write a linear of the
    part's inputs (what Awq.columns cuts from the whole)."""
    axis, start, stop, _ = cut
    if axis != "in" or not _gemv(config):
        return None
    q = quant_config(config, "awq") or {}
    g = q.get("group_size")
    names = {t: f"{module}.{t}" for t in ("qweight", "qzeros", "scales")}
    if (
        not isinstance(g, int)
        or g < 1
        or start % g
        or stop % g
        or not all(n in reader for n in names.values())
    ):
        raise Unsliceable(module)  # read whole: the whole's error, or the cut's refusal
    out_features = reader.shape(names["qweight"])[0]
    g0, g1 = start // g, stop // g
    w0, w1 = g0 // 8, -(-g1 // 8)
    zw = awq.zeros_width(stop - start, g)
    words = reader.read(names["qzeros"], (slice(None), slice(w0, w1)))
    zeros = np.zeros((out_features, 8 * zw), np.uint32)
    zeros[:, : g1 - g0] = unpack_codes(words.view(np.uint32), 4, 8 * (w1 - w0))[
        :, g0 - 8 * w0 : g1 - 8 * w0
    ]
    scales = np.zeros((out_features, 8 * zw), np.float16)
    scales[:, : g1 - g0] = reader.read(names["scales"], (slice(None), slice(g0, g1)))
    out = {
        names["qweight"]: reader.proportional(names["qweight"], cut),
        names["qzeros"]: pack_codes(zeros, 4).view(np.int32),
        names["scales"]: scales,
    }
    if f"{module}.bias" in reader:
        out[f"{module}.bias"] = reader.proportional(f"{module}.bias", cut)
    return out


register_convention(QuantConvention("awq", matches_config, _awq_linear, axes=_axes, parts=_parts))
