"""LongRoPE in the kernels: per-pair factors in the frequency table and cos/sin scaled by
attention_factor, in the rope kernel, kv_append's and attention's rope prologues (decode split
and prefill), against the interpreter on a prefill with a ragged tile and decode steps; a
rope whose factors do not fit head_dim is refused naming them."""

from __future__ import annotations

import json

import numpy as np
import pytest

import qir
from qir.verify import VerifyError
from tests.conftest import BACKENDS, max_rel

FACTORS = [1.0 + 0.5 * i for i in range(16)]  # head_dim 32


def graph(factors: list[float] = FACTORS, scale: float = 1.25) -> str:
    rope = (
        f'head_dim=32, rope_type="longrope", theta=10000.0, factors={json.dumps(factors)}, '
        f"attention_factor={scale}"
    )
    return f"""
graph longrope {{
  %q = input : f32[M, 128]
  %k = input : f32[M, 64]
  %v = input : f32[M, 64]
  %pos = input : i32[M]
  %kc = state {{key="k"}} : f32[40, 2, 32]
  %vc = state {{key="v"}} : f32[40, 2, 32]
  %q_rot = rope %q, %pos {{{rope}}} : f32[M, 128]
  %k_rot = rope %k, %pos {{{rope}}} : f32[M, 64]
  %kv = kv_append %kc, %vc, %k_rot, %v, %pos : (f32[40, 2, 32], f32[40, 2, 32])
  %kv.k = get %kv {{index=0}} : f32[40, 2, 32]
  %kv.v = get %kv {{index=1}} : f32[40, 2, 32]
  %attn = attention %q_rot, %kv.k, %kv.v, %pos {{scale=0.2}} : f32[M, 128]
  output y = %attn
  output k = %k_rot
}}
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("passes", ["default", "none"])
def test_longrope_kernels_match_the_interpreter(backend, passes):
    g = qir.parse(graph())
    ours, ref = (qir.compile(g, {}, backend=be, passes=passes) for be in (backend, "reference"))
    names = [la.kernel.name for la in ours.plan.launches]
    assert any("_ropelongrope10000_f" in n and "_m1p25" in n for n in names), names
    rng = np.random.default_rng(3)
    for start, m in ((0, 21), (21, 1), (22, 3), (25, 1)):
        x = {
            "q": rng.standard_normal((m, 128), dtype=np.float32),
            "k": rng.standard_normal((m, 64), dtype=np.float32),
            "v": rng.standard_normal((m, 64), dtype=np.float32),
            "pos": np.arange(start, start + m, dtype=np.int32),
        }
        got, want = ours(x), ref(x)
        for out in ("y", "k"):
            value = got[out].get() if hasattr(got[out], "get") else got[out]
            assert max_rel(value, want[out]) <= 1e-5, (start, out)
    # attention_factor scales the rotated k: 1.25 times the norm of k itself
    k = ref(x)["k"].reshape(-1, 32)
    np.testing.assert_allclose(
        np.linalg.norm(k, axis=1), 1.25 * np.linalg.norm(x["k"].reshape(-1, 32), axis=1), 1e-5
    )


@pytest.mark.parametrize(
    ("factors", "scale", "message"),
    [
        (FACTORS[:-1], 1.25, r"rope_type longrope needs factors as 16 positive floats"),
        ([0.0] * 16, 1.25, r"rope_type longrope needs factors as 16 positive floats"),
        (FACTORS, 0.0, r"rope_type longrope needs attention_factor as a positive float"),
    ],
)
def test_longrope_attributes_that_do_not_fit_are_refused(factors, scale, message):
    with pytest.raises(VerifyError, match=message):
        qir.parse(graph(factors, scale))
