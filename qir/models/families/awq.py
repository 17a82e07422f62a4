"""AutoAWQ checkpoints (`quant_method: "awq"`): GEMM ones are repacked at load, GEMV ones read as
stored (see qir.formats.awq)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qir.formats import awq
from qir.formats.base import FormatError
from qir.models.checkpoint import Checkpoint, Linear
from qir.models.families import OUT_IN, Axes, Family, register_family
from qir.models.families.common import config_int, not_converted, quant_config, tensors
from qir.models.families.dense import read_dense, stored_dense
from qir.types import QWeight

_TENSORS = ("qweight", "qzeros", "scales")


def matches_config(config: Mapping[str, Any]) -> bool:
    return quant_config(config, "awq") is not None


def _awq_linear(ck: Checkpoint, module: str) -> Linear:
    q = quant_config(ck.config, "awq")
    assert q is not None  # the family matched on it
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


def _axes(config: Mapping[str, Any]) -> Axes:
    q = quant_config(config, "awq") or {}
    if str(q.get("version") or q.get("format") or "gemm").lower() == "gemv":
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


register_family(Family("awq", matches_config, _awq_linear, axes=_axes))
