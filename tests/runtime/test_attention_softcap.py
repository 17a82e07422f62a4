"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping): the scaled scores s become
tanh(s / cap) * cap before the mask and softmax. The decode (split + combine) and prefill kernels
against the interpreter, the interpreter against a brute-force capped softmax, and a cap that
is no positive float refused naming the attribute; the compile gate has an entry."""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir.dtypes import F32, I32
from qir.types import TensorType
from qir.verify import VerifyError
from tests.conftest import BACKENDS, max_rel

# q and k ~ N(0, 1), head_dim 32, scale 0.5: scores of std ~2.8, so a cap of 2 bends most of them.
CAP, SCALE = 2.0, 0.5
ROPE = 'head_dim=32, rope_type="default", theta=10000.0'


def graph(cap: str = f"softcap={CAP}", window: str = "") -> str:
    attrs = ", ".join(a for a in (window, cap, f"scale={SCALE}") if a)
    return f"""
graph capped {{
  %q = input : f32[M, 128]
  %k = input : f32[M, 64]
  %v = input : f32[M, 64]
  %pos = input : i32[M]
  %kc = state {{key="k"}} : f32[40, 2, 32]
  %vc = state {{key="v"}} : f32[40, 2, 32]
  %q_rot = rope %q, %pos {{{ROPE}}} : f32[M, 128]
  %k_rot = rope %k, %pos {{{ROPE}}} : f32[M, 64]
  %kv = kv_append %kc, %vc, %k_rot, %v, %pos {{{window}}} : (f32[40, 2, 32], f32[40, 2, 32])
  %kv.k = get %kv {{index=0}} : f32[40, 2, 32]
  %kv.v = get %kv {{index=1}} : f32[40, 2, 32]
  %attn = attention %q_rot, %kv.k, %kv.v, %pos {{{attrs}}} : f32[M, 128]
  output y = %attn
}}
"""


def inputs(rng: np.random.Generator, start: int, m: int) -> dict[str, np.ndarray]:
    return {
        "q": rng.standard_normal((m, 128), dtype=np.float32),
        "k": rng.standard_normal((m, 64), dtype=np.float32),
        "v": rng.standard_normal((m, 64), dtype=np.float32),
        "pos": np.arange(start, start + m, dtype=np.int32),
    }


# A prefill of 21 rows (a tile of 16 and a ragged 5), decode steps (M = 1), a second prefill
# chunk of 3 rows that starts mid-sequence.
RUNS = ((0, 21), (21, 1), (22, 1), (23, 3), (26, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcapped_attention_kernels_match_the_interpreter(backend):
    g = qir.parse(graph())
    ours, ref = (qir.compile(g, {}, backend=be) for be in (backend, "reference"))
    names = {la.kernel.name for la in ours.plan.launches}
    capped = {n for n in names if n.startswith(("attn_split", "attn_prefill"))}
    assert len(capped) == 2 and all(
        n.endswith(("_softcap_c2_s32", "_softcap_c2_r16")) for n in capped
    ), names
    rng = np.random.default_rng(5)
    for start, m in RUNS:
        x = inputs(rng, start, m)
        got = ours(x)["y"]
        got = got.get() if hasattr(got, "get") else got
        assert max_rel(got, ref(x)["y"]) <= 1e-5, (start, m)


def test_the_interpreter_caps_the_scores_before_the_softmax():
    """Against a brute-force softmax of tanh(s / cap) * cap; and the cap moves the output."""
    g = graph().replace("%q_rot, ", "%q, ").replace("%k_rot, %v", "%k, %v")
    capped = qir.compile(qir.parse(g), {}, backend="reference")
    plain = qir.compile(qir.parse(g.replace(f"softcap={CAP}, ", "")), {}, backend="reference")
    x = inputs(np.random.default_rng(9), 0, 7)
    y, y_plain = capped(x)["y"], plain(x)["y"]
    for r in range(7):
        q = x["q"][r].reshape(2, 2, 32)  # [kv head, group, d]
        keys, values = x["k"][: r + 1].reshape(-1, 2, 32), x["v"][: r + 1].reshape(-1, 2, 32)
        s = np.einsum("kgd,tkd->kgt", q, keys).astype(np.float64) * SCALE
        s = np.tanh(s / CAP) * CAP
        w = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("kgt,tkd->kgd", w / w.sum(-1, keepdims=True), values)
        np.testing.assert_allclose(y[r], want.reshape(-1), atol=1e-5)
    assert max_rel(y_plain, y) > 0.05  # scores past the cap: capping changes the answer


@pytest.mark.parametrize("cap", ["softcap=0.0", "softcap=-30.0", "softcap=30"])
def test_a_cap_that_is_no_positive_float_is_refused(cap):
    with pytest.raises(VerifyError, match=r"attention: softcap must be a positive float"):
        qir.parse(graph(cap))


def test_the_builder_spells_the_cap_as_an_attribute():
    b = qir.Builder("capped")
    q = b.input("q", ("M", 128), F32)
    pos = b.input("pos", ("M",), I32)
    kc = b.state("k", TensorType((40, 2, 32), F32))
    vc = b.state("v", TensorType((40, 2, 32), F32))
    b.output("y", b.attention(q, kc, vc, pos, SCALE, softcap=50))
    assert "softcap=50.0" in qir.print_graph(b.graph)
