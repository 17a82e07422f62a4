"""Checkpoints of each model family made by the real tools (tests/data/<case>/ORACLE.md), as a
layer, a model and `qir generate` on the generated kernels: against transformers' own
modelling code in float32 on the tool-decoded weights (golden_model.npz), in f32 within 1e-3
with the same greedy ids, and in the checkpoint's 16-bit type within the layer tests' bounds;
and the launches per decode step the fusions promise (biases, q/k norms add none)."""

from __future__ import annotations

import numpy as np
import pytest

from qir.cli import main
from qir.dtypes import F32
from qir.models import Model, load
from qir.models.blocks import build
from tests.conftest import BACKENDS, DATA, greedy_prefix, max_rel
from tests.runtime.test_layer_kernels import GOLDEN_TOL, TOL, compiled

# Host kernels in f32 against transformers' float32 forward (the issue's bound).
F32_TOL = 1e-3
# case -> launches of one fused decoder layer at M = 1 (decode) and M = 5 (prefill): what a
# Llama layer takes, biases and q/k norms included.
CASES = {
    "autogptq_g64_llama": (7, 6),  # zero biases on all seven linears
    "mlx_affine4_qwen2": (7, 6),  # q/k/v biases
    "ct_w4a16_qwen2": (7, 6),
    "mlx_affine4_qwen3": (7, 6),  # q/k RMSNorm per head
    "ct_w4a16_qwen3": (7, 6),
}
# The 16-bit runs: one case per family (and format family), the rest share their kernels.
SIXTEEN_BIT = ("autogptq_g64_llama", "mlx_affine4_qwen2", "ct_w4a16_qwen3")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_f32_model_and_generate_match_transformers(case, backend, tmp_path, capsys):
    golden = np.load(DATA / case / "golden_model.npz")
    model = Model.load(DATA / case, backend=backend, act=F32)
    logits = model.logits(golden["tokens"])
    assert max_rel(logits, golden["logits"]) <= F32_TOL
    out = tmp_path / "g.npz"
    argv = ["-q", "generate", str(DATA / case), "--act-dtype", "f32", "--backend", backend]
    tokens = ",".join(map(str, golden["tokens"]))
    assert main([*argv, "--tokens", tokens, "--max-new-tokens", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()[0].split()
    gen = np.load(out)
    np.testing.assert_array_equal(gen["tokens"], golden["greedy"])
    assert printed == [str(t) for t in golden["greedy"]]
    assert max_rel(gen["logits"], golden["step_logits"]) <= F32_TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SIXTEEN_BIT)
def test_16_bit_layer_and_model_within_the_layer_bounds(case, backend):
    golden = np.load(DATA / case / "golden_model.npz")
    inputs = np.load(DATA / case / "golden.npz")
    ck = load(DATA / case)
    act = ck.act_dtype
    last = ck.num_layers - 1
    b = build(ck, "layer", last, act)
    ours, ref = compiled(b, backend), compiled(b, "reference")
    assert (ours.launches_for(1), ours.launches_for(5)) == CASES[case]
    for m in (1, 5, 40):
        x = inputs[f"x.M{m}"].astype(act.np)
        ours.reset_state()
        ref.reset_state()
        y, want = ours(b.inputs(x))["y"], ref(b.inputs(x))["y"]
        assert max_rel(y, want) <= TOL[act], m
        assert max_rel(y, golden[f"layer.{last}.M{m}"]) <= GOLDEN_TOL, m
    model = Model.load(DATA / case, backend=backend)
    # embedding, the layers, lm_head with the final norm as its prologue, the sampling
    assert model.compiled.launches_for(1) == 1 + ck.num_layers * CASES[case][0] + 2
    assert max_rel(model.logits(golden["tokens"]), golden["logits"]) <= GOLDEN_TOL
    gen = model.generate(golden["tokens"], 8)
    n = greedy_prefix(golden["step_logits"], gen.logits)
    assert n >= 1
    np.testing.assert_array_equal(gen.tokens[:n], golden["greedy"][:n])
    assert max_rel(gen.logits[:n], golden["step_logits"][:n]) <= GOLDEN_TOL
