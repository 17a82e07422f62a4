"""The embedded checkpoints' demo goldens are the fixture set's goldens, key for key."""

from __future__ import annotations

import numpy as np
import pytest

from qir.models.goldens import FILE, DemoGolden, embedded_checkpoints
from tests.conftest import DATA


@pytest.mark.parametrize("path", embedded_checkpoints(), ids=lambda p: p.name)
def test_demo_golden_is_a_copy_of_the_fixture_golden(path):
    golden = DemoGolden.of(path)
    assert golden is not None, f"{path / FILE} is missing"
    with np.load(DATA / path.name / "golden.npz") as fixture:
        for key, value in golden.arrays.items():
            np.testing.assert_array_equal(value, fixture[key], err_msg=key)
    for m in (1, 5):
        assert golden.x(m) is not None and golden.x(m).shape == (m, 256)
        for out in ("y", "q", "k", "v"):
            assert golden.output(out, m).shape == (m, 256)
    # the tool's own forward where it has one, its 4-bit-activation outputs for W4A4
    mlx, w4a4 = path.name.startswith("mlx"), "w4a4" in path.name
    assert any(k.startswith("mlx_forward.") for k in golden.arrays) == mlx
    assert any("_a4." in k for k in golden.arrays) == w4a4
    assert (path / FILE).stat().st_size < 32 * 1024
