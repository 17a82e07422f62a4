"""K shards of a weight's kernel-layout buffers (WeightFormat.columns, the row-parallel half of
tensor parallelism): each decodes to exactly the whole weight's columns, and a cut that would
split a group, block or packed word is refused in one line naming the tensor and group size."""

from __future__ import annotations

import numpy as np
import pytest

from qir.dtypes import F16
from qir.formats.awq import Awq
from qir.formats.base import FormatError, WeightFormat
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from tests.conftest import FORMAT_ZOO, random_weight


@pytest.mark.parametrize("fmt", FORMAT_ZOO, ids=lambda f: f.tag())
def test_k_shards_decode_to_the_weights_columns(fmt: WeightFormat) -> None:
    out, k = 24, 512
    _, bufs = random_weight(np.random.default_rng(1), out, k, fmt)
    whole = fmt.dequantize(bufs, out, k)
    for ranks in (2, 4):
        part_k = k // ranks
        for r in range(ranks):
            start, stop = r * part_k, (r + 1) * part_k
            part = fmt.columns(bufs, out, k, start, stop, where="w")
            fmt.check_buffers(part, out, part_k, where="part")
            np.testing.assert_array_equal(fmt.dequantize(part, out, part_k), whole[:, start:stop])


@pytest.mark.parametrize(
    ("fmt", "cut", "error"),
    [
        (
            MlxAffine(4, 64, F16),
            32,
            r"w: a K split 0..32 of in_features 256 is not on the group "
            r"size 64 boundaries",
        ),
        (Awq(4, 128), 64, r"w: a K split 0..64 .* not on group boundaries \(group size 128\)"),
        (Gptq(4, 64, "gptq", 0, F16), 32, r"not on group boundaries \(group size 64\)"),
        (Nvfp4("mul", 16), 8, r"not on the NVFP4 block size 16 boundaries"),
    ],
    ids=lambda v: v.tag() if isinstance(v, WeightFormat) else None,
)
def test_inexact_k_splits_are_refused(fmt: WeightFormat, cut: int, error: str) -> None:
    _, bufs = random_weight(np.random.default_rng(2), 16, 256, fmt)
    with pytest.raises(FormatError, match=error):
        fmt.columns(bufs, 16, 256, 0, cut, where="w")


def test_act_order_shards_gather_their_groups_or_are_refused() -> None:
    fmt = Gptq(4, 32, "gptq", 1, F16)
    out, k, rng = 8, 256, np.random.default_rng(3)
    w = rng.standard_normal((out, k)).astype(np.float32)
    # GPTQ's act-order: groups follow a permutation of the inputs. Within each half here, so
    # each half's inputs use four groups (its own width): exact.
    perm = np.concatenate([rng.permutation(128), 128 + rng.permutation(128)])
    g_idx = (np.argsort(perm) // 32).astype(np.int32)
    bufs = fmt.quantize_grouped(w, g_idx)
    whole = fmt.dequantize(bufs, out, k)
    for start in (0, 128):
        part = fmt.columns(bufs, out, k, start, start + 128, where="w")
        fmt.check_buffers(part, out, 128, where="part")
        np.testing.assert_array_equal(fmt.dequantize(part, out, 128), whole[:, start : start + 128])
    scattered = fmt.quantize_grouped(w, (rng.permutation(k) // 32).astype(np.int32))
    with pytest.raises(
        FormatError,
        match=r"w: act-order g_idx puts inputs 0..128 in 8 groups, "
        r"more than the 4 a K shard of 128 holds \(group size 32\)",
    ):
        fmt.columns(scattered, out, k, 0, 128, where="w")


def test_a_part_read_as_plain_gptq_recasts_to_the_wholes_act_order() -> None:
    # A rank's act-order part whose inputs keep their groups in order reads as plain GPTQ.
    plain, act = Gptq(4, 64, "gptq", 0, F16), Gptq(4, 64, "gptq", 1, F16)
    _, bufs = random_weight(np.random.default_rng(4), 16, 128, plain)
    recast = act.recast(plain, bufs, 128)
    assert recast is not None
    act.check_buffers(recast, 16, 128, where="part")
    assert recast["g_idx"].tolist() == [0] * 64 + [1] * 64
    np.testing.assert_array_equal(act.dequantize(recast, 16, 128), plain.dequantize(bufs, 16, 128))
    assert plain.recast(act, recast, 128) is None  # the other way would need g_idx's order
    assert plain.recast(plain, bufs, 128) == bufs
