"""docs/usage.md's Python example runs as written, on a real checkpoint (tests/test_docs.py
leaves it to this test: its path is a placeholder)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from tests.runtime.test_executor import needs_gxx

ROOT = Path(__file__).parent.parent


@needs_gxx
def test_the_python_example_runs(capsys) -> None:
    page = (ROOT / "docs" / "usage.md").read_text()
    (example,) = re.findall(r"```python\n(import numpy as np, qir.*?)```", page, flags=re.S)
    assert '"path/to/checkpoint"' in example
    checkpoint = ROOT / "tests" / "data" / "ct_nvfp4_w4a4_S"  # bf16 activations, not f16
    scope: dict[str, object] = {}
    exec(example.replace('"path/to/checkpoint"', repr(str(checkpoint))), scope)
    y, x = scope["y"], scope["x"]
    assert isinstance(y, np.ndarray) and y.shape == (4, x.shape[1])
    assert np.isfinite(y.astype(np.float32)).all()
    assert "qlinear" in capsys.readouterr().out  # the printed IR
