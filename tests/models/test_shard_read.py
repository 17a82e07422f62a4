"""A tensor-parallel rank reads only its shards of the checkpoint (qir.models.shard_read), for
every layout: each element of a split tensor is read by exactly one rank (the pass's shards
partition it), a replicated one by every rank, nothing by one rank twice, the counted bytes are
those elements' bytes, and the weights a rank builds are the format's exact cuts of the whole
ones. The few tensors a layout has to share between ranks (GPTQ act-order groups two ranks'
inputs use, AWQ GEMV's qzeros words that hold several ranks' groups, a block of FP8 scale rows
two ranks' rows lie in) are listed per case with the reason, and what is never read (padding)
too."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qir.dtypes import F32
from qir.models import load
from qir.models.blocks import build
from qir.models.shard_read import ShardReader, load_rank
from qir.models.shards import tensor_parallel
from tests.conftest import DATA
from tests.tp_checkpoints import uneven

# Tensors every rank reads whole: the embedding table (a lookup reads M rows) and the router.
REPLICATED = r"embed_tokens|\.gate\.weight|\.gate\.scales|\.gate\.biases"


def _read_masks(monkeypatch, ck, ranks: int, rank: int):
    """Rank `rank`'s part, its reader, and per tensor of 2+ dims how often each element was read."""
    masks: dict[str, np.ndarray] = {}
    read = ShardReader.read

    def recording(self, name, index=None):
        a = read(self, name, index)
        if len(self.store.shape(name)) >= 2:
            m = masks.setdefault(name, np.zeros(self.store.shape(name), np.int64))
            if index is None:
                m += 1
            else:
                np.add.at(m, index, 1)
        return a

    with monkeypatch.context() as patch:
        patch.setattr(ShardReader, "read", recording)
        part, reader = load_rank(ck, ranks, rank, act=F32, max_seq=32)
    return part, reader, masks


def _check(monkeypatch, path: Path, ranks: int, shared: dict[str, tuple[int, ...]]):
    """Every rank of `ranks` reads its share of `path` and builds the exact cuts; `shared`: a
    tensor pattern -> the counts (ranks reading an element) its elements may have besides 1."""
    ck = load(path)
    block = build(ck, "model", 0, act=F32, max_seq=32)
    counts: dict[str, np.ndarray] = {}
    bytes_read = []
    for r in range(ranks):
        part, reader, masks = _read_masks(monkeypatch, load(path), ranks, r)
        assert reader.whole == set(), "read whole, then cut"
        bytes_read.append(reader.bytes_read)
        small = reader.bytes_read - sum(
            int(m.sum()) * ck.store.dtype(t).itemsize for t, m in masks.items()
        )
        # the rest are tensors of under 2 dims (norms, biases, g_idx, per-tensor scales)
        assert (
            0
            <= small
            <= sum(2 * ck.store.get(t).nbytes for t in ck.store if len(ck.store.shape(t)) < 2)
        )
        for t, m in masks.items():
            assert m.max() == 1 or re.search(REPLICATED, t), f"rank {r} read {t} twice"
            counts[t] = counts.get(t, 0) + m
        want = tensor_parallel(block, ranks, r)
        assert part.graph.name == want.graph.name
        assert part.weights.keys() == want.weights.keys()
        for key, bufs in want.weights.items():
            assert bufs.keys() == part.weights[key].keys(), key
            for b, a in bufs.items():
                np.testing.assert_array_equal(part.weights[key][b], a, err_msg=f"{key}.{b}")
                assert part.weights[key][b].dtype == a.dtype, f"{key}.{b}"
    for t in ck.store:
        if len(ck.store.shape(t)) < 2:
            continue
        got = counts.get(t, np.zeros(ck.store.shape(t), np.int64))
        if re.search(REPLICATED, t):
            assert (got == ranks).all(), t
            continue
        allowed = {1}
        for pattern, more in shared.items():
            if re.search(pattern, t):
                allowed |= set(more)
        assert set(np.unique(got).tolist()) <= allowed, (t, np.unique(got).tolist())
    whole = sum(ck.store.get(t).nbytes for t in ck.store)
    assert max(bytes_read) < whole
    return bytes_read, whole


# KV heads fewer than ranks: each is read by the ranks that replicate it.
KV2 = {r"\.(k|v)_proj\.": (2,)}

# desc_act: each rank's inputs use nearly every group, so every rank reads their scale rows
# (GPTQ act-order's zeros and scales: the rows of the groups its inputs use, by 1 to N ranks)
DESC_ACT = {r"\.(o_proj|down_proj)\.(qzeros|scales)$": (0, 2, 3, 4)}

CASES = [
    # (checkpoint (a fixture, or tests/tp_checkpoints.py's), ranks, tensors shared or unread
    # besides a single reader, and why). Those named @<features> have an MLP whose groups do not
    # divide by the ranks (5 groups of 64 for 320): each rank reads ceil or floor of them.
    ("mlx@320", (2, 4), {}),
    ("awq_gemm@320", (2, 4), {}),
    ("nvfp4_w4a4@336", (2, 4), {}),
    ("gptq@320", (2,), {}),
    ("gptq@320", (4,), KV2),
    ("gptq_desc_act@320", (2,), DESC_ACT),
    ("gptq_desc_act@320", (4,), {**KV2, **DESC_ACT}),
    # heads uneven too: 10 of 32 in groups of 64, over 5 KV heads (3 + 2, 2 + 2 + 1, ...) or
    # one, which all 4 ranks read (4 + 2 + 2 + 2 query heads)
    ("heads10_kv5", (2, 3, 4), {}),
    ("heads10_kv1", (4,), {r"\.(k|v)_proj\.": (4,)}),
    # AWQ GEMV: eight groups' zeros share a word and rows pad to whole words of groups: the
    # word of two ranks' groups is read by both, the padding by none
    ("awq_gemv@320", (2, 4), {r"\.qzeros$": (0, 2, 3, 4), r"\.scales$": (0,)}),
    # Phi-3: q/k/v and gate/up are rows of qkv_proj / gate_up_proj
    ("mlx_affine4_phi3", (2,), {}),
    ("mlx_affine4_phi3", (4,), {r"qkv_proj": (2,)}),
    ("ct_w4a16_phi3", (2,), {}),
    # compressed-tensors int and float layouts; per channel, a K part needs every row's scale
    ("ct_int4@384", (2,), {}),
    ("ct_int4_channel", (2, 4), {r"(o_proj|down_proj)\.weight_scale$": (2, 4)}),
    ("gptq_per_row", (2,), {r"(o_proj|down_proj)\.(qzeros|scales)$": (2,)}),
    ("gptq_per_row", (4,), {**KV2, r"(o_proj|down_proj)\.(qzeros|scales)$": (4,)}),
    ("mxfp4@352", (2, 4), {}),
    # FP8 per channel: a K part needs every row's scale
    ("ct_fp8_dynamic_S", (2, 4), {r"(o_proj|down_proj)\.weight_scale$": (2, 4)}),
    # block FP8: k/v's 128 rows are one block of scales, both ranks' rows lie in it; K 416 is
    # three blocks of 128 and a ragged one, 2 + 2 (ct_fp8block_qwen3: compressed-tensors')
    ("fp8block_qwen3", (2,), {r"\.(k|v)_proj\.weight_scale_inv$": (2,)}),
    ("ct_fp8block_qwen3", (2,), {r"\.(k|v)_proj\.weight_scale$": (2,)}),
    # stacked experts (mlx-lm switch_mlp) and one module per expert (AWQ)
    ("mixtral_mlx4_g64", (2,), {}),
    ("mixtral_awq_gemm_g64", (2,), {}),
]


@pytest.mark.parametrize(
    ("fixture", "ranks", "shared"), CASES, ids=[f"{c[0]}-{'-'.join(map(str, c[1]))}" for c in CASES]
)
def test_each_rank_reads_only_its_shard_and_builds_the_exact_cuts(
    monkeypatch, tmp_path, fixture, ranks, shared
):
    path = uneven(tmp_path, fixture)
    for n in ranks:
        _check(monkeypatch, path, n, shared)


def _act_order(tmp_path: Path) -> Path:
    """autogptq_g64_llama with desc_act's g_idx: the inputs of each quarter of a row-parallel
    linear in one group, the groups permuted (2, 0, 3, 1, ...), so a rank's groups are neither
    its own nor contiguous. The codes are unchanged: only which scale each input takes."""
    src = DATA / "autogptq_g64_llama"
    out = tmp_path / "act_order"
    shutil.copytree(src, out)
    name = "gptq_model-4bit-64g.safetensors"
    tensors = load_file(src / name)
    for key, g in tensors.items():
        if key.endswith(".g_idx") and ("o_proj" in key or "down_proj" in key):
            k = len(g)
            groups = k // 64
            quarter = np.arange(k) * 4 // k  # 0..3
            order = np.array([2, 0, 3, 1]) * (groups // 4)
            within = (np.arange(k) % (k // 4)) // 64
            tensors[key] = (order[quarter] + within).astype(np.int32)
    save_file(tensors, out / name, metadata={"format": "pt"})
    return out


def test_act_order_gptq_reads_only_the_groups_its_inputs_use(monkeypatch, tmp_path):
    path = _act_order(tmp_path)
    ck = load(path)
    g_idx = ck.store.get("model.layers.0.self_attn.o_proj.g_idx")
    assert not np.array_equal(g_idx, np.arange(256) // 64)
    lin = ck.linear("model.layers.0.self_attn.o_proj")
    assert lin.weight.format.act_order == 1
    # each rank's part of o_proj reads the scale rows of its own two groups, not four
    for n in (2, 4):
        _check(monkeypatch, path, n, {} if n == 2 else KV2)
    masks = _read_masks(monkeypatch, load(path), 2, 1)[2]
    rows = np.flatnonzero(masks["model.layers.0.self_attn.o_proj.scales"].any(axis=1))
    assert rows.tolist() == [1, 3]  # inputs 128..255 are in groups 3 and 1


def test_qwen2moe_ranks_read_their_part_of_the_shared_expert(monkeypatch, tmp_path):
    from tests.moe_common import qwen2moe_g32

    path = qwen2moe_g32(tmp_path / "qwen2moe")
    # the shared expert's sigmoid gate ([1, hidden]) is every rank's, as the router is
    bytes_read, whole = _check(monkeypatch, path, 2, {r"shared_expert_gate\.": (2,)})
    assert max(bytes_read) < 0.6 * whole


def test_gptoss_reads_its_heads_and_its_rows_of_the_interleaved_expert_blocks(monkeypatch):
    path = DATA / "gptoss_mxfp4"
    _check(monkeypatch, path, 2, {r"mlp\.router\.": (2,)})
    masks = _read_masks(monkeypatch, load(path), 2, 1)[2]
    # rank 1's gate (features 32..63) is rows 64, 66, .., 126 of gate_up_proj, its up 65, .., 127
    read = masks["model.layers.0.mlp.experts.gate_up_proj_blocks"].any(axis=(0, 2, 3))
    assert np.flatnonzero(read).tolist() == list(range(64, 128))


def test_a_ragged_last_block_goes_with_the_last_ranks_part(monkeypatch):
    # ct_fp8block_qwen3's down_proj has K 416: blocks of 128 at 0, 128, 256 and a ragged one at
    # 384; rank 1 of 2 takes the last two (inputs 256..416) and their scale columns, alone
    masks = _read_masks(monkeypatch, load(DATA / "ct_fp8block_qwen3"), 2, 1)[2]
    down = "model.layers.0.mlp.down_proj"
    assert np.flatnonzero(masks[f"{down}.weight"].any(axis=0)).tolist() == list(range(256, 416))
    assert np.flatnonzero(masks[f"{down}.weight_scale"].any(axis=0)).tolist() == [2, 3]
    up = masks["model.layers.0.mlp.up_proj.weight_scale"]  # its rows: blocks 2 and 3
    assert np.flatnonzero(up.any(axis=1)).tolist() == [2, 3]
