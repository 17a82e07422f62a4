"""Heads of 256 (Gemma 2 2B/9B, Gemma 3 1B/4B/12B): the decode (split + combine), prefill and
KV-append kernels against the interpreter, with q/k head norms and RoPE folded in, a full cache
and a sliding window's ring. The prefill keeps its tiles in the activation type at this width
(exact: q is rounded to it and the caches hold it) so that they fit 48 KB of shared memory; the
compile gate builds these kernels for every arch."""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir.dtypes import BF16, F32
from tests.conftest import BACKENDS, max_rel

D, HEADS, KV = 256, 4, 2
ROPE = f'head_dim={D}, rope_type="default", theta=10000.0'


def graph(act: str, window: str) -> str:
    cache = f"{act}[40, {KV}, {D}]"
    return f"""
graph wide {{
  %q = input : {act}[M, {HEADS * D}]
  %k = input : {act}[M, {KV * D}]
  %v = input : {act}[M, {KV * D}]
  %pos = input : i32[M]
  %qn = weight {{key="qn"}} : f32[{D}]
  %kn = weight {{key="kn"}} : f32[{D}]
  %kc = state {{key="k"}} : {cache}
  %vc = state {{key="v"}} : {cache}
  %q_n = rms_norm %q, %qn {{eps=1e-06}} : {act}[M, {HEADS * D}]
  %k_n = rms_norm %k, %kn {{eps=1e-06}} : {act}[M, {KV * D}]
  %q_rot = rope %q_n, %pos {{{ROPE}}} : {act}[M, {HEADS * D}]
  %k_rot = rope %k_n, %pos {{{ROPE}}} : {act}[M, {KV * D}]
  %kv = kv_append %kc, %vc, %k_rot, %v, %pos {{{window}}} : ({cache}, {cache})
  %kv.k = get %kv {{index=0}} : {cache}
  %kv.v = get %kv {{index=1}} : {cache}
  %attn = attention %q_rot, %kv.k, %kv.v, %pos {{{window + ", " if window else ""}scale=0.0625}} : {act}[M, {HEADS * D}]
  output y = %attn
}}
"""


# A prefill of 21 rows (a tile of 16 and a ragged 5), decode steps, a 3-row chunk mid-sequence.
RUNS = ((0, 21), (21, 1), (22, 1), (23, 3), (26, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("act", "window"), [(BF16, ""), (F32, ""), (BF16, "window=8")])
def test_heads_of_256_match_the_interpreter(backend, act, window):
    g = qir.parse(graph(act.name, window))
    rng = np.random.default_rng(3)
    weights = {
        k: {"weight": (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)} for k in ("qn", "kn")
    }
    ours, ref = (qir.compile(g, weights, backend=be) for be in (backend, "reference"))
    names = {la.kernel.name for la in ours.plan.launches}
    assert {n.split("_")[1] for n in names if n.startswith("attn_")} == {
        "split",
        "combine",
        "prefill",
    }
    assert all("_d256_" in n for n in names if n.startswith(("attn_split", "attn_prefill"))), names
    for start, m in RUNS:
        x = {
            "q": rng.standard_normal((m, HEADS * D), dtype=np.float32).astype(act.np),
            "k": rng.standard_normal((m, KV * D), dtype=np.float32).astype(act.np),
            "v": rng.standard_normal((m, KV * D), dtype=np.float32).astype(act.np),
            "pos": np.arange(start, start + m, dtype=np.int32),
        }
        got = ours(x)["y"]
        got = got.get() if hasattr(got, "get") else got
        want = ref(x)["y"]
        assert max_rel(got, want) <= (1e-5 if act == F32 else 1e-2), (start, m)
