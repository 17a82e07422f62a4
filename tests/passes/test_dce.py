"""DCE: before/after IR, must-not-fire, counter, and interpreter before == after."""

from __future__ import annotations

import numpy as np
import pytest

from qir import interpret, parse, print_graph
from qir.passes.dce import DCE
from qir.passes.manager import resolve, run_pipeline
from tests.conftest import FMT4, random_weight

W = "qweight<mlx_affine<bits=4,group_size=64,scale_dtype=bf16>>"

BEFORE = f"""
graph t {{
  %x = input : f16[M, 64]
  %unused = input : f16[M, 64]
  %w = weight {{key="w"}} : {W}[64, 64]
  %w_dead = weight {{key="w_dead"}} : {W}[64, 64]
  %y = qlinear %x, %w : f16[M, 64]
  %dead = qlinear %x, %w_dead : f16[M, 64]
  %dead2 = silu %dead : f16[M, 64]
  output y = %y
}}
"""

AFTER = f"""graph t {{
  %x = input : f16[M, 64]
  %unused = input : f16[M, 64]
  %w = weight {{key="w"}} : {W}[64, 64]
  %y = qlinear %x, %w : f16[M, 64]
  output y = %y
}}
"""


def test_dce_removes_unreachable_nodes():
    g = parse(BEFORE)
    assert DCE().run(g) == 3  # inputs stay: they are the block's signature
    assert print_graph(g) == AFTER


def test_dce_does_not_fire_on_a_live_graph():
    g = parse(AFTER)
    assert DCE().run(g) == 0
    assert print_graph(g) == AFTER


def test_dce_keeps_values_used_only_as_outputs():
    g = parse(BEFORE.replace("output y = %y", "output y = %y\n  output d = %dead2"))
    assert DCE().run(g) == 0
    assert "dead2" in g


def test_dce_differential(rng):
    g = parse(BEFORE)
    weights = {k: random_weight(rng, 64, 64, FMT4)[1] for k in ("w", "w_dead")}
    x = rng.standard_normal((3, 64)).astype(np.float16)
    before = interpret(g, {"x": x, "unused": x}, weights)
    after_graph, records = run_pipeline(g, "dce")
    assert [(r.name, r.matches) for r in records] == [("dce", 3)]
    after = interpret(after_graph, {"x": x, "unused": x}, weights)
    np.testing.assert_array_equal(before["y"], after["y"])
    assert "dead" in g, "the caller's graph must not be changed"


def test_pipeline_names_are_checked():
    assert "dce" in [p.name for p in resolve("default")]
    assert resolve("none") == ()
    with pytest.raises(ValueError, match="unknown pass fuse_everything"):
        resolve("dce,fuse_everything")
