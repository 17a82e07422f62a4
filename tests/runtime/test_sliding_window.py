"""Sliding-window attention (Mistral, Qwen2's sliding layers, Gemma 3's local ones): the kernels
against the interpreter on a ring-buffer KV cache that laps several times, unpaged and paged,
in decode and prefill; the interpreter against a brute-force softmax over the window; the
compile gate at Mistral-7B's shapes is an entry of test_compile_gate."""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir.dtypes import F16
from qir.interpret import BindError
from qir.verify import VerifyError
from tests.conftest import BACKENDS, max_rel

WINDOW, ROOM = 8, 12  # a ring of 12 positions: runs of at most 5 rows of a sequence
ROPE = 'head_dim=32, rope_type="default", theta=10000.0'


def graph(paged: bool) -> str:
    """Attention over a ring: unpaged, 12 rows; paged, a pool of 6 pages of 4 rows and a block
    table of 3 pages per row (room 12)."""
    cache = "f16[24, 2, 32]" if paged else f"f16[{ROOM}, 2, 32]"
    table = "  %pages = input : i32[M, 3]\n" if paged else ""
    extra = ", %pages" if paged else ""
    attrs = f"page_size=4, window={WINDOW}" if paged else f"window={WINDOW}"
    return f"""
graph swa {{
  %q = input : f16[M, 128]
  %k = input : f16[M, 64]
  %v = input : f16[M, 64]
  %pos = input : i32[M]
{table}  %kc = state {{key="k"}} : {cache}
  %vc = state {{key="v"}} : {cache}
  %q_rot = rope %q, %pos {{{ROPE}}} : f16[M, 128]
  %k_rot = rope %k, %pos {{{ROPE}}} : f16[M, 64]
  %kv = kv_append %kc, %vc, %k_rot, %v, %pos{extra} {{{attrs}}} : ({cache}, {cache})
  %kv.k = get %kv {{index=0}} : {cache}
  %kv.v = get %kv {{index=1}} : {cache}
  %attn = attention %q_rot, %kv.k, %kv.v, %pos{extra} {{{attrs}, scale=0.2}} : f16[M, 128]
  output y = %attn
}}
"""


# (first position, rows): prefill up to the ring's limit, decode steps past several laps, and
# a prefill chunk that starts mid-ring.
RUNS = ((0, 5), (5, 5), (10, 1), (11, 1), (12, 5), (17, 1), (18, 4), (22, 1), (23, 1), (24, 5))


def inputs(rng: np.random.Generator, start: int, m: int, paged: bool) -> dict[str, np.ndarray]:
    out = {
        "q": rng.standard_normal((m, 128), dtype=np.float32).astype(F16.np),
        "k": rng.standard_normal((m, 64), dtype=np.float32).astype(F16.np),
        "v": rng.standard_normal((m, 64), dtype=np.float32).astype(F16.np),
        "pos": np.arange(start, start + m, dtype=np.int32),
    }
    if paged:  # the sequence's three pages, not in pool order
        out["pages"] = np.tile(np.array([4, 1, 2], np.int32), (m, 1))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["unpaged", "paged"])
def test_ring_buffer_attention_matches_the_interpreter(backend, paged):
    g = qir.parse(graph(paged))
    ours, ref = (qir.compile(g, {}, backend=be) for be in (backend, "reference"))
    names = [la.kernel.name for la in ours.plan.launches]
    assert all("_w8" in n for n in names if n.startswith(("kv_", "attn_split", "attn_prefill")))
    rng = np.random.default_rng(11)
    for start, m in RUNS:
        x = inputs(rng, start, m, paged)
        got = ours(x)["y"]
        assert max_rel(got.get() if hasattr(got, "get") else got, ref(x)["y"]) <= 2e-3, start
    # The rings hold the last 12 positions' rows, the same in both.
    for key, want in ref.state().items():
        got = ours.state()[key]
        got = got.get() if hasattr(got, "get") else got
        assert max_rel(np.asarray(got).view(want.dtype).reshape(want.shape), want) <= 2e-3, key


def test_the_interpreter_reads_the_window_of_the_ring():
    """Against a softmax over each row's last 8 positions of the whole sequence (no ring)."""
    g = qir.parse(graph(False).replace("%q_rot, ", "%q, ").replace("%k_rot, %v", "%k, %v"))
    ref = qir.compile(g, {}, backend="reference")
    rng = np.random.default_rng(3)
    ks, vs = [], []
    for start, m in RUNS:
        x = inputs(rng, start, m, False)
        y = ref(x)["y"].astype(np.float32)
        ks.append(x["k"].astype(np.float32).reshape(m, 2, 32))
        vs.append(x["v"].astype(np.float32).reshape(m, 2, 32))
        keys, values = np.concatenate(ks), np.concatenate(vs)
        for r in range(m):
            p = start + r
            lo = max(0, p - WINDOW + 1)
            q = x["q"][r].astype(np.float32).reshape(2, 2, 32)  # [kv head, group, d]
            s = np.einsum("kgd,tkd->kgt", q, keys[lo : p + 1]) * 0.2
            w = np.exp(s - s.max(-1, keepdims=True))
            want = np.einsum("kgt,tkd->kgd", w / w.sum(-1, keepdims=True), values[lo : p + 1])
            np.testing.assert_allclose(y[r], want.reshape(-1), atol=2e-3), p


def test_a_run_that_would_lap_its_ring_is_refused_and_the_window_checked():
    ref = qir.compile(qir.parse(graph(False)), {}, backend="reference")
    rng = np.random.default_rng(0)
    with pytest.raises(BindError, match=r"positions 0\.\.5 of one sequence in one run need 13"):
        ref(inputs(rng, 0, 6, False))
    with pytest.raises(VerifyError, match=r"window must be an int from 1 to the 12 positions"):
        qir.parse(graph(False).replace(f"window={WINDOW}", "window=13"))
