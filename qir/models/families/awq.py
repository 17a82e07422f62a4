"""AutoAWQ checkpoints (`quant_method: "awq"`): GEMM ones are repacked at load, GEMV ones read as
stored (see qir.formats.awq)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qir.formats import awq
from qir.formats.base import FormatError
from qir.models.checkpoint import Checkpoint, Linear
from qir.models.families import Family, register_family
from qir.models.families.dense import read_dense, stored_dense
from qir.types import QWeight

_TENSORS = ("qweight", "qzeros", "scales")


def _qcfg(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    q = config.get("quantization_config")
    return q if isinstance(q, Mapping) and q.get("quant_method") == "awq" else None


def matches_config(config: Mapping[str, Any]) -> bool:
    return _qcfg(config) is not None


def _int(q: Mapping[str, Any], key: str) -> int:
    value = q.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"quantization_config.{key}: expected an integer, got {value!r}")
    return value


def _awq_linear(ck: Checkpoint, module: str) -> Linear:
    q = _qcfg(ck.config)
    assert q is not None  # the family matched on it
    # transformers 5 calls the packing `format`; AutoAWQ and transformers 4 wrote `version`.
    version = str(q.get("version") or q.get("format") or "gemm").lower()
    if version not in ("gemm", "gemv"):
        raise FormatError(f"not supported: AWQ version {version} (quantization_config.version)")
    if q.get("zero_point", True) is not True:
        raise FormatError("not supported: AWQ zero_point false (quantization_config.zero_point)")
    bits = _int(q, "bits")
    if bits != 4:
        raise FormatError(f"not supported: AWQ {bits}-bit (quantization_config.bits)")
    # AutoAWQ and transformers leave a module unquantized when its path contains any of these as
    # a substring (not is_excluded's whole-component match: that is what the producers do).
    skipped = q.get("modules_to_not_convert") or []
    if any(isinstance(s, str) and s in module for s in skipped) or stored_dense(
        ck, module, "qweight"
    ):
        return read_dense(ck, module)
    for name in _TENSORS:
        if f"{module}.{name}" not in ck.store:
            raise FormatError(
                f"{module}.{name}: missing (an AWQ linear needs {', '.join(_TENSORS)})"
            )
    qweight, qzeros, scales = (ck.store.get(f"{module}.{name}") for name in _TENSORS)
    read = awq.repack_gemm if version == "gemm" else awq.read_gemv
    try:
        fmt, out_features, in_features, bufs = read(
            qweight, qzeros, scales, _int(q, "group_size"), module
        )
    except FormatError as e:
        if str(e).startswith(module):
            raise
        raise FormatError(f"{module}: {e}") from None
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


register_family(Family("awq", matches_config, _awq_linear))
