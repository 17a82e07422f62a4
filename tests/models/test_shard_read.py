"""A tensor-parallel rank reads only its shards of the checkpoint (qir.models.shard_read): the
bytes each rank's reader hands out are counted and equal its share, the weights it builds are
the format's exact cuts of the whole ones, and what cannot be cut before reading is read whole
and cut after."""

from __future__ import annotations

import numpy as np
import pytest

from qir.dtypes import F32
from qir.models import load
from qir.models.blocks import build
from qir.models.shard_read import load_rank
from qir.models.shards import tensor_parallel
from tests.conftest import DATA


def _share(ck, reader) -> int:
    """The bytes a rank should read: the tensors of a module it shards that have a dim along the
    split in proportion to its part, every other tensor whole."""
    total = 0
    for name in ck.store:
        a = ck.store.get(name)
        module = name.rpartition(".")[0]
        shard = reader.plan.get(module)
        dims = reader.axes.get(name.rpartition(".")[2], ())
        if shard is not None and module not in reader.whole and shard[1] in dims:
            _, _, start, stop, whole = shard
            total += a.nbytes * (stop - start) // whole
        else:
            total += a.nbytes
    return total


def _twice(ck) -> int:
    """Bytes of a linear's small tensors (biases, per-tensor scales): the types' build reads
    them, and so does the read of the linear itself."""
    linears = {t.rpartition(".")[0] for t in ck.store if ck.store.get(t).ndim >= 2}
    return sum(
        ck.store.get(t).nbytes
        for t in ck.store
        if ck.store.get(t).ndim < 2 and t.rpartition(".")[0] in linears
    )


@pytest.mark.parametrize(
    ("fixture", "whole"),
    [
        ("mlx_affine4_g64_S", set()),
        ("awq_gemm_g64_S", set()),
        ("ct_nvfp4_w4a4_S", set()),
        # GPTQ's g_idx numbers the whole weight's groups: row-parallel parts are read whole
        (
            "autogptq_g64_llama",
            {
                f"model.layers.{i}.{m}"
                for i in (0, 1)
                for m in ("self_attn.o_proj", "mlp.down_proj")
            },
        ),
    ],
)
def test_each_rank_reads_its_share_and_builds_the_exact_cuts(fixture, whole):
    full = tensor_parallel  # the in-memory cut of a whole block: what the reads must equal
    ck = load(DATA / fixture)
    block = build(ck, "model", 0, act=F32, max_seq=32)
    for n in (2, 4):
        for r in range(n):
            part, reader = load_rank(load(DATA / fixture), n, r, act=F32, max_seq=32)
            assert reader.whole == whole
            assert reader.bytes_read == _share(ck, reader) + _twice(ck)
            assert reader.bytes_read < sum(ck.store.get(t).nbytes for t in ck.store)
            want = full(block, n, r)
            assert part.graph.name == want.graph.name
            assert part.weights.keys() == want.weights.keys()
            for key, bufs in want.weights.items():
                assert bufs.keys() == part.weights[key].keys(), key
                for b, a in bufs.items():
                    np.testing.assert_array_equal(part.weights[key][b], a, err_msg=f"{key}.{b}")
