"""compressed-tensors `pack-quantized` int checkpoints (W4A16/W8A16): `<module>.weight_packed`,
`.weight_scale`, `.weight_shape`, read as stored (see qir.formats.ct_int).

Other compressed-tensors formats (nvfp4/mxfp4/float) have their own families; this matcher only
claims configs whose every config group is `pack-quantized` with int weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from qir.formats import ct_int
from qir.formats.base import FormatError
from qir.models.checkpoint import Checkpoint, Linear
from qir.models.families import Family, register_family
from qir.models.families.dense import is_excluded, read_dense, stored_dense
from qir.types import QWeight


def _qcfg(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    q = config.get("quantization_config")
    if isinstance(q, Mapping) and q.get("quant_method") == "compressed-tensors":
        return q
    return None


def _groups(q: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    groups = q.get("config_groups")
    return dict(groups) if isinstance(groups, Mapping) else {}


def _is_pack_quantized_int(q: Mapping[str, Any], group: Any) -> bool:
    if not isinstance(group, Mapping):
        return False
    weights = group.get("weights")
    fmt = group.get("format") or q.get("format")
    return (
        fmt == "pack-quantized"
        and isinstance(weights, Mapping)
        and weights.get("type") == "int"
        and weights.get("num_bits") in ct_int.BITS
    )


def matches_config(config: Mapping[str, Any]) -> bool:
    q = _qcfg(config)
    if q is None:
        return False
    groups = _groups(q)
    return bool(groups) and all(_is_pack_quantized_int(q, g) for g in groups.values())


def _targets(module: str, targets: Any) -> bool:
    """compressed-tensors target matching for the linears we load: `re:<regex>` against the
    module path, a plain name against the path or its class (every loaded module is a Linear)."""
    for t in targets or []:
        if t == "Linear" or t == module:
            return True
        if isinstance(t, str) and t.startswith("re:") and re.match(t[3:], module):
            return True
    return False


def _group_of(q: Mapping[str, Any], module: str) -> tuple[Mapping[str, Any], str] | None:
    """The `weights` scheme of the config group that quantizes `module`, and where it is; None
    for a module the config leaves unquantized (ignored, or targeted by no group)."""
    if is_excluded(module, q.get("ignore")):
        return None
    for name, group in _groups(q).items():
        if _targets(module, group.get("targets")):
            weights = group["weights"]
            assert isinstance(weights, Mapping)  # matches_config checked it
            return weights, f"quantization_config.config_groups.{name}.weights"
    return None


def _ct_linear(ck: Checkpoint, module: str) -> Linear:
    q = _qcfg(ck.config)
    assert q is not None  # the family matched on it
    found = _group_of(q, module)
    # Ignored and untargeted modules are stored unquantized, and so are 16/32-bit `.weight`s the
    # "Linear" target seems to cover but that are not Linears (embeddings).
    if found is None or stored_dense(ck, module, "weight_packed"):
        return read_dense(ck, module)
    w, where = found
    if w.get("symmetric") is False:
        raise FormatError(f"not supported: compressed-tensors asymmetric int ({where}.symmetric)")
    if w.get("actorder") == "group":
        raise FormatError(f"not supported: compressed-tensors actorder group ({where}.actorder)")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise FormatError(f"not supported: compressed-tensors int strategy {strategy} ({where})")
    bits = w["num_bits"]
    packed, scale = f"{module}.weight_packed", f"{module}.weight_scale"
    for name in (packed, scale):
        if name not in ck.store:
            raise FormatError(
                f"{name}: missing (a pack-quantized linear needs weight_packed, weight_scale)"
            )
    words = ck.store.get(packed)
    if words.ndim != 2 or words.dtype != np.int32:
        raise FormatError(
            f"{packed}: {words.dtype} {list(words.shape)}, expected int32 [out, in*{bits}/32]"
        )
    out_features, in_features = words.shape[0], words.shape[1] * 32 // bits
    if f"{module}.weight_shape" in ck.store:
        shape = ck.store.get(f"{module}.weight_shape")
        if [int(v) for v in np.asarray(shape).ravel()] != [out_features, in_features]:
            raise FormatError(
                f"{module}.weight_shape: {np.asarray(shape).tolist()}, but weight_packed holds "
                f"[{out_features}, {in_features}] (padded rows are not supported)"
            )
    group_size = in_features if strategy == "channel" else w.get("group_size")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise FormatError(f"{where}.group_size: expected an integer, got {group_size!r}")
    stored = ck.store.dtype(scale)
    scale_dtype = next((d for d in ct_int.SCALE_DTYPES if d.np == stored), None)
    if scale_dtype is None:
        names = ", ".join(d.np.name for d in ct_int.SCALE_DTYPES)
        raise FormatError(f"{scale}: dtype {stored}, expected one of {names}")
    fmt = ct_int.CtInt(bits, group_size, scale_dtype)
    try:
        fmt.check_shape(out_features, in_features)
    except FormatError as e:
        raise FormatError(f"{packed}: {e}") from None
    bufs = {"weight": words.view(np.uint32), "scales": ck.store.get(scale)}
    want = fmt.buffers(out_features, in_features)["scales"].shape
    if tuple(bufs["scales"].shape) != want:
        raise FormatError(
            f"{scale}: shape {list(bufs['scales'].shape)}, expected {list(want)} "
            f"(group size {group_size})"
        )
    if not np.all(np.isfinite(bufs["scales"].astype(np.float32))):
        raise FormatError(f"{scale}: contains NaN or Inf")
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


register_family(Family("ct_int", matches_config, _ct_linear))
