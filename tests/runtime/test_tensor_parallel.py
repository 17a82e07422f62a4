"""Tensor parallel on the host backend: each rank's part of a model compiled to host kernels,
the ranks as threads of one group exchanging through real collectives (launches of the plan):
logits equal --tp 1 within 1e-5 relative and greedy ids equal, for Llama checkpoints in AWQ,
GPTQ (desc_act), MLX and NVFP4 (W4A16 and W4A4), a Mixtral (MoE) and gpt-oss, on 2 ranks, 4 for
GPTQ and NVFP4 W4A4, 3 for MLX; AWQ's, GPTQ's and MLX's groups (and MLX's heads) do not divide
by the ranks. (tests/test_tp_mpi.py runs ranks as MPI processes.)"""

from __future__ import annotations

import numpy as np
import pytest

import qir
from qir import parse
from qir.collectives import LocalGroup, run_threads
from qir.dtypes import F32
from qir.errors import UsageError
from qir.models import Model, load
from qir.models.shards import shard_weights
from qir.passes.tensor_parallel import TensorParallel
from tests.conftest import DATA
from tests.moe_common import qwen2moe_g32
from tests.passes.test_layer_passes import weights_for
from tests.passes.test_tensor_parallel import MLP
from tests.tp_checkpoints import uneven

PROMPT = [3, 10, 17, 24, 31]


def _generate(ck, comm=None, prompt=PROMPT):
    m = Model(ck, backend="host", act=F32, max_seq=32, comm=comm)
    return m, m.generate(prompt, 3, do_sample=False)


@pytest.mark.parametrize(
    ("fixture", "ranks"),
    [
        # down_proj's 5 groups of 64 are 3 + 2 on 2 ranks, 2 + 1 + 1 + 1 on 4 (tests/tp_checkpoints.py)
        ("awq_gemm@320", (2,)),
        # desc_act: every K part keeps the whole's groups; 2 KV heads: 4 ranks replicate them
        ("gptq_desc_act@320", (2, 4)),
        # MLX, 10 heads of 32 over 5 KV heads, MLP 11 groups of 64: 4 + 4 + 2 heads, 4 + 4 + 3
        # groups on 3 ranks, each with its own KV cache shape
        ("heads10_kv5", (3,)),
        ("ct_nvfp4a16_S", (2,)),
        ("ct_nvfp4_w4a4_S", (2, 4)),  # K shards of 64 and 128: whole NVFP4 blocks
        ("mixtral_mlx4_g64", (2,)),  # experts split by rows: the MoE decode and combine kernels
        # sinks, q/k/v/o and expert biases, MXFP4 experts, windows of 8 (4 ranks: refused,
        # tests/passes/test_tensor_parallel.py)
        ("gptoss_mxfp4", (2,)),
    ],
)
def test_tp_ranks_equal_one_rank(tmp_path, fixture, ranks):
    """(4 ranks on two of them only: each rank count compiles its own kernel shapes.)"""
    ck = load(uneven(tmp_path, fixture))
    prompt = list(range(3, 13)) if fixture == "gptoss_mxfp4" else PROMPT  # past the window
    one, want = _generate(ck, prompt=prompt)
    for n in ranks:
        outs = run_threads(n, lambda c: _generate(ck, c, prompt), timeout=600)
        for m, got in outs:
            np.testing.assert_array_equal(got.tokens, want.tokens)
            err = np.abs(got.logits - want.logits).max() / np.abs(want.logits).max()
            assert err <= 1e-5, (n, err)
            np.testing.assert_array_equal(got.logits, outs[0][1].logits)  # ranks agree
            text = m.compiled.graph.name
            assert text == f"model.rank{m.comm.rank}of{n}"
            records = {r.name: r.matches for r in m.compiled.records}
            assert (
                records["route_w4a4"]
                == ({r.name: r.matches for r in one.compiled.records}["route_w4a4"])
            )
    if fixture == "ct_nvfp4_w4a4_S":  # the calibrated W4A4 path ran on every rank
        assert records["route_w4a4"] > 0


def test_a_shared_expert_on_two_ranks_equals_one_rank(tmp_path):
    """Qwen2-MoE: its shared expert split like the dense MLP, added in each rank's routed
    combine (host kernels: the MoE decode and combine kernels on both)."""
    ck = load(qwen2moe_g32(tmp_path / "qwen2moe"))
    _, want = _generate(ck)
    outs = run_threads(2, lambda c: _generate(ck, c), timeout=600)
    for m, got in outs:
        np.testing.assert_array_equal(got.tokens, want.tokens)
        err = np.abs(got.logits - want.logits).max() / np.abs(want.logits).max()
        assert err <= 1e-5, err
        np.testing.assert_array_equal(got.logits, outs[0][1].logits)
        assert m.shard_reader is not None and m.shard_reader.whole == set()
        assert "[64, 128]" in qir.print_graph(m.block.graph)  # the shared expert's half


def test_a_plan_with_collectives_needs_its_group():
    graph = parse(MLP)
    TensorParallel(2, 0).run(graph)
    weights = shard_weights(graph, weights_for(MLP, np.random.default_rng(0)))
    with pytest.raises(
        UsageError,
        match=r"all_reduce_f32_n64_r2: the block has collectives over "
        r"2 ranks; compile it with comm=",
    ):
        qir.compile(graph, weights, backend="host")
    with pytest.raises(UsageError, match="a group of 3 ranks runs a plan for 2"):
        qir.compile(graph, weights, backend="host", comm=LocalGroup(3).comm(0))


def test_ranks_draw_the_same_ids_without_a_seed():
    """A sampled generation with no seed: each rank would pick its own, draw other ids and
    feed its caches other tokens; rank 0's seed goes to every rank."""
    ck = load(DATA / "mlx_affine4_g64_S")

    def rank(c):
        m = Model(ck, backend="reference", act=F32, max_seq=32, comm=c)
        return m.generate(PROMPT, 6, temperature=1.5).tokens.tolist(), m.stats.seed

    outs = run_threads(2, rank, timeout=120)
    assert outs[0] == outs[1] and outs[0][1] is not None


def test_a_desc_act_k_part_runs_its_kernels_with_the_wholes_groups():
    """A K part of a desc_act GPTQ weight keeps all 8 of the whole's groups where its 136
    inputs would hold 5 (gptq<...,groups=8>): the host GEMV (1 row) and GEMM (40 rows) read its
    scales at that stride and equal the interpreter."""
    from qir.builder import Builder
    from qir.dtypes import F16
    from qir.formats.gptq import Gptq
    from qir.types import QWeight
    from tests.conftest import max_rel

    rng = np.random.default_rng(0)
    whole = Gptq(4, 32, "gptq", 1, F16)
    g_idx = (np.argsort(rng.permutation(256)) // 32).astype(np.int32)
    bufs = whole.quantize_grouped(rng.standard_normal((40, 256)).astype(np.float32), g_idx)
    fmt = whole.column_part(256, 120, 256)
    assert fmt.group_count(136) == 8 and fmt.tag() == "gptq4g32act8f16"
    b = Builder("part")
    x = b.input("x", ("M", 136), F16)
    b.output("y", b.qlinear(x, b.weight("w", QWeight(fmt, 40, 136), name="w")))
    weights = {"w": fmt.columns(bufs, 40, 256, 120, 256, where="w")}
    compiled = qir.compile(b.graph, weights, backend="host")
    reference = qir.compile(b.graph, weights, backend="reference")
    for m, family in ((1, "qgemv_gptq4g32act8f16"), (40, "qgemm_gptq4g32act8f16")):
        assert any(
            la.kernel.name.startswith(family) and la.runs_for(m) for la in compiled.plan.launches
        )
        xs = {"x": rng.standard_normal((m, 136), dtype=np.float32).astype(np.float16)}
        assert max_rel(compiled(xs)["y"], reference(xs)["y"]) <= 2e-3
