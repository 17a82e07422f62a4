"""Mixture-of-experts maths: the routing rules and the expert qlinear's reference semantics, in
float32 numpy (the interpreter calls these; qir.ops holds their type rules).

A router's logits [M, E] become, per row, k expert ids and k weights by one of the rules the
families use:

- "softmax_topk": the softmax over all E experts, then the k largest probabilities (Qwen3-MoE
  and Qwen2-MoE with `norm_topk_prob: false`);
- "softmax_topk_norm": the same, renormalised to sum to 1 over the k (Mixtral always; Qwen3-MoE
  with `norm_topk_prob: true`);
- "topk_softmax": the k largest logits, then the softmax over those k (gpt-oss);
- "sigmoid_topk": the k largest logits, each weighted by its own sigmoid, not normalised
  (Qwen2-MoE's shared expert: one expert, always chosen, scaled by sigmoid(shared_expert_gate
  x); DeepSeek-V3's scores before its normalisation).

The k are chosen on the logits themselves, largest first, ties to the lower expert id (what
torch.topk returns for these inputs); the softmax is monotone, so this is the choice the
probabilities (or sigmoids) give, except where two different logits round to one probability. Slot j of a row
is its j-th choice. The weights are float32.

An expert qlinear computes, for each (row m, slot j), y[m, j] = x[m] W[ids[m, j]]^T (x[m, j]
where the input holds one row per slot; plus expert ids[m, j]'s bias where the experts carry
one), rounded to the activation type as a plain qlinear's result; with the silu_mul epilogue,
act(g) * u of a gate/up pair as qlinear's (act: silu, gelu_tanh, or gpt-oss's "swiglu_clamp":
swiglu_gate(g) * swiglu_up(u) with the node's limit and alpha); with "combine",
sum_j w[m, j] * y[m, j] in float32, slot 0 first, rounded once ("combine_residual": then r plus
that, rounded again, as a separate add would). With the rms_norm prologue the rows read are
rms_norm(x, nw) rounded to the activation type, as the separate rms_norm stores them.

W4A4 experts (`act_quant`, batches of at most W4A4_MAX_M rows) quantize each (row m, slot j)'s
input with expert ids[m, j]'s own calibrated scale (`quantize_slots`), as the producers'
runtimes quantize each expert module's input with its own input quantizer: the same token
routed to two experts is quantized twice, once under each scale. This is exact against the
reference; one quantization per token under a per-row runtime scale would not be (the block
scales, hence the codes, depend on the global scale). Experts that calibrated no scale
(`--weight-quantization w4a4` on W4A16 checkpoints) take a per-row scale, which is the same for
every expert a row chose. A gate/up pair quantizes its input once: its gate and up experts'
scales must agree (the producers calibrate both on the same input)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

RULES = ("softmax_topk", "softmax_topk_norm", "topk_softmax", "sigmoid_topk")
EPILOGUES = ("silu_mul", "combine", "combine_residual")
# The gate activations of an expert gate/up pair (the node's `act`); swiglu_clamp takes the
# attributes limit and alpha.
GATE_ACTS = ("silu", "gelu_tanh", "swiglu_clamp")


def swiglu_gate(g: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's gate factor, float32: min(g, limit) * sigmoid(alpha * min(g, limit))."""
    c = np.minimum(np.asarray(g, np.float32), np.float32(limit))
    out: np.ndarray = c / (np.float32(1) + np.exp(-np.float32(alpha) * c))
    return out


def swiglu_up(u: np.ndarray, limit: float) -> np.ndarray:
    """gpt-oss's up factor, float32: clamp(u, -limit, limit) + 1."""
    lim = np.float32(limit)
    out: np.ndarray = np.clip(np.asarray(u, np.float32), -lim, lim) + np.float32(1)
    return out


def select(logits: np.ndarray, k: int) -> np.ndarray:
    """int32 [M, k]: each row's k largest logits' ids, largest first, ties to the lower id."""
    order = np.argsort(-np.asarray(logits, np.float32), axis=-1, kind="stable")
    ids: np.ndarray = order[:, :k].astype(np.int32)
    return ids


def route(logits: np.ndarray, k: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [M, k], weights float32 [M, k]) of router logits [M, E] under `rule`."""
    if rule not in RULES:
        raise ValueError(f"unknown routing rule {rule!r}; known: {', '.join(RULES)}")
    x = np.asarray(logits, np.float32)
    ids = select(x, k)
    top = np.take_along_axis(x, ids, axis=-1)
    if rule == "sigmoid_topk":
        one = np.float32(1)
        return ids, (one / (one + np.exp(-top))).astype(np.float32)
    if rule == "topk_softmax":
        e = np.exp(top - top[:, :1])
        return ids, (e / e.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32)
    e_all = np.exp(x - x.max(axis=-1, keepdims=True))
    e = np.take_along_axis(e_all, ids, axis=-1)
    total = e if rule == "softmax_topk_norm" else e_all
    return ids, (e / total.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32)


def per_slot(x: np.ndarray, k: int) -> np.ndarray:
    """float32 [M, k, K]: each slot's input row (a token's row repeated for [M, K] inputs)."""
    x = np.asarray(x, np.float32)
    return x if x.ndim == 3 else np.repeat(x[:, None, :], k, axis=1)


def expert_matmul(
    x: np.ndarray, w: np.ndarray, ids: np.ndarray, bias: np.ndarray | None = None
) -> np.ndarray:
    """float32 [M, k, N]: row (m, j) of x [M, k, K] times expert ids[m, j] of w [E, N, K]
    (plus that expert's bias [E, N]), float32 sums."""
    m, k, _ = x.shape
    out = np.zeros((m, k, w.shape[1]), np.float32)
    for e in np.unique(ids):
        rows = ids == e
        out[rows] = x[rows] @ w[e].T + (np.float32(0) if bias is None else bias[e])
    return out


def quantize_slots(
    x: np.ndarray,
    ids: np.ndarray,
    quantize: Callable[..., np.ndarray],
    scales: np.ndarray | None = None,
    attr: str | None = None,
) -> np.ndarray:
    """float32 [M, k, K]: each slot's input row x [M, k, K] fake-quantized by `quantize` (an
    activation quantizer, qir.formats.ACT_QUANTIZERS) under its expert's scale: keyword `attr`
    with scales[ids[m, j]] (scales [E], as stored), or per row where `scales` is None."""
    x = np.asarray(x, np.float32)
    if scales is None:
        return quantize(x)
    assert attr is not None
    out = np.empty_like(x)
    for e in np.unique(ids):
        rows = ids == e
        out[rows] = quantize(x[rows], **{attr: float(scales[e])})
    return out


def combine(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """float32 [M, N]: sum_j weights[m, j] * y[m, j], slot 0 first."""
    y32, w32 = np.asarray(y, np.float32), np.asarray(weights, np.float32)
    acc = np.zeros((y32.shape[0], y32.shape[2]), np.float32)
    for j in range(y32.shape[1]):
        acc = acc + w32[:, j, None] * y32[:, j]
    return acc


def active_experts(ids: Sequence[int] | np.ndarray) -> list[int]:
    """The distinct experts a set of ids chose, ascending."""
    return sorted({int(i) for i in np.asarray(ids).ravel()})
