"""The outputs of the tool that made an embedded checkpoint, for `qir demo`: beside each one a
`golden_demo.npz` holds the demo's inputs (x.M1, x.M5, float16 [M, hidden]) and the tool's
layer-0 q/k/v/mlp outputs for them (float32), copied key for key from the fixture set's
golden.npz (tests/data/<case>/; tests check they are identical). The tool's own forward where
the fixture has one (MLX), its 4-bit-activation outputs for a W4A4 checkpoint (what qir runs
it with), else x @ W^T with the tool's own decoded W."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

FILE = "golden_demo.npz"
# Per block output, the golden keys in order of preference ({m}: the batch rows).
KEYS = {
    "y": ("mlx_forward.mlp.0.M{m}", "mlp_a4.0.M{m}", "mlp.0.M{m}"),
    **{p: (f"mlx_forward.{p}.0.M{{m}}", f"{p}_a4.0.M{{m}}", f"{p}.0.M{{m}}") for p in "qkv"},
}


class DemoGolden:
    def __init__(self, path: Path) -> None:
        with np.load(path / FILE) as z:
            self.arrays = {k: z[k] for k in z.files}

    @classmethod
    def of(cls, checkpoint: Path) -> DemoGolden | None:
        return cls(checkpoint) if (checkpoint / FILE).is_file() else None

    def x(self, m: int) -> np.ndarray | None:
        return self.arrays.get(f"x.M{m}")

    def output(self, name: str, m: int) -> np.ndarray | None:
        """The tool's value of block output `name` (y, q, k, v) for input x.M{m}."""
        for key in KEYS.get(name, ()):
            if key.format(m=m) in self.arrays:
                result: np.ndarray | None = self.arrays[key.format(m=m)]
                return result
        return None


def embedded_checkpoints() -> list[Path]:
    """The checkpoints shipped inside the package (qir/models/embedded), in name order."""
    root = resources.files("qir.models") / "embedded"
    return sorted(Path(str(p)) for p in root.iterdir() if (Path(str(p)) / "config.json").is_file())
