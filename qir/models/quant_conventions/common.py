"""What several conventions share when reading a checkpoint: the `quantization_config` of a
`quant_method` (and ModelOpt's), its integer keys and `modules_to_not_convert`, and the
checkpoint tensors a linear needs. Registers no convention."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from qir.errors import FormatError
from qir.models.checkpoint_view import CheckpointView


def quant_config(config: Mapping[str, Any], method: str) -> Mapping[str, Any] | None:
    """config.json's `quantization_config` if its `quant_method` is `method`, else None."""
    q = config.get("quantization_config")
    return q if isinstance(q, Mapping) and q.get("quant_method") == method else None


def modelopt_quant(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """ModelOpt's quantization facts: config.json's quantization_config, or the `quantization`
    section of hf_quant_config.json (which loader.load folds in as `hf_quant_config`)."""
    q = quant_config(config, "modelopt")
    if q is not None:
        return q
    hf = config.get("hf_quant_config")
    if isinstance(hf, Mapping) and isinstance(hf.get("quantization"), Mapping):
        result: Mapping[str, Any] | None = hf["quantization"]
        return result
    return None


def config_int(q: Mapping[str, Any], key: str) -> int:
    """The integer `quantization_config.<key>`."""
    value = q.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"quantization_config.{key}: expected an integer, got {value!r}")
    return value


def regex_match(pattern: str, module: str) -> bool:
    """Whether the `re:<regex>` entry of a config list matches `module` from its start."""
    try:
        return re.match(pattern[3:], module) is not None
    except re.error as e:
        raise FormatError(
            f"quantization_config: {pattern!r} is not a regular expression ({e})"
        ) from None


def not_converted(q: Mapping[str, Any], module: str) -> bool:
    """Whether HF's `modules_to_not_convert` leaves `module` unquantized: a substring test, as
    AutoAWQ and transformers do (not is_excluded's whole-component match)."""
    return any(isinstance(s, str) and s in module for s in q.get("modules_to_not_convert") or [])


def tensor(ck: CheckpointView, name: str, what: str = "") -> np.ndarray:
    """The checkpoint tensor `name`; a missing one is refused saying it is `what` (or, without
    `what`, which checkpoint lacks it)."""
    if name not in ck.store:
        raise FormatError(
            f"{name}: missing ({what})" if what else f"{name}: missing from {ck.path}"
        )
    return ck.store.get(name)


def tensors(ck: CheckpointView, module: str, names: Iterable[str], what: str) -> list[np.ndarray]:
    """`<module>.<name>` for each of `names`, all present (else the first missing is refused
    saying `what`)."""
    names = [f"{module}.{name}" for name in names]
    for name in names:
        tensor(ck, name, what)
    return [ck.store.get(name) for name in names]


def expect_matrix(a: np.ndarray, name: str, dtype: DTypeLike, shape: str) -> np.ndarray:
    """`a`, checkpoint tensor `name`, if it is 2-D of `dtype`; errors spell the expected shape
    `shape` (e.g. "[out, in/2]")."""
    if a.dtype != np.dtype(dtype) or a.ndim != 2:
        raise FormatError(f"{name}: {a.dtype} {list(a.shape)}, expected {np.dtype(dtype)} {shape}")
    return a


def matrix(
    ck: CheckpointView, name: str, dtype: DTypeLike, shape: str, what: str = ""
) -> np.ndarray:
    """The checkpoint tensor `name` (see tensor), checked by expect_matrix."""
    return expect_matrix(tensor(ck, name, what), name, dtype, shape)
