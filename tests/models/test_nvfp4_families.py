"""NVFP4 checkpoint families: detection of ModelOpt / compressed-tensors / MLX configs, and the
refusals (missing tensor, wrong dtype/shape, NaN scale, group size) each naming the tensor."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from qir.formats.base import FormatError
from qir.formats.nvfp4 import Nvfp4
from qir.models import load
from qir.models.safetensors_io import TensorStore

DATA = Path(__file__).resolve().parents[1] / "data"
Q = "model.layers.0.self_attn.q_proj"
_DTYPE = {
    np.dtype(np.uint8): "U8",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
}


def _save(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Minimal safetensors writer (safetensors.numpy cannot write float8)."""
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": _DTYPE[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def _copy(
    case: str,
    tmp: Path,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
    qedit: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A copy of a fixture with its layer-0 q_proj tensors (only) edited."""
    src, dst = DATA / case, tmp / case
    dst.mkdir()
    store = TensorStore(src)
    names = [n for n in sorted(store.keys()) if n.startswith(Q + ".")]
    tensors = {n: np.array(store.get(n)) for n in names}
    if edit:
        edit(tensors)
    _save(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if qedit:
        qedit(config)
    (dst / "config.json").write_text(json.dumps(config))
    if (src / "hf_quant_config.json").exists():
        shutil.copy(src / "hf_quant_config.json", dst)
    return dst


@pytest.mark.parametrize(
    ("case", "family"),
    [
        ("modelopt_nvfp4_S", "nvfp4_modelopt"),
        ("ct_nvfp4a16_S", "nvfp4_compressed_tensors"),
        ("ct_nvfp4_w4a4_S", "nvfp4_compressed_tensors"),
        ("mlx_nvfp4_S", "nvfp4_mlx"),
    ],
)
def test_fixtures_are_detected(case: str, family: str) -> None:
    ck = load(DATA / case)
    assert ck.convention.name == family
    lin = ck.linear(Q)
    assert all(not a.flags.writeable for a in lin.buffers.values())


def test_modelopt_from_hf_quant_config_alone(tmp_path: Path) -> None:
    """Older ModelOpt exports describe the quantization only in hf_quant_config.json."""
    path = _copy("modelopt_nvfp4_S", tmp_path, qedit=lambda c: c.pop("quantization_config"))
    lin = load(path).linear(Q)
    assert lin.weight.format == Nvfp4("mul", 4)
    assert lin.buffers["input_scale"].shape == (1,)


def test_modelopt_without_input_activations_is_w4a16(tmp_path: Path) -> None:
    def qedit(c: dict[str, Any]) -> None:
        del c["quantization_config"]["config_groups"]["group_0"]["input_activations"]

    assert load(_copy("modelopt_nvfp4_S", tmp_path, qedit=qedit)).linear(Q).weight.format == (
        Nvfp4("mul", 16)
    )


def _group(c: dict[str, Any]) -> dict[str, Any]:
    return c["quantization_config"]["config_groups"]["group_0"]


def _del(name: str) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        del t[f"{Q}.{name}"]

    return edit


def _nan_scale(name: str) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        s = t[f"{Q}.{name}"].view(np.uint8)
        s[3, 2] = 0x7F

    return edit


@pytest.mark.parametrize(
    ("case", "edit", "qedit", "message"),
    [
        ("modelopt_nvfp4_S", _del("weight_scale_2"), None, rf"{Q}\.weight_scale_2: missing"),
        ("modelopt_nvfp4_S", _del("input_scale"), None, rf"{Q}\.input_scale: missing"),
        ("modelopt_nvfp4_S", _del("weight"), None, rf"{Q}\.weight: missing"),
        (
            "modelopt_nvfp4_S",
            lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].view(np.uint8)}),
            None,
            rf"{Q}\.weight_scale: uint8 \[256, 16\], expected float8_e4m3fn",
        ),
        (
            "modelopt_nvfp4_S",
            lambda t: t.update({f"{Q}.weight_scale_2": np.ones(2, np.float32)}),
            None,
            rf"{Q}\.weight_scale_2: float32 \[2\], expected one float32",
        ),
        (
            "modelopt_nvfp4_S",
            _nan_scale("weight_scale"),
            None,
            rf"{Q}\.weight_scale: E4M3 NaN .*\[3, 2\]",
        ),
        (
            "modelopt_nvfp4_S",
            None,
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                group_size=32
            ),
            "group_size 32, NVFP4 needs 16",
        ),
        ("ct_nvfp4a16_S", _del("weight_global_scale"), None, rf"{Q}\.weight_global_scale: miss"),
        ("ct_nvfp4_w4a4_S", _del("input_global_scale"), None, rf"{Q}\.input_global_scale: miss"),
        ("ct_nvfp4a16_S", _del("weight_packed"), None, rf"{Q}\.weight_packed: missing"),
        (
            "ct_nvfp4a16_S",
            lambda t: t.update({f"{Q}.weight_packed": t[f"{Q}.weight_packed"][:, :96]}),
            None,
            rf"{Q}\.weight_scale: shape \[256, 16\], expected \[256, 12\]",
        ),
        (
            "ct_nvfp4a16_S",
            _nan_scale("weight_scale"),
            None,
            rf"{Q}\.weight_scale: E4M3 NaN code 0x7F",
        ),
        (
            "ct_nvfp4a16_S",
            None,
            lambda c: _group(c)["weights"].update(group_size=32),
            r"group_0\.weights: group_size 32",
        ),
        (
            "ct_nvfp4a16_S",
            lambda t: t.update({f"{Q}.weight_global_scale": np.zeros(1, np.float32)}),
            None,
            rf"{Q}\.weight_global_scale: 0\.0, expected a positive scale",
        ),
        ("mlx_nvfp4_S", _del("scales"), None, rf"{Q}\.scales: missing"),
        (
            "mlx_nvfp4_S",
            lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].view(np.uint8)}),
            None,
            rf"{Q}\.weight: uint8 \[256, 128\], expected uint32",
        ),
        (
            "mlx_nvfp4_S",
            None,
            lambda c: c["quantization"].update(group_size=32),
            r"quantization: group_size 32",
        ),
        (
            "mlx_nvfp4_S",
            None,
            lambda c: c["quantization"].update({Q: {"mode": "affine", "bits": 4}}),
            "not supported: MLX mode affine in an nvfp4 checkpoint",
        ),
        # Excluded, but stored quantized: the dense read names the tensor it cannot use.
        (
            "mlx_nvfp4_S",
            None,
            lambda c: c["quantization"].update({Q: False}),
            rf"{Q}\.weight: uint32 \[256, 32\], expected an unquantized f16/bf16/f32",
        ),
        (
            "ct_nvfp4a16_S",
            None,
            lambda c: c["quantization_config"]["ignore"].append(Q),
            rf"{Q}\.weight: missing from .*\(expected an unquantized linear\)",
        ),
        (
            "modelopt_nvfp4_S",
            None,
            lambda c: c["quantization_config"]["ignore"].append("model.layers.*.self_attn"),
            rf"{Q}\.weight: uint8 \[256, 128\], expected an unquantized f16/bf16/f32",
        ),
    ],
)
def test_refusals_name_the_tensor(
    tmp_path: Path,
    case: str,
    edit: Callable[[dict[str, np.ndarray]], None] | None,
    qedit: Callable[[dict[str, Any]], None] | None,
    message: str,
) -> None:
    ck = load(_copy(case, tmp_path, edit, qedit))
    with pytest.raises(FormatError, match=message) as info:
        ck.linear(Q)
    assert "\n" not in str(info.value)


def _ignore(pattern: str) -> Callable[[dict[str, Any]], None]:
    def qedit(c: dict[str, Any]) -> None:
        c["quantization_config"]["ignore"].append(pattern)

    return qedit


@pytest.mark.parametrize(
    ("case", "qedit"),
    [
        ("mlx_nvfp4_S", lambda c: c["quantization"].update({Q: False})),
        ("ct_nvfp4a16_S", _ignore(Q)),
        ("ct_nvfp4_w4a4_S", _ignore("re:.*self_attn\\.q_proj$")),
        ("ct_nvfp4_w4a4_S", None),  # no weight_packed: a module no group quantized
        ("modelopt_nvfp4_S", _ignore("model.layers.*.self_attn")),
        ("modelopt_nvfp4_S", _ignore("q_proj")),
    ],
)
def test_excluded_modules_read_dense(
    tmp_path: Path, case: str, qedit: Callable[[dict[str, Any]], None] | None
) -> None:
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(ml_dtypes.bfloat16)

    def edit(t: dict[str, np.ndarray]) -> None:
        t.clear()
        t[f"{Q}.weight"] = w

    lin = load(_copy(case, tmp_path, edit, qedit)).linear(Q)
    assert lin.weight.format.spell() == "dense<dtype=bf16>"
    np.testing.assert_array_equal(lin.buffers["weight"], w)


def test_mlx_global_scale_is_the_tensor_amax(tmp_path: Path) -> None:
    def edit(t: dict[str, np.ndarray]) -> None:
        t[f"{Q}.global_scale"] = np.array(5376.0, np.float32)

    ck = load(_copy("mlx_nvfp4_S", tmp_path, edit))
    plain = load(DATA / "mlx_nvfp4_S").linear(Q)
    lin = ck.linear(Q)
    assert lin.buffers["global_scale"][0] == 2  # decode factor global_scale / 2688
    w, w1 = (x.weight.format.dequantize(x.buffers, 256, 256) for x in (lin, plain))
    np.testing.assert_array_equal(w, 2 * w1)
