"""Rotary position embedding frequencies: the one definition the interpreter and the kernels
share (the kernels get the table as constants, so both rotate by the same float32 angles).

A `rope` op carries its scaling as attributes: `theta`, `rope_type` (one of ROPE_TYPES) and,
per type, the parameters REQUIRED lists. Frequencies follow transformers' Llama: the default
`1 / theta^(2i / head_dim)` in float32, `linear` divides them by `factor`, `llama3` divides the
low frequencies by `factor` and blends the middle band (Llama 3.1's rope_scaling), `longrope`
(Phi-3's LongRoPE) divides pair i's by `factors[i]` and scales cos and sin by
`attention_factor` (which of the checkpoint's short or long factors a block takes is the model
builder's choice: qir.models.checkpoint.Checkpoint.rope_of),
`yarn` blends interpolated (divided by `factor`) and original frequencies along a linear ramp
between the dimensions that turn `beta_fast` and `beta_slow` times in `original_max_position_embeddings`
positions (floored / ceiled to whole dimensions unless `truncate` is false, as gpt-oss has it)
and scales cos and sin by `attention_factor` (transformers' `_compute_yarn_parameters`; the
loader fills the defaults it fills: beta 32 / 1, truncate true, the factor's mscale)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("factors", "attention_factor"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "truncate",
        "attention_factor",
    ),
}
# Every attribute a rope op may carry.
ATTRS = frozenset({"head_dim", "theta", "rope_type"} | {p for ps in REQUIRED.values() for p in ps})


def rope_problem(attrs: Mapping[str, Any]) -> str | None:
    """Why these rope attributes are not a rotation qir computes, or None."""
    kind = attrs.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    theta = attrs.get("theta")
    if not isinstance(theta, float) or not theta > 0:
        return f"theta must be a positive float, got {theta!r}"
    d = attrs.get("head_dim")
    if isinstance(d, bool) or not isinstance(d, int) or d < 2 or d % 2:
        return f"head_dim must be an even int >= 2, got {d!r}"
    for p in REQUIRED[kind]:
        v = attrs.get(p)
        if p == "factors":
            if (
                not isinstance(v, tuple)
                or len(v) != d // 2
                or not all(isinstance(f, float) and f > 0 for f in v)
            ):
                return f"rope_type {kind} needs {p} as {d // 2} positive floats (head_dim / 2)"
        elif p == "original_max_position_embeddings":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                return f"rope_type {kind} needs {p} as an int >= 1, got {v!r}"
        elif p == "truncate":
            if not isinstance(v, bool):
                return f"rope_type {kind} needs {p} as a bool, got {v!r}"
        elif not isinstance(v, float) or not v > 0:
            return f"rope_type {kind} needs {p} as a positive float, got {v!r}"
    if kind == "llama3" and not attrs["high_freq_factor"] > attrs["low_freq_factor"]:
        return "rope_type llama3 needs high_freq_factor > low_freq_factor"
    extra = {k for k in attrs if k in ATTRS} - {"head_dim", "theta", "rope_type", *REQUIRED[kind]}
    if extra:
        return f"rope_type {kind} takes no {', '.join(sorted(extra))}"
    return None


def inv_freq(attrs: Mapping[str, Any]) -> np.ndarray:
    """float32 [head_dim / 2]: the angle per position of each rotated pair."""
    d = int(attrs["head_dim"])
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    power = (np.float32(attrs["theta"]) ** exponent).astype(np.float32)
    freq = (np.float32(1) / power).astype(np.float32)
    kind = attrs.get("rope_type", "default")
    if kind == "linear":
        return (freq / np.float32(attrs["factor"])).astype(np.float32)
    if kind == "longrope":
        return (np.float32(1) / (np.asarray(attrs["factors"], np.float32) * power)).astype(
            np.float32
        )
    if kind == "llama3":
        factor, low, high = attrs["factor"], attrs["low_freq_factor"], attrs["high_freq_factor"]
        old = attrs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq.astype(np.float64)
        scaled = np.where(wavelen > old / low, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    if kind == "yarn":
        return _yarn(freq, power, attrs)
    return freq


def yarn_attention_factor(
    factor: float, mscale: float | None, mscale_all_dim: float | None
) -> float:
    """transformers' default `attention_factor` of a yarn config that sets none."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


def _yarn(freq: np.ndarray, pos: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    d, base = int(attrs["head_dim"]), float(attrs["theta"])
    old = int(attrs["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in `old`
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(float(attrs["beta_fast"])), dim_of(float(attrs["beta_slow"]))
    if attrs["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip(
        (np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
    ).astype(np.float32)
    keep = np.float32(1) - ramp  # the share of the original (extrapolated) frequency
    interpolated = (np.float32(1) / (np.float32(attrs["factor"]) * pos)).astype(np.float32)
    result: np.ndarray = (interpolated * (np.float32(1) - keep) + freq * keep).astype(np.float32)
    return result


def cos_sin_scale(attrs: Mapping[str, Any]) -> float:
    """The factor cos and sin are scaled by (yarn's attention_factor; 1 otherwise)."""
    return float(attrs.get("attention_factor", 1.0))


def rotate(x: np.ndarray, positions: np.ndarray, attrs: Mapping[str, Any]) -> np.ndarray:
    """x [M, heads * head_dim] float32 rotated per head (the rotate-half convention: element i
    pairs with i + head_dim/2), each row by the angle of its position (cos and sin times the
    attention_factor where the type has one); float32 throughout."""
    d = int(attrs["head_dim"])
    m = x.shape[0]
    angles = positions.astype(np.float32)[:, None] * inv_freq(attrs)[None, :]
    scale = np.float32(cos_sin_scale(attrs))
    cos, sin = (np.cos(angles) * scale)[:, None, :], (np.sin(angles) * scale)[:, None, :]
    h = x.astype(np.float32).reshape(m, -1, d)
    a, b = h[..., : d // 2], h[..., d // 2 :]
    out = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.reshape(m, -1).astype(np.float32)
