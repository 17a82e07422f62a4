"""Phi-3's LongRoPE (rope_scaling type longrope, or su): the Phi-3 fixture's weights with
tests/data/mlx_affine4_phi3/config_longrope.json (original_max_position_embeddings 16 of 128)
against transformers' Phi3ForCausalLM in float32 (golden_longrope.npz, ORACLE.md): its rotary
embedding's numbers, short factors for a cache of at most 16 positions, long factors past
that (qir's choice is static, by the positions the KV cache holds), logits and greedy steps."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from qir import rope
from qir.cli import main
from qir.dtypes import F32
from qir.formats.base import FormatError
from qir.models import Model, load
from tests.conftest import BACKENDS, DATA, max_rel

PHI3 = DATA / "mlx_affine4_phi3"
ORIGINAL = 16


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(PHI3 / "golden_longrope.npz"))


def longrope_checkpoint(tmp: Path, **rope_changes: object) -> Path:
    """The Phi-3 fixture with config_longrope.json (its rope_scaling changed by rope_changes)."""
    path = tmp / "phi3_longrope"
    if not path.exists():
        shutil.copytree(PHI3, path)
    cfg = json.loads((PHI3 / "config_longrope.json").read_text())
    cfg["rope_scaling"].update(rope_changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_the_rotation_is_transformers_for_short_and_long_sequences(tmp_path, golden):
    ck = load(longrope_checkpoint(tmp_path))
    cfg = json.loads((PHI3 / "config_longrope.json").read_text())["rope_scaling"]
    short, long = ck.rope_of(False, positions=ORIGINAL), ck.rope_of(False, positions=ORIGINAL + 1)
    assert short["factors"] == tuple(cfg["short_factor"])
    assert long["factors"] == tuple(cfg["long_factor"])
    # factor 128 / 16: the cos/sin scale sqrt(1 + ln 8 / ln 16)
    assert short["attention_factor"] == long["attention_factor"] == math.sqrt(1.75)
    x = golden["rot.x"]
    for key, n, attrs in (("short", 12, short), ("long", 24, long)):
        rotated = rope.rotate(x[:n], np.arange(n, dtype=np.int32), attrs)
        assert max_rel(rotated, golden[f"rot.{key}"]) <= 1e-6, key
    # The scale matters: without it the rotation is off by the factor.
    plain = rope.rotate(x, np.arange(24, dtype=np.int32), {**long, "attention_factor": 1.0})
    assert max_rel(plain, golden["rot.long"]) > 0.2


def test_a_cache_within_the_original_length_takes_the_short_factors(tmp_path, golden):
    path = longrope_checkpoint(tmp_path)
    short = Model.load(path, backend="reference", act=F32, max_seq=ORIGINAL)
    assert max_rel(short.logits(golden["short.tokens"]), golden["short.logits"]) <= 1e-4
    # A longer cache takes the long factors for every sequence (transformers would still use
    # the short ones for these 12 tokens): the static choice moves these logits.
    long = Model.load(path, backend="reference", act=F32)
    assert max_rel(long.logits(golden["short.tokens"]), golden["short.logits"]) > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_longer_cache_takes_the_long_factors_on_the_kernels(tmp_path, golden, backend):
    """Prefill of 24 tokens (past 16) and greedy steps with the KV cache, host kernels in f32
    within 1e-3 of transformers: the RoPE of kv_append and of attention's q load (decode split
    and prefill) scaled by attention_factor."""
    path = longrope_checkpoint(tmp_path)
    ref = Model.load(path, backend="reference", act=F32)
    assert max_rel(ref.logits(golden["long.tokens"]), golden["long.logits"]) <= 1e-4
    model = Model.load(path, backend=backend, act=F32)
    names = {la.kernel.name for la in model.compiled.plan.launches}
    assert any("_ropelongrope10000_f" in n and n.startswith("kv_append") for n in names)
    assert max_rel(model.logits(golden["long.tokens"]), golden["long.logits"]) <= 1e-3
    gen = model.generate(golden["long.tokens"], 4)
    np.testing.assert_array_equal(gen.tokens, golden["long.greedy"])
    assert max_rel(gen.logits, golden["long.step_logits"]) <= 1e-3


def test_su_is_longrope_and_inspect_says_which_factors(tmp_path, capsys):
    su = load(longrope_checkpoint(tmp_path / "a", type="su"))
    longrope = load(longrope_checkpoint(tmp_path / "b"))
    assert su.rope_of(False, 64) == longrope.rope_of(False, 64)
    assert main(["-q", "inspect", str(longrope_checkpoint(tmp_path / "b"))]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    # the default cache (max_position_embeddings 128) passes 16: the long factors
    assert (
        line
        == "  RoPE theta 10000, rope_type longrope, factors [1 .. 8.75] (32), attention_factor 1.32288"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"short_factor": [1.0] * 31},
            r"rope_scaling.short_factor must be a list of 32 numbers \(head_dim / 2\), got 31",
        ),
        ({"long_factor": None}, r"rope_scaling.long_factor must be a list of 32 numbers"),
        ({"long_factor": [0.0] * 32}, r"rope_type longrope needs factors as 32 positive floats"),
        ({"attention_factor": 0}, r"rope_scaling.attention_factor is 0, expected a number > 0"),
    ],
)
def test_bad_longrope_parameters_are_refused_naming_the_field(tmp_path, change, message):
    path = longrope_checkpoint(tmp_path, **change)
    with pytest.raises(FormatError, match=message):
        load(path).rope_of(False, 64)
