"""The benchmarks run end to end on the host backend at a tiny scale, so a lent GPU's few minutes
are never spent finding a crash. Their timings are printed, not asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str) -> ModuleType:
    """A benchmark script as a module (they are scripts, not a package)."""
    if f"benchmarks.{name}" in sys.modules:
        return sys.modules[f"benchmarks.{name}"]
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_llama_shapes_on_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("llama_shapes")
    out = tmp_path / "rows.json"
    argv = ["--backend", "host", "--m", "1", "--repeat", "1", "--formats", "ct4g128bf16"]
    rows = bench.main([*argv, "--json", str(out)])
    launches = {(r.block, r.variant): r.launches for r in rows}
    # Fusion shows in the launch counts: MLP 6 -> 2 (4 without SiLU fusion), q/k/v 3 -> 1.
    assert launches == {
        ("mlp", "fused"): 2,
        ("mlp", "silu_prologue"): 2,
        ("mlp", "no_silu_fusion"): 4,
        ("mlp", "unfused"): 6,
        ("qkv", "fused"): 1,
        ("qkv", "unfused"): 3,
    }
    assert all(r.us > 0 and r.mib > 0 for r in rows)
    assert json.loads(out.read_text())["rows"][0]["format"] == "ct4g128bf16"
    assert "mlp  M=1   fused" in capsys.readouterr().out


def test_llama_shapes_refuses_an_unknown_format() -> None:
    with pytest.raises(SystemExit):
        load("llama_shapes").main(["--backend", "host", "--formats", "int3"])


def test_tiled_weights_repeat_one_quantized_tile() -> None:
    """200 rows (not a multiple of the 64-row tile) of every benchmarked format decode to the
    first tile, repeated: the tiling keeps each buffer's layout."""
    bench = load("llama_shapes")
    for fmt in bench.FORMATS:
        qw, bufs = bench.tiled_weight(np.random.default_rng(0), fmt, 200, 256)
        w = fmt.dequantize(bufs, qw.out_features, qw.in_features)
        assert w.shape == (200, 256) and np.abs(w).max() > 0, fmt.spell()
        np.testing.assert_array_equal(w, np.tile(w[:64], (4, 1))[:200], err_msg=fmt.spell())
