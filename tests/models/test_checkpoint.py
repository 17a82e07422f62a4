"""Checkpoint loading: real mlx-lm fixtures against their goldens, and every refusal path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from qir.dtypes import BF16, F16
from qir.formats.base import FormatError
from qir.formats.mlx import MlxAffine
from qir.models import Linear, layer_module, load

DATA = Path(__file__).resolve().parents[1] / "data"
CASES = ["mlx_affine4_g64_S", "mlx_affine8_g64_S", "mlx_mixed_3_6_S"]
PROJ = ["q", "k", "v", "o", "gate", "up", "down"]
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case", CASES)
def test_fixture_linears_match_golden(case: str) -> None:
    ck = load(DATA / case)
    assert (ck.hidden_size, ck.intermediate_size, ck.num_layers) == (256, 512, 1)
    assert (ck.num_heads, ck.num_kv_heads, ck.head_dim) == (4, 4, 64)
    assert ck.act_dtype == BF16
    golden = np.load(DATA / case / "golden.npz")
    for p in PROJ:
        lin = ck.linear(ck.layer_module(0, p))
        want = golden[f"W.0.{p}"]
        assert (lin.weight.out_features, lin.weight.in_features) == want.shape
        assert all(not a.flags.writeable for a in lin.buffers.values())
        w = lin.weight.format.dequantize(lin.buffers, *want.shape)
        np.testing.assert_array_equal(w, want, err_msg=f"{case} {lin.module}")


def test_fixture_mixed_bits_per_module() -> None:
    ck = load(DATA / "mlx_mixed_3_6_S")
    bits = {}
    for p in PROJ:
        fmt = ck.linear(ck.layer_module(0, p)).weight.format
        assert isinstance(fmt, MlxAffine)
        bits[p] = fmt.bits
    assert bits == {"q": 3, "k": 3, "v": 6, "o": 3, "gate": 3, "up": 3, "down": 6}


def test_layer_module_names_and_range() -> None:
    assert layer_module(3, "gate") == "model.layers.3.mlp.gate_proj"
    assert layer_module(0, "k_proj") == "model.layers.0.self_attn.k_proj"
    ck = load(DATA / "mlx_affine4_g64_S")
    with pytest.raises(FormatError, match=r"layer 1 out of range.* 1 layers"):
        ck.layer_module(1, "q")
    with pytest.raises(FormatError, match="layer -1 out of range"):
        layer_module(-1, "q")
    with pytest.raises(FormatError, match="unknown layer linear 'qkv'"):
        layer_module(0, "qkv")


# ---- small synthetic checkpoints ------------------------------------------------------------

HIDDEN, INTER = 64, 128
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "torch_dtype": "float16",
}


def _module_tensors(module: str, fmt: MlxAffine, out_f: int, in_f: int) -> dict[str, np.ndarray]:
    w = np.random.default_rng(0).standard_normal((out_f, in_f), dtype=np.float32)
    return {f"{module}.{k}": v for k, v in fmt.quantize(w).items()}


def _write(
    path: Path, tensors: dict[str, np.ndarray], qcfg: dict[str, Any] | None, **config: Any
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**CONFIG, **config}
    if qcfg is not None:
        cfg["quantization"] = qcfg
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


QCFG = {"bits": 4, "group_size": 32, "mode": "affine"}
FMT = MlxAffine(4, 32, F16)


def _q_proj() -> dict[str, np.ndarray]:
    return _module_tensors(Q_PROJ, FMT, HIDDEN, HIDDEN)


def test_small_checkpoint_round_trip(tmp_path: Path) -> None:
    tensors = _q_proj()
    ck = load(_write(tmp_path / "ck", tensors, QCFG))
    assert ck.act_dtype == F16 and ck.head_dim == 32 and ck.num_kv_heads == 1
    lin = ck.linear(Q_PROJ)
    assert isinstance(lin, Linear)
    assert lin.weight.format == FMT
    assert (lin.weight.out_features, lin.weight.in_features) == (HIDDEN, HIDDEN)
    for name, arr in lin.buffers.items():
        np.testing.assert_array_equal(arr, tensors[f"{Q_PROJ}.{name}"])


def test_missing_scales(tmp_path: Path) -> None:
    tensors = _q_proj()
    del tensors[f"{Q_PROJ}.scales"]
    ck = load(_write(tmp_path / "ck", tensors, QCFG))
    with pytest.raises(FormatError, match=rf"{Q_PROJ}\.scales: missing"):
        ck.linear(Q_PROJ)


def test_missing_biases(tmp_path: Path) -> None:
    tensors = _q_proj()
    del tensors[f"{Q_PROJ}.biases"]
    ck = load(_write(tmp_path / "ck", tensors, QCFG))
    with pytest.raises(FormatError, match=rf"{Q_PROJ}\.biases: missing"):
        ck.linear(Q_PROJ)


def test_missing_module(tmp_path: Path) -> None:
    ck = load(_write(tmp_path / "ck", _q_proj(), QCFG))
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: missing"):
        ck.linear("model.layers.0.mlp.up_proj")


def test_scales_of_integer_dtype(tmp_path: Path) -> None:
    tensors = _q_proj()
    tensors[f"{Q_PROJ}.scales"] = tensors[f"{Q_PROJ}.scales"].astype(np.int32)
    ck = load(_write(tmp_path / "ck", tensors, QCFG))
    with pytest.raises(FormatError, match=rf"{Q_PROJ}\.scales: dtype int32"):
        ck.linear(Q_PROJ)


def test_scales_and_biases_of_different_dtypes(tmp_path: Path) -> None:
    tensors = _q_proj()
    tensors[f"{Q_PROJ}.scales"] = tensors[f"{Q_PROJ}.scales"].astype(ml_dtypes.bfloat16)
    ck = load(_write(tmp_path / "ck", tensors, QCFG))
    with pytest.raises(FormatError, match=rf"{Q_PROJ}\.biases: dtype float16, expected bfloat16"):
        ck.linear(Q_PROJ)


def test_weight_of_wrong_dtype(tmp_path: Path) -> None:
    tensors = _q_proj()
    tensors[f"{Q_PROJ}.weight"] = tensors[f"{Q_PROJ}.weight"].view(np.int32)
    ck = load(_write(tmp_path / "ck", tensors, QCFG))
    with pytest.raises(FormatError, match=rf"{Q_PROJ}\.weight: int32"):
        ck.linear(Q_PROJ)


def test_group_size_not_dividing_in_features(tmp_path: Path) -> None:
    # Stored with group 32 for in_features 96, but config.json claims group 64.
    tensors = _module_tensors(Q_PROJ, MlxAffine(4, 32, F16), 96, 96)
    ck = load(_write(tmp_path / "ck", tensors, {**QCFG, "group_size": 64}, hidden_size=96))
    with pytest.raises(FormatError, match=rf"{Q_PROJ}\.weight: .*in_features 96 .* group size 64"):
        ck.linear(Q_PROJ)


def test_scales_shape_disagrees_with_group_size(tmp_path: Path) -> None:
    tensors = _q_proj()
    ck = load(_write(tmp_path / "ck", tensors, {**QCFG, "group_size": 64}))
    with pytest.raises(
        FormatError, match=rf"{Q_PROJ}\.scales: shape \[64, 2\], expected \[64, 1\]"
    ):
        ck.linear(Q_PROJ)


def test_config_shape_mismatch(tmp_path: Path) -> None:
    ck = load(_write(tmp_path / "ck", _q_proj(), QCFG, num_attention_heads=4, head_dim=32))
    with pytest.raises(FormatError, match=rf"{Q_PROJ}\.weight: .*config\.json implies \[128, 64\]"):
        ck.linear(Q_PROJ)


def test_unquantized_override(tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((HIDDEN, HIDDEN)).astype(np.float16)
    ck = load(_write(tmp_path / "ck", {f"{Q_PROJ}.weight": w}, {**QCFG, Q_PROJ: False}))
    lin = ck.linear(Q_PROJ)
    assert lin.weight.format.spell() == "dense<dtype=f16>"
    np.testing.assert_array_equal(lin.buffers["weight"], w)


def test_unsupported_module_mode(tmp_path: Path) -> None:
    qcfg = {**QCFG, Q_PROJ: {"bits": 4, "group_size": 32, "mode": "mxfp4"}}
    ck = load(_write(tmp_path / "ck", _q_proj(), qcfg))
    with pytest.raises(FormatError, match=rf"not supported: MLX mode mxfp4 .*{Q_PROJ}"):
        ck.linear(Q_PROJ)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quantization": {"bits": 4, "group_size": 32, "mode": "nf4"}}, "MLX mode nf4"),
        ({"quantization_config": {"quant_method": "hqq", "bits": 4}}, "quantization hqq"),
        (
            {"quantization_config": {"quant_method": "compressed-tensors", "format": "marlin-24"}},
            "compressed-tensors format marlin-24",
        ),
    ],
)
def test_unsupported_quantization(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    path = _write(tmp_path / "ck", _q_proj(), None, **config)
    with pytest.raises(FormatError, match=f"not supported: {message}"):
        load(path)


def test_missing_config_and_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="does not exist"):
        load(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FormatError, match="not a directory"):
        load(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match=r"config\.json: missing"):
        load(tmp_path / "empty")


def test_unsupported_act_dtype(tmp_path: Path) -> None:
    ck = load(_write(tmp_path / "ck", _q_proj(), QCFG, torch_dtype="float8"))
    with pytest.raises(FormatError, match="torch_dtype 'float8' not supported"):
        _ = ck.act_dtype


def test_truncated_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "ck", _q_proj(), QCFG)
    st = path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(FormatError, match=r"model\.safetensors: truncated: tensor '.+' runs past"):
        load(path).linear(Q_PROJ)


def test_sharded_checkpoint(tmp_path: Path) -> None:
    up = "model.layers.0.mlp.up_proj"
    q_tensors, up_tensors = _q_proj(), _module_tensors(up, FMT, INTER, HIDDEN)
    path = _write(tmp_path / "ck", q_tensors, QCFG)
    (path / "model.safetensors").rename(path / "shard-1.safetensors")
    save_file(up_tensors, str(path / "shard-2.safetensors"))
    weight_map = {k: "shard-1.safetensors" for k in q_tensors}
    weight_map |= {k: "shard-2.safetensors" for k in up_tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ck = load(path)
    assert sorted(ck.store.keys()) == sorted(weight_map)
    assert ck.linear(Q_PROJ).weight.format == FMT
    lin = ck.linear(up)
    assert (lin.weight.out_features, lin.weight.in_features) == (INTER, HIDDEN)
    np.testing.assert_array_equal(lin.buffers["scales"], up_tensors[f"{up}.scales"])


def test_every_shard_header_is_validated_when_opened(tmp_path: Path) -> None:
    # A shard no block of this run needs is validated all the same: a checkpoint opens whole.
    path = _write(tmp_path / "ck", _q_proj(), QCFG)
    (path / "model.safetensors").rename(path / "shard-1.safetensors")
    (path / "shard-2.safetensors").write_bytes(b"\xff" * 64)
    weight_map = dict.fromkeys(_q_proj(), "shard-1.safetensors") | {"x": "shard-2.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match=r"shard-2\.safetensors: bad safetensors header length"):
        load(path)
