"""K shards of a weight's kernel-layout buffers (WeightFormat.columns, the row-parallel half of
tensor parallelism): whole groups, blocks or words per rank, unevenly where they do not divide by
the ranks, each part in its own format (column_part) decoding to exactly the whole weight's
columns, and a cut that would split a group, block or packed word refused in one line naming
the tensor and group size."""

from __future__ import annotations

import numpy as np
import pytest

from qir.dtypes import BF16, F16
from qir.formats import parse_format
from qir.formats.awq import Awq
from qir.formats.base import FormatError, WeightFormat
from qir.formats.ct_int import CtInt
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.nvfp4 import Nvfp4
from qir.passes.tensor_parallel import unit_range
from tests.conftest import FORMAT_ZOO, random_weight

# One group per row (compressed-tensors strategy "channel", GPTQ group_size -1): every K part
# keeps the row's scale.
PER_ROW = (CtInt(8, 640, F16), CtInt(4, 640, BF16), Gptq(4, 640, "gptq", 0, F16))


@pytest.mark.parametrize("fmt", FORMAT_ZOO + PER_ROW, ids=lambda f: f.tag())
def test_uneven_k_shards_decode_to_the_weights_columns(fmt: WeightFormat) -> None:
    """K = 640 is 5 groups of 128 (or 10 of 64, ...): 2, 3 and 4 ranks take whole units
    unevenly (3 + 2, 2 + 2 + 1, 2 + 1 + 1 + 1 groups of 128), each part in its own format."""
    out, k = 24, 640
    _, bufs = random_weight(np.random.default_rng(1), out, k, fmt)
    whole = fmt.dequantize(bufs, out, k)
    unit = fmt.column_unit(k)
    for ranks in (2, 3, 4):
        widths = []
        for r in range(ranks):
            start, stop = unit_range(k, unit, ranks, r)
            widths.append(stop - start)
            part_fmt = fmt.column_part(k, start, stop)
            part = part_fmt.columns(bufs, out, k, start, stop, where="w")
            part_fmt.check_buffers(part, out, stop - start, where="part")
            got = part_fmt.dequantize(part, out, stop - start)
            np.testing.assert_array_equal(got, whole[:, start:stop])
        assert sum(widths) == k and max(widths) - min(widths) <= unit
        assert unit != 128 or len(set(widths)) == 2  # 5 groups of 128: uneven


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


def test_act_order_shards_keep_every_group_their_inputs_may_use() -> None:
    """desc_act: the groups follow a permutation of all the inputs, so any range of inputs uses
    (nearly) every group. A K part on any word boundary keeps the whole's groups, g_idx as it
    is, the columns of groups it does not use zero."""
    fmt = Gptq(4, 32, "gptq", 1, F16)
    out, k, rng = 8, 256, np.random.default_rng(3)
    w = rng.standard_normal((out, k)).astype(np.float32)
    g_idx = (np.argsort(rng.permutation(k)) // 32).astype(np.int32)
    bufs = fmt.quantize_grouped(w, g_idx)
    whole = fmt.dequantize(bufs, out, k)
    assert fmt.column_unit(k) == 8
    for start, stop in ((0, 136), (136, 256), (8, 16)):
        part_fmt = fmt.column_part(k, start, stop)
        assert part_fmt.group_count(stop - start) == 8  # the whole's
        part = part_fmt.columns(bufs, out, k, start, stop, where="w")
        part_fmt.check_buffers(part, out, stop - start, where="part")
        np.testing.assert_array_equal(
            part_fmt.dequantize(part, out, stop - start), whole[:, start:stop]
        )
        np.testing.assert_array_equal(part["g_idx"], g_idx[start:stop])
        unused = np.setdiff1d(np.arange(8), g_idx[start:stop])
        assert not part["scales"][:, unused].any() and not part["zeros"][:, unused].any()
    part_fmt = fmt.column_part(k, 0, 136)
    assert part_fmt.spell().endswith(",groups=8>")  # ceil(136 / 32) is 5
    assert parse_format(part_fmt.spell()) == part_fmt
    assert "groups" not in fmt.column_part(k, 0, 240).spell()  # ceil(240 / 32) is 8
    with pytest.raises(
        FormatError, match=r"w: a K split 0..4 of in_features 256 is not on 8-input words"
    ):
        fmt.columns(bufs, out, k, 0, 4, where="w")


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
