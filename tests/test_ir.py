"""Builder, verifier, printer and parser."""

from __future__ import annotations

import numpy as np
import pytest

from qir import interpret, parse, print_graph
from qir.builder import Builder
from qir.dtypes import BF16, F16, F32, I32
from qir.formats.base import FormatError
from qir.formats.mlx import MlxAffine
from qir.graph import Node
from qir.interpret import BindError
from qir.ops import IRTypeError
from qir.parser import ParseError
from qir.types import QWeight, TensorType
from qir.verify import VerifyError, verify
from tests.conftest import FMT4, mlp_graph, random_weight


def test_qlinear_rejects_width_mismatch_naming_both_operands():
    b = Builder()
    x = b.input("x", ("M", 300), F16)
    w = b.weight("proj", QWeight(FMT4, 512, 256), name="w_proj")
    with pytest.raises(IRTypeError, match=r"%x: f16\[M, 300\].*%w_proj.*in_features 256"):
        b.qlinear(x, w)


def test_binary_ops_reject_shape_and_dtype_mismatch():
    b = Builder()
    a = b.input("a", ("M", 64), F16)
    c = b.input("c", ("M", 32), F16)
    d = b.input("d", ("M", 64), BF16)
    with pytest.raises(
        IRTypeError, match=r"mul: operands differ: %a: f16\[M, 64\] vs %c: f16\[M, 32\]"
    ):
        b.mul(a, c)
    with pytest.raises(IRTypeError, match=r"%a: f16\[M, 64\] vs %d: bf16\[M, 64\]"):
        b.add(a, d)


def test_weight_shape_checked_by_format():
    b = Builder()
    with pytest.raises(FormatError, match="in_features 100 is not a multiple of the group size 64"):
        b.weight("w", QWeight(FMT4, 8, 100))


def test_activation_dtype_and_batch_dim_checked():
    b = Builder()
    w = b.weight("w", QWeight(FMT4, 64, 64))
    i = b.input("i", ("M", 64), F32)
    assert b.qlinear(i, w).type.dtype == F32
    from qir.dtypes import U8

    with pytest.raises(IRTypeError, match=r"input %u: u8.* must be one of f16, bf16, f32"):
        b.input("u", ("M", 64), U8)
    # a concrete batch size would disagree with the M a run binds
    with pytest.raises(IRTypeError, match="batch dim spelled M"):
        b.input("c", (4, 64), F16)
    with pytest.raises(IRTypeError, match="batch dim spelled M"):
        b.input("d", ("B", 64), F16)


def test_duplicate_names_rejected():
    b = Builder()
    b.input("x", ("M", 64), F16)
    with pytest.raises(ValueError, match="already used"):
        b.input("x", ("M", 64), F16)


def test_printer_is_deterministic_and_parser_round_trips(rng):
    g, _ = mlp_graph(rng, 128, 256, MlxAffine(3, 32, F16))
    text = print_graph(g)
    assert text == print_graph(g)
    again = parse(text)
    assert print_graph(again) == text
    assert again.outputs == g.outputs
    for name, node in g.items():
        assert again.node(name) == node
        assert again.operands(name) == g.operands(name)


def test_parse_reads_hand_written_ir():
    text = """
    graph t {
      %x = input : bf16[M, 64]
      %w = weight {key="a.b"} : qweight<mlx_affine<bits=8,group_size=32,scale_dtype=f16>>[16, 64]
      %y = qlinear %x, %w : bf16[M, 16]
      %z = mul %y, %y : bf16[M, 16]
      output out = %z
    }
    """
    g = parse(text)
    assert g.operands("z") == ("y", "y")
    assert g.node("w").type.format == MlxAffine(8, 32, F16)
    assert g.node("w").attr("key") == "a.b"


def test_a_bias_travels_with_its_weight(rng):
    """+bias in the weight's type: printed and parsed, checked when bound, added to the float32
    sums before they round; an embedding table takes none."""
    qw = QWeight(FMT4, 16, 64, bias=True)
    assert str(qw).endswith("[16, 64]+bias") and qw.buffers()["bias"] == TensorType((16,), F32)
    b = Builder()
    x = b.input("x", ("M", 64), F16)
    w = b.weight("p", qw, name="w_p")
    b.output("y", b.qlinear(x, w))
    assert parse(print_graph(b.graph)).node("w_p").type == qw
    e = Builder()
    with pytest.raises(
        IRTypeError, match=r"embedding: operand 1 .* must be a weight without a bias"
    ):
        e.embedding(e.input("ids", ("M",), I32), e.weight("p", qw), F16)
    _, bufs = random_weight(rng, 16, 64, FMT4)
    xs = {"x": rng.standard_normal((3, 64)).astype(np.float16)}
    with pytest.raises(
        BindError, match=r"weight 'p': buffer 'bias' is nothing, expected f32\[16\]"
    ):
        interpret(b.graph, xs, {"p": bufs})
    with pytest.raises(BindError, match=r"buffer 'bias' is float16 \[16\], expected f32\[16\]"):
        interpret(b.graph, xs, {"p": {**bufs, "bias": np.zeros(16, np.float16)}})
    bias = rng.standard_normal(16).astype(np.float32)
    y = interpret(b.graph, xs, {"p": {**bufs, "bias": bias}})["y"]
    want = xs["x"].astype(np.float32) @ FMT4.dequantize(bufs, 16, 64).T + bias
    np.testing.assert_array_equal(y, want.astype(np.float16))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "graph t {\n %x = input : f16[M, 64]\n %y = silu %nope : f16[M, 64]\n output o = %y\n}",
            "not defined",
        ),
        (
            "graph t {\n %x = input : f16[M, 64]\n %y = silu %x : f16[M, 32]\n output o = %y\n}",
            "inferred",
        ),
        (
            "graph t {\n %x = input : f16[M, 64]\n %y = frob %x : f16[M, 64]\n output o = %y\n}",
            "unknown op",
        ),
        ("graph t {\n %x = input : f16[M, 64]\n}", "no outputs"),
        ("graph t {\n %x = input : q16[M, 64]\n output o = %x\n}", "unknown dtype"),
        ("nonsense", "expected 'graph NAME"),
    ],
)
def test_parser_and_verifier_reject_bad_ir(text, message):
    with pytest.raises((ParseError, VerifyError), match=message):
        parse(text)


PAIR = """
graph t {
  %x = input : f16[M, 64]
  %w_gate = weight {key="g"} : WFMT[32, 64]
  %w_up = weight {key="u"} : WFMT[UP, 64]
  %h = qlinear %x, OPERANDS {epilogue="silu_mul"} : f16[M, 32]
  output h = %h
}
"""
MLX4 = "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=f16>>"


@pytest.mark.parametrize(
    ("up", "operands", "fmt", "message"),
    [
        ("32", "%w_gate, %w_up", MLX4, None),
        ("48", "%w_gate, %w_up", MLX4, r"two weights \(gate, up\) of one shape"),
        ("32", "%w_gate", MLX4, r"two weights \(gate, up\) of one shape"),
        ("32", "%w_gate, %w_up, %w_up", MLX4, r"two weights \(gate, up\) of one shape"),
    ],
)
def test_silu_mul_epilogue_needs_a_gate_up_pair(up, operands, fmt, message):
    text = PAIR.replace("WFMT", fmt).replace("UP", up).replace("OPERANDS", operands)
    if message is None:
        assert parse(text).node("h").attr("epilogue") == "silu_mul"
    else:
        with pytest.raises(VerifyError, match=message):
            parse(text)


def test_silu_mul_epilogue_takes_4_bit_input_but_no_prologue():
    nvfp4 = "qweight<nvfp4<scale_mode=div,act_bits=4>>"
    text = PAIR.replace("WFMT", nvfp4).replace("UP", "32").replace("OPERANDS", "%w_gate, %w_up")
    quantized = text.replace(
        "  %h = qlinear %x,",
        '  %xq = quantize_act %x {scheme="nvfp4"} : qact<nvfp4, f16[M, 64]>\n  %h = qlinear %xq,',
    )
    assert parse(quantized).node("h").attr("epilogue") == "silu_mul"
    with_prologue = text.replace(
        "%h = qlinear %x, %w_gate, %w_up {",
        '%h = qlinear %x, %x, %w_gate, %w_up {prologue="silu_mul", ',
    )
    with pytest.raises(VerifyError, match="takes no silu_mul prologue"):
        parse(with_prologue)
    # An RMSNorm prologue is fine: the pair reads the normalised x (norm_mlp's gate/up).
    normed = text.replace(
        "  %h = qlinear %x, %w_gate, %w_up {",
        '  %nw = weight {key="n"} : bf16[64]\n'
        '  %h = qlinear %x, %nw, %w_gate, %w_up {eps=1e-05, prologue="rms_norm", ',
    )
    assert parse(normed).node("h").attr("prologue") == "rms_norm"
    with pytest.raises(VerifyError, match="rms_norm: weight"):
        parse(normed.replace("bf16[64]", "bf16[48]"))
    # a per-head norm (a weight of a divisor of the width) is no prologue of a projection
    with pytest.raises(VerifyError, match="an rms_norm prologue normalises whole rows"):
        parse(normed.replace("bf16[64]", "bf16[32]"))


def test_verify_checks_again_whatever_changed_since_it_last_passed(rng):
    """verify re-checks only what the graph says changed: a redefinition, new operands, a user of
    a value whose type changed, and uses pointed at another value are all caught."""
    g, _ = mlp_graph(rng, 128, 256, MlxAffine(4, 64, F16))
    gate = next(n for n, node in g.items() if node.op == "silu")
    wide = TensorType(("M", 64), F16)
    breakages = [
        lambda c: c.set_node(gate, Node("silu", wide)),  # its own declaration
        lambda c: c.set_node("x", Node("input", wide)),  # every user of x no longer type-checks
        lambda c: c.set_operands(gate, ("x",)),  # silu of a 128-wide x declared 256 wide
        lambda c: c.replace_all_uses(gate, "x"),  # the mul's operands now differ in width
    ]
    for i, breakage in enumerate(breakages):
        c = g.copy()
        verify(c)
        assert c.unverified() == set()
        breakage(c)
        with pytest.raises(VerifyError, match=r"declared|differ|features"):
            verify(c)
        assert c.unverified(), i  # still to check after the failure


def test_order_and_use_counts_follow_every_change():
    b = Builder("t")
    x = b.input("x", ("M", 64), F16)
    s = b.silu(x, "s")
    b.output("y", b.mul(s, s, "m"))
    g = b.graph
    assert g.order() == ["x", "s", "m"] and g.use_count("s") == 2
    g.outputs.append(("s_out", "s"))
    assert g.use_count("s") == 3
    g.outputs = [("y", "m")]
    assert g.use_count("s") == 2 and g.use_count("m") == 1
    g.add("t", Node("silu", x.type), ("x",))
    g.replace_all_uses("s", "t")
    assert g.operands("m") == ("t", "t") and g.use_count("s") == 0
    g.remove("s")
    assert g.order() == ["x", "t", "m"]
    copy = g.copy()
    copy.set_operands("m", ("x", "t"))
    assert copy.order() == ["x", "t", "m"] and g.operands("m") == ("t", "t")
    assert copy.users("x") == ("m", "t") and g.users("x") == ("t",)  # m was defined first
