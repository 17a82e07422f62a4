"""What a model's logits go through besides the draw (qir.sampling): the `adjust_logits` op
(per-sequence restrictions and penalties, before the draw) and the `logprobs` op (scores of the
raw logits, for a client that asks). The interpreter runs these definitions; the kernels
(codegen/templates/adjust_logits.cu.j2, logprobs.cu.j2) compute the same.

adjust_logits, per row m, z = float32(logits[m]):

1. a token whose bit is clear in allow[m] (bit i % 32 of word i // 32) becomes -inf: a
   grammar's mask, allowed_token_ids, bad words, an eos held back by min_tokens;
2. for each entry c of the row (tokens[m, c] >= 0; the tokens of a row are distinct), with
   t = tokens[m, c], n = counts[m, c] and penalties[m] = (repetition, frequency, presence):
   z[t] += bias[m, c]; then where n >= 0 (t is in the prompt or the output; n is how often the
   output holds it; n = -1: a bias alone) z[t] = z[t] / repetition if z[t] > 0 else
   z[t] * repetition, z[t] -= frequency * n, and z[t] -= presence where n > 0.

That is vLLM's order and formulas (logit_bias, then its apply_penalties: repetition over the
prompt and output, frequency and presence over the output, as OpenAI defines them), each a
float32 operation rounded once, so the kernel's results are bit for bit these.

logprobs, per row: the target is targets[m], or next[m] (the id the row drew) where targets[m]
is DRAWN; a row whose target is SKIP or below 0 is not scored (ids -1, logprobs 0). With
z = float32(logits[m]) and lse = max z + log(sum exp(z - max z)), column 0 holds the target and
z[target] - lse, columns 1..k the k largest z (ties: the lower id first) and theirs. These are
the raw model's log-probabilities (vLLM's default, `raw_logprobs`): no temperature, penalty or
mask applies. The sum runs in float64 over float32 exps, so the kernel's values agree with
these to float32 rounding (not bit for bit: the order of the sum differs); the ids are exact.
"""

from __future__ import annotations

import numpy as np

# logprobs' targets: score the drawn id, or nothing.
DRAWN = -1
SKIP = -2
# An allow row's word that masks nothing.
ALL_ALLOWED = -1
# Entries of a row beyond its sequence's distinct tokens: its logit_bias's most tokens.
MAX_BIAS = 300
# A penalties row that changes nothing (repetition, frequency, presence).
NO_PENALTIES = (1.0, 0.0, 0.0)


def allow_words(vocab: int) -> int:
    """int32 words of a row of allow: a bit per token."""
    return -(-vocab // 32)


def allowed(allow: np.ndarray, vocab: int) -> np.ndarray:
    """bool [..., vocab] of allow bitmask rows int32 [..., words]."""
    bits = np.unpackbits(np.ascontiguousarray(allow).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab].astype(bool)


def bitmask(allowed_ids: np.ndarray, vocab: int) -> np.ndarray:
    """The int32 allow row of a bool [vocab] (True: allowed)."""
    bits = np.zeros(allow_words(vocab) * 32, np.uint8)
    bits[:vocab] = allowed_ids
    return np.packbits(bits, bitorder="little").view(np.int32)


def adjust_logits(
    logits: np.ndarray,
    penalties: np.ndarray,
    tokens: np.ndarray,
    counts: np.ndarray,
    bias: np.ndarray,
    allow: np.ndarray,
) -> np.ndarray:
    """float32 [M, vocab] (see the module docstring)."""
    z = np.asarray(logits).astype(np.float32)
    vocab = z.shape[1]
    z = np.where(allowed(allow, vocab), z, np.float32(-np.inf)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for m in range(len(z)):
            rep, freq, pres = (np.float32(p) for p in penalties[m])
            for t, n, b in zip(tokens[m].tolist(), counts[m].tolist(), bias[m], strict=True):
                if not 0 <= t < vocab:
                    continue
                v = np.float32(z[m, t] + np.float32(b))
                if n >= 0:
                    v = np.float32(v / rep) if v > 0 else np.float32(v * rep)
                    v = np.float32(v - np.float32(freq * np.float32(n)))
                    if n > 0:
                        v = np.float32(v - pres)
                z[m, t] = v
    return z


def logprobs(
    logits: np.ndarray, drawn: np.ndarray, targets: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [M, k + 1], logprobs float32 [M, k + 1]) (see the module docstring)."""
    z = np.asarray(logits).astype(np.float32)
    m_rows, vocab = z.shape
    ids = np.full((m_rows, k + 1), -1, np.int32)
    out = np.zeros((m_rows, k + 1), np.float32)
    for m in range(m_rows):
        target = int(targets[m]) if targets[m] != DRAWN else int(drawn[m])
        if not 0 <= target < vocab:
            continue
        zmax = np.max(z[m])
        shifted = (z[m] - zmax).astype(np.float32)
        total = float(np.sum(np.exp(shifted).astype(np.float64)))
        lse = np.log(total)
        order = np.lexsort((np.arange(vocab), -z[m].astype(np.float64)))[:k]
        ids[m] = [target, *order.tolist()]
        out[m] = (shifted[ids[m]].astype(np.float64) - lse).astype(np.float32)
    return ids, out
