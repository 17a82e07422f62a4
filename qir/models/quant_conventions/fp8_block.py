"""Block-wise FP8 linears (qir.formats.fp8_block): HF `quant_method: "fp8"` checkpoints (the
Qwen3-*-FP8 and DeepSeek-V3 releases, transformers' FineGrainedFP8), whose convention is here, and
compressed-tensors FP8_BLOCK (`strategy: "block"`, read by ct_float through `read_fp8_block`).

HF: `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128,
128], "activation_scheme": "dynamic", "modules_to_not_convert": [...]}`; a linear is `weight`
e4m3 [O, I] and `weight_scale_inv` f32 [ceil(O/128), ceil(I/128)], a multiplier despite its
name. Modules left in 16 bits (lm_head, and those `modules_to_not_convert` lists) read as dense.
Activation quantization is not applied (weight-only, see qir.formats.fp8_block).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qir.errors import FormatError
from qir.formats.fp8_block import BLOCK, Fp8Block
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.quant_conventions.base import OUT_IN, Axes, QuantConvention, register_convention
from qir.models.quant_conventions.common import expect_matrix, not_converted, quant_config, tensors
from qir.models.quant_conventions.dense import is_excluded, read_dense, stored_dense
from qir.models.quant_conventions.fp8 import scaled_linear

# Scale dtypes widened to float32 exactly: HF writes f32 (UE8M0 in some DeepSeek releases),
# compressed-tensors the model dtype.
_SCALE_DTYPES = tuple(
    np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e8m0fnu)
)


def block_size(value: Any, where: str) -> Fp8Block:
    """The format of a `[rows, inputs]` block size read from config key `where`."""
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise FormatError(f"{where}: expected [rows, inputs] of the scale blocks, got {value!r}")
    if list(value) != [BLOCK, BLOCK]:
        raise FormatError(
            f"not supported: FP8 block size {list(value)} ({where}; qir reads [{BLOCK}, {BLOCK}])"
        )
    return Fp8Block(*value)


def read_fp8_block(ck: CheckpointView, module: str, fmt: Fp8Block, scale: str) -> Linear:
    """`<module>.weight` e4m3 [O, I] and `<module>.<scale>` [ceil(O/128), ceil(I/128)]."""
    name, scale_name = f"{module}.weight", f"{module}.{scale}"
    w, s = tensors(ck, module, ("weight", scale), f"a block FP8 linear needs .weight and .{scale}")
    expect_matrix(w, name, ml_dtypes.float8_e4m3fn, "[out, in]")
    out_features, in_features = w.shape
    fmt.check_read_shape(out_features, in_features, name)
    want = fmt.buffers(out_features, in_features)["scale"].shape
    if s.dtype not in _SCALE_DTYPES or tuple(s.shape) != want:
        raise FormatError(
            f"{scale_name}: {s.dtype} {list(s.shape)}, expected a float {list(want)} scale per "
            f"{fmt.block_out} x {fmt.block_in} block of a [{out_features}, {in_features}] weight"
        )
    return scaled_linear(module, fmt, w, s, scale_name)


def _hf_format(q: Mapping[str, Any]) -> Fp8Block:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise FormatError(f"not supported: FP8 fmt {fmt!r} (quantization_config.fmt; only e4m3)")
    if q.get("weight_block_size") is None:
        raise FormatError(
            "not supported: FP8 without weight_block_size (per-tensor weight_scale_inv; "
            "quantization_config.weight_block_size)"
        )
    return block_size(q["weight_block_size"], "quantization_config.weight_block_size")


def matches_config(config: Mapping[str, Any]) -> bool:
    q = quant_config(config, "fp8")
    if q is None:
        return False
    _hf_format(q)
    return True


def _linear(ck: CheckpointView, module: str) -> Linear:
    q = quant_config(ck.config, "fp8")
    assert q is not None  # the convention matched on it
    if (
        not_converted(q, module)
        or is_excluded(module, q.get("modules_to_not_convert"))
        or stored_dense(ck, module, "weight_scale_inv")
    ):
        return read_dense(ck, module)
    return read_fp8_block(ck, module, _hf_format(q), "weight_scale_inv")


def block_axes(fmt: Fp8Block) -> Axes:
    # weight [O, I]; one scale per block [ceil(O/bo), ceil(I/bi)]: a part takes the blocks it
    # covers (a cut off the blocks is read whole, then cut or refused)
    scale = (f"out/{fmt.block_out}", f"in/{fmt.block_in}")
    return {**OUT_IN, "weight_scale_inv": scale, "weight_scale": scale}


def _axes(config: Mapping[str, Any]) -> Axes:
    q = quant_config(config, "fp8")
    return block_axes(_hf_format(q)) if q is not None else OUT_IN


register_convention(QuantConvention("fp8_block", matches_config, _linear, axes=_axes))
