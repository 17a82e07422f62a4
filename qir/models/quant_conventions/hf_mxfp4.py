"""HF `quant_method: "mxfp4"` checkpoints (gpt-oss, docs/formats.md): only the routed
experts are MXFP4, stacked per projection as `<module>_blocks` u8 [E, O, I/32, 16] (E2M1 pairs,
low nibble first), `<module>_scales` u8 [E, O, I/32] (E8M0) and `<module>_bias` [E, O]; every
other linear (`modules_to_not_convert`: attention, router, embeddings, lm_head) is stored
unquantized and reads as dense.

The blocks' bytes are the MXFP4 kernel layout's `weight` rows as they are (qir.formats.mx): the
stacked experts only reshape [O, I/32, 16] to [O, I/2], and a row view (gpt-oss's interleaved
gate/up: gate rows 0::2, up rows 1::2) slices rows of every buffer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qir.dtypes import BF16, F16, F32
from qir.errors import FormatError
from qir.formats.mx import GROUP_SIZE, Mxfp4
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import QuantConvention, register_convention
from qir.models.quant_conventions.common import quant_config, tensor
from qir.models.quant_conventions.dense import read_dense
from qir.types import QExperts, QWeight


def matches_config(config: Mapping[str, Any]) -> bool:
    return quant_config(config, "mxfp4") is not None


def read_linear(ck: CheckpointView, module: str) -> Linear:
    """A linear outside the experts: stored unquantized (modules_to_not_convert)."""
    if f"{module}.weight" not in ck.store and f"{module}_blocks" in ck.store:
        raise FormatError(
            f"{module}_blocks: MXFP4 stacked experts read as experts, not as one linear"
        )
    return read_dense(ck, module)


def stacked_experts(
    ck: CheckpointView, module: str, count: int, rows: slice = slice(None)
) -> tuple[QExperts, dict[str, np.ndarray]]:
    """The `count` experts of `module` (`<module>_blocks/_scales/_bias`), rows `rows` of each
    (a gate or up of gpt-oss's interleaved gate_up_proj): one stacked MXFP4 weight with a bias."""
    what = "MXFP4 stacked experts need _blocks, _scales and _bias"
    blocks = tensor(ck, f"{module}_blocks", what)
    scales = tensor(ck, f"{module}_scales", what)
    bias = tensor(ck, f"{module}_bias", what)
    if blocks.dtype != np.uint8 or blocks.ndim != 4 or blocks.shape[0] != count:
        raise FormatError(
            f"{module}_blocks: {blocks.dtype} {list(blocks.shape)}, expected u8 [{count}, out, "
            f"in/{GROUP_SIZE}, {GROUP_SIZE // 2}] ({count} experts)"
        )
    e, out, groups, half = blocks.shape
    if half != GROUP_SIZE // 2:
        raise FormatError(
            f"{module}_blocks: last dim {half}, expected {GROUP_SIZE // 2} (a block's 32 codes)"
        )
    if scales.dtype != np.uint8 or scales.shape != (e, out, groups):
        raise FormatError(
            f"{module}_scales: {scales.dtype} {list(scales.shape)}, expected u8 "
            f"{[e, out, groups]} (an E8M0 scale per block of {module}_blocks)"
        )
    if bias.dtype not in (BF16.np, F16.np, F32.np) or bias.shape != (e, out):
        raise FormatError(
            f"{module}_bias: {bias.dtype} {list(bias.shape)}, expected a float [{e}, {out}]"
        )
    weight = blocks.reshape(e, out, groups * half)[:, rows]
    n = weight.shape[1]
    bufs = {
        "weight": np.ascontiguousarray(weight),
        "scales": np.ascontiguousarray(scales[:, rows]),
        "bias": np.ascontiguousarray(bias[:, rows], dtype=np.float32),
    }
    w = QWeight(Mxfp4(), n, groups * GROUP_SIZE, bias=True)
    fmt = w.format
    fmt.check_read_shape(n, w.in_features, f"{module}_blocks")
    for i in range(e):
        fmt.check_buffers(
            {b: bufs[b][i] for b in ("weight", "scales")}, n, w.in_features, f"{module}[{i}]"
        )
    if not np.all(np.isfinite(bufs["bias"])):
        raise FormatError(f"{module}_bias: contains NaN or Inf")
    return QExperts(w, e), bufs


register_convention(QuantConvention("hf_mxfp4", matches_config, read_linear))
