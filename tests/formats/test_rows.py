"""Row ranges of a weight's kernel-layout buffers (WeightFormat.rows, how Phi-3's fused
projections become q/k/v and gate/up): views of the buffers that hold rows, the shared ones
(per-tensor scales, GPTQ's g_idx) as they are, decoding to the whole weight's rows."""

from __future__ import annotations

import numpy as np
import pytest

from qir.formats.base import WeightFormat
from tests.conftest import FORMAT_ZOO, random_weight


@pytest.mark.parametrize("fmt", FORMAT_ZOO, ids=lambda f: f.tag())
def test_rows_are_views_that_decode_to_the_weights_rows(fmt: WeightFormat) -> None:
    out, k = 40, 256
    _, bufs = random_weight(np.random.default_rng(0), out, k, fmt)
    whole = fmt.dequantize(bufs, out, k)
    for start, stop in ((0, 24), (24, 40), (7, 9)):
        part = fmt.rows(bufs, out, k, start, stop)
        fmt.check_buffers(part, stop - start, k, where="part")
        assert all(np.shares_memory(part[b], bufs[b]) for b in bufs)  # no copy
        np.testing.assert_array_equal(fmt.dequantize(part, stop - start, k), whole[start:stop])
