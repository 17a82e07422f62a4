"""The layer ops in the IR: types (index vectors, parameters, KV caches kept apart from
activations), verifier rules for state, printer/parser, and the RoPE frequency table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qir import parse, print_graph
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32, I32, I64
from qir.ops import IRTypeError
from qir.rope import inv_freq, rotate, yarn_attention_factor
from qir.types import QWeight, TensorType
from qir.verify import VerifyError
from tests.conftest import FMT4

CACHE = TensorType((16, 2, 32), F16)
# gpt-oss-20b's yarn (head_dim 64 there, 32 here)
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "attention_factor": 0.1 * math.log(32.0) + 1.0,
}
ROPE = {"head_dim": 32, "theta": 10000.0, "rope_type": "default"}


def layer_core() -> tuple[Builder, dict[str, object]]:
    b = Builder("attn")
    v = {
        "q": b.input("q", ("M", 128), F16),
        "k": b.input("k", ("M", 64), F16),
        "v": b.input("v", ("M", 64), F16),
        "pos": b.input("pos", ("M",), I32),
        "kc": b.state("k_cache", CACHE, name="kc"),
        "vc": b.state("v_cache", CACHE, name="vc"),
    }
    return b, v


def test_attention_graph_round_trips_through_text():
    b, v = layer_core()
    q = b.rope(v["q"], v["pos"], ROPE, name="q_rot")
    kc, vc = b.kv_append(v["kc"], v["vc"], v["k"], v["v"], v["pos"], name="kv")
    b.output("y", b.attention(q, kc, vc, v["pos"], name="attn"))
    text = print_graph(b.graph)
    assert "%kv = kv_append %kc, %vc, %k, %v, %pos : (f16[16, 2, 32], f16[16, 2, 32])" in text
    assert "%attn = attention %q_rot, %kv.k, %kv.v, %pos {scale=0.1767766952966369}" in text
    assert '%kc = state {key="k_cache"} : f16[16, 2, 32]' in text
    assert print_graph(parse(text)) == text


def test_activation_only_ops_refuse_indices_caches_and_parameters():
    b, v = layer_core()
    w = b.weight("proj", QWeight(FMT4, 64, 64))
    norm_w = b.param("norm", TensorType((64,), BF16))
    for bad in (v["pos"], v["kc"], norm_w):
        with pytest.raises(IRTypeError, match=r"qlinear: operand 0 .* must be (2-D|one of)"):
            b.qlinear(bad, w)
    with pytest.raises(IRTypeError, match=r"i32\[M\] \(one index per row\)"):
        b.rope(v["q"], v["k"], ROPE)
    with pytest.raises(IRTypeError, match=r"input %ids: i64\[M\].*must be one of f16"):
        b.input("ids", ("M",), I64)
    with pytest.raises(IRTypeError, match="must be 1-D"):
        b.param("p", TensorType((4, 64), F16))
    with pytest.raises(IRTypeError, match="concrete sizes"):
        b.state("s", TensorType(("M", 2, 32), F16))


def test_layer_ops_check_shapes_against_each_other():
    b, v = layer_core()
    norm_w = b.param("norm", TensorType((64,), BF16))
    odd_w = b.param("odd", TensorType((48,), BF16))
    with pytest.raises(IRTypeError, match=r"rms_norm: weight %p\w*: bf16\[48\] does not match"):
        b.rms_norm(v["q"], odd_w, 1e-6)
    with pytest.raises(IRTypeError, match="eps must be a positive float"):
        b.rms_norm(v["k"], norm_w, 0.0)
    # a weight of a divisor of the width normalises each group (a head) on its own
    assert b.rms_norm(v["q"], norm_w, 1e-6).type == v["q"].type
    with pytest.raises(IRTypeError, match=r"%k: f16\[M, 64\] is not a whole number of heads of 48"):
        b.rope(v["k"], v["pos"], {**ROPE, "head_dim": 48})
    with pytest.raises(IRTypeError, match=r"kv_append: %q: f16\[M, 128\] does not fit a row"):
        b.kv_append(v["kc"], v["vc"], v["q"], v["v"], v["pos"])
    kc, vc = b.kv_append(v["kc"], v["vc"], v["k"], v["v"], v["pos"])
    # 3 query heads of 32 cannot share 2 kv heads
    q3 = b.input("q3", ("M", 96), F16)
    with pytest.raises(IRTypeError, match=r"needs a multiple of the 2 kv heads"):
        b.attention(q3, kc, vc, v["pos"])
    table = b.weight("embed", QWeight(FMT4, 100, 64))
    assert b.embedding(v["pos"], table, BF16).type == TensorType(("M", 64), BF16)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "attention %q, %kc, %vc, %pos, %w32 {scale=0.1}",
            r"attention: takes 4 operands \(a block table",
        ),
        (
            "attention %q, %kc, %vc, %pos {norm_eps=1e-06, scale=0.1}",
            r"attention: takes 5 operands \(a block table",
        ),
        ("attention %q, %kc, %vc, %pos, %w64 {norm_eps=1e-06, scale=0.1}", r"must be \[32\]"),
        ("kv_append %kc, %vc, %k, %v, %pos, %w64 {norm_eps=1e-06}", r"must be \[32\]"),
        ("kv_append %kc, %vc, %k, %v, %pos, %w32 {norm_eps=0.0}", "norm_eps must be a positive"),
    ],
)
def test_head_norm_prologues_are_checked(text, message):
    src = f"""graph t {{
  %q = input : f16[M, 128]
  %k = input : f16[M, 64]
  %v = input : f16[M, 64]
  %pos = input : i32[M]
  %w32 = weight {{key="a"}} : bf16[32]
  %w64 = weight {{key="b"}} : bf16[64]
  %kc = state {{key="k"}} : f16[16, 2, 32]
  %vc = state {{key="v"}} : f16[16, 2, 32]
  %y = {text} : {"f16[M, 128]" if text.startswith("attention") else "(f16[16, 2, 32], f16[16, 2, 32])"}
  output y = %y
}}"""
    with pytest.raises(VerifyError, match=message):
        parse(src)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"rope_type": "dynamic"}, "rope_type 'dynamic' is not supported"),
        ({"rope_type": "longrope"}, "longrope needs factors as 16 positive floats"),
        ({"rope_type": "yarn"}, "yarn needs factor"),
        (
            {**YARN, "truncate": "false"},
            "rope_type yarn needs truncate as a bool, got 'false'",
        ),
        ({**YARN, "attention_factor": 0.0}, "yarn needs attention_factor as a positive float"),
        ({"rope_type": "linear"}, "linear needs factor"),
        ({"factor": 2.0}, "rope_type default takes no factor"),
        ({"theta": 0.0}, "theta must be a positive float"),
        ({"head_dim": 31}, "head_dim must be an even int"),
    ],
)
def test_rope_attributes_are_checked(attrs, message):
    b, v = layer_core()
    with pytest.raises(IRTypeError, match=message):
        b.rope(v["q"], v["pos"], {**ROPE, **attrs})


STATE_TEXT = """
graph g {{
  %k = input : f16[M, 64]
  %pos = input : i32[M]
  %kc = state {{key="k"}} : f16[16, 2, 32]
  %vc = state {{key="v"}} : f16[16, 2, 32]
  %kv = kv_append %kc, %vc, %k, %k, %pos : (f16[16, 2, 32], f16[16, 2, 32])
  %kv.k = get %kv {{index=0}} : f16[16, 2, 32]
  %kv.v = get %kv {{index=1}} : f16[16, 2, 32]
  %q = input : f16[M, 128]
  %y = attention %q, {k}, {v}, %pos {{scale=0.125}} : f16[M, 128]
  output y = %y
}}
"""


def test_states_are_read_only_through_their_kv_append():
    assert parse(STATE_TEXT.format(k="%kv.k", v="%kv.v"))
    # Reading a cache before (or besides) its append would race with the in-place write.
    with pytest.raises(VerifyError, match=r"%y = attention: reads state %kc; a state must be read"):
        parse(STATE_TEXT.format(k="%kc", v="%kv.v"))
    # Two appends of one cache would race with each other.
    twice = STATE_TEXT.format(k="%kv.k", v="%kv.v").replace(
        "  output y",
        "  %kv2 = kv_append %kc, %vc, %k, %k, %pos : (f16[16, 2, 32], f16[16, 2, 32])\n  output y",
    )
    with pytest.raises(VerifyError, match=r"%kc: a state must be read by exactly one kv_append"):
        parse(twice)
    # Appending to what is not a state (here: the written cache again) is refused too.
    text = STATE_TEXT.format(k="%kv.k", v="%kv.v").replace(
        "  output y",
        "  %kv2 = kv_append %kv.k, %kv.v, %k, %k, %pos : "
        "(f16[16, 2, 32], f16[16, 2, 32])\n  output y",
    )
    with pytest.raises(VerifyError, match="kv_append writes state values only"):
        parse(text)


def test_llama3_frequencies_follow_the_published_formula():
    attrs = {
        "head_dim": 128,
        "theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    ours = inv_freq(attrs)
    plain = {"head_dim": 128, "theta": 500000.0, "rope_type": "default"}
    for i, f in enumerate(inv_freq(plain)):
        wavelen = 2 * math.pi / float(f)
        if wavelen < 8192 / 4.0:
            want = float(f)
        elif wavelen > 8192 / 1.0:
            want = float(f) / 8.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * float(f) / 8.0 + smooth * float(f)
        assert ours[i] == pytest.approx(want, rel=1e-6), i
    assert ours.dtype == np.float32 and ours.shape == (64,)
    linear = inv_freq({"head_dim": 64, "theta": 10000.0, "rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(linear * 4.0, 10000.0 ** -(np.arange(0, 64, 2) / 64.0), rtol=1e-6)


def test_index_input_dtype_and_float_activations_keep_their_rules():
    b = Builder()
    assert b.input("pos", ("M",), I32).type == TensorType(("M",), I32)
    with pytest.raises(IRTypeError, match=r"must be i32\[M\]"):
        b.input("p2", (4,), I32)
    with pytest.raises(IRTypeError, match="batch dim spelled M"):
        b.input("x", ("M",), F32)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_scale_follow_the_published_formula(truncate):
    """YaRN (transformers' _compute_yarn_parameters) written out in float64: the correction
    range from beta_fast / beta_slow rotations in the original context (whole dimensions only
    with truncate), a linear ramp between interpolated (divided by factor) and original
    frequencies; cos and sin scaled by 0.1 ln(factor) + 1."""
    d, theta = 64, 150000.0
    attrs = {"head_dim": d, "theta": theta, **YARN, "truncate": truncate}
    assert attrs["attention_factor"] == yarn_attention_factor(32.0, None, None)
    assert yarn_attention_factor(4.0, 1.0, 1.0) == 1.0  # mscale / mscale_all_dim cancel

    def dim_of(rot: float) -> float:
        return d * math.log(4096 / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(32.0), dim_of(1.0)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ours = inv_freq(attrs)
    for i, f in enumerate(ours):
        base = theta ** -(2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want = base / 32.0 * ramp + base * (1 - ramp)
        assert f == pytest.approx(want, rel=2e-6), i
    assert ours.dtype == np.float32 and ours.shape == (32,)
    # truncate matters where the ends fall between dimensions (they do here)
    other = inv_freq({**attrs, "truncate": not truncate})
    assert np.abs(other / ours - 1).max() > 1e-2
    x = np.random.default_rng(0).standard_normal((3, 2 * d)).astype(np.float32)
    pos = np.array([0, 5, 17], np.int32)
    y = rotate(x, pos, attrs)
    # at position 0 the rotation is the identity times the attention factor
    np.testing.assert_allclose(y[0], x[0] * attrs["attention_factor"], rtol=1e-6)
    np.testing.assert_allclose(
        np.linalg.norm(y[1:].reshape(2, 2, 2, 32), axis=2),
        np.linalg.norm(x[1:].reshape(2, 2, 2, 32), axis=2) * attrs["attention_factor"],
        rtol=1e-5,
    )


def test_attention_sinks_join_the_denominator_only():
    """A sink per head: softmax over the row's scores and the sink, the sink's share dropped
    (float64 by hand); checked to be f32[heads]; a sink of -1e30 is plain attention."""
    b, v = layer_core()
    sinks = b.param("sinks", TensorType((4,), F32), name="sinks")
    kv = b.kv_append(v["kc"], v["vc"], v["k"], v["v"], v["pos"])
    b.output("y", b.attention(v["q"], *kv, v["pos"], 0.3, sinks=sinks))
    b.output("plain", b.attention(v["q"], *kv, v["pos"], 0.3, name="plain"))
    rng = np.random.default_rng(2)
    feed = {
        "q": rng.standard_normal((5, 128)).astype(np.float16),
        "k": rng.standard_normal((5, 64)).astype(np.float16),
        "v": rng.standard_normal((5, 64)).astype(np.float16),
        "pos": np.array([0, 1, 2, 3, -1], np.int32),
    }
    s = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    from qir.interpret import interpret

    out = interpret(b.graph, feed, {"sinks": {"weight": s}})
    q, k, vv = (feed[n].astype(np.float64).reshape(5, -1, 32) for n in ("q", "k", "v"))
    want = np.zeros((5, 4, 32))
    for m in range(4):
        for h in range(4):
            scores = [0.3 * q[m, h] @ k[t, h // 2] for t in range(m + 1)]
            e = np.exp(np.array([*scores, s[h]]) - max(*scores, s[h]))
            want[m, h] = (e[:-1] / e.sum()) @ vv[: m + 1, h // 2]
    np.testing.assert_allclose(out["y"].reshape(5, 4, 32), want, atol=2e-3)
    assert not out["y"][4].any()  # a padding row stays zeros
    assert np.abs(out["y"] - out["plain"]).max() > 0.05
    drowned = interpret(b.graph, feed, {"sinks": {"weight": np.full(4, -1e30, np.float32)}})
    assert drowned["y"].tobytes() == drowned["plain"].tobytes()
    for bad, msg in (
        (TensorType((2,), F32), r"sinks %s2: f32\[2\] must be f32\[4\]"),
        (TensorType((4,), F16), r"sinks %s2: f16\[4\] must be f32\[4\]"),
    ):
        wrong = b.param("s2", bad, name="s2")
        with pytest.raises(IRTypeError, match=msg):
            b.attention(v["q"], *kv, v["pos"], 0.3, sinks=wrong, name="bad")
        b.graph.remove("s2")
