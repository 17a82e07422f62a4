"""The checkpoint directory as a boundary, the index's rules, and config.json's one table of
fields, on copies of a real fixture."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from qir.formats.base import FormatError
from qir.models import load
from qir.models.config_fields import FIELDS, Field, check_config
from qir.models.safetensors_io import TensorStore

DATA = Path(__file__).resolve().parents[1] / "data"
MLX = DATA / "mlx_affine4_g64_S"  # model.safetensors and an index naming it
INDEX = "model.safetensors.index.json"


def _copy(tmp_path: Path, src: Path = MLX, name: str = "ck") -> Path:
    dst = tmp_path / name
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix in (".json", ".safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


def _weight_map(ck: Path) -> dict[str, Any]:
    return json.loads((ck / INDEX).read_text())["weight_map"]


def _write_index(ck: Path, weight_map: Any) -> None:
    (ck / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---- the boundary ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("../outside.safetensors", "'..' path component"),
        ("sub/../model.safetensors", "'..' path component"),
        ("./model.safetensors", "'.' path component"),
        ("sub//model.safetensors", "an empty path component"),
        ("/etc/hostname", "not a relative file name"),
        ("", "not a relative file name"),
        ("a\\b.safetensors", "not a relative file name"),
        ("model\0.safetensors", "not a relative file name"),
        ("outside-link.safetensors", "resolves to .*, outside the checkpoint directory"),
        ("missing.safetensors", "shard listed in .* is missing"),
        ("sub", "not a regular file"),
        ("fifo.safetensors", "not a regular file"),
    ],
)
def test_shard_names_stay_inside_the_directory(tmp_path: Path, shard: str, message: str) -> None:
    ck = _copy(tmp_path)
    shutil.copy(ck / "model.safetensors", tmp_path / "outside.safetensors")
    (ck / "outside-link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (ck / "sub").mkdir()
    os.mkfifo(ck / "fifo.safetensors")  # opening it would block: it must never be opened
    weight_map = _weight_map(ck)
    weight_map[next(iter(weight_map))] = shard
    _write_index(ck, weight_map)
    with pytest.raises(FormatError, match=message):
        load(ck)


def test_links_inside_the_directory_and_into_the_hub_cache_are_followed(tmp_path: Path) -> None:
    # huggingface_hub's cache: snapshots/<revision>/<file> are symlinks into ../../blobs.
    repo = tmp_path / "models--org--name"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", INDEX):
        shutil.copy(MLX / f, blobs / f"blob-{f}")
        (snap / f).symlink_to(Path("../../blobs") / f"blob-{f}")
    (snap / "inner.safetensors").symlink_to("model.safetensors")
    _write_index(snap, dict.fromkeys(_weight_map(MLX), "inner.safetensors"))
    ck = load(snap)
    assert sorted(ck.store.keys()) == sorted(_weight_map(MLX))
    assert ck.linear("model.layers.0.mlp.up_proj").weight.in_features == 256


def test_config_outside_the_directory_is_refused(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    (ck / "config.json").rename(tmp_path / "config.json")
    (ck / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(FormatError, match=r"config\.json: resolves to .*outside"):
        load(ck)


def test_unreadable_config_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = _copy(tmp_path)
    config = ck / "config.json"
    config.chmod(0)
    if os.access(config, os.R_OK):  # root (CI's user) reads any file: refuse it as the mode would
        read = Path.read_bytes

        def denied(path: Path) -> bytes:
            if path == config:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return read(path)

        monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(FormatError, match=r"config\.json: cannot read \(Permission denied\)"):
        load(ck)


# ---- the index ------------------------------------------------------------------------------


def test_index_names_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    _write_index(ck, {**_weight_map(ck), "model.extra.weight": "model.safetensors"})
    with pytest.raises(FormatError, match=r"model\.safetensors: no tensor 'model\.extra\.weight'"):
        load(ck)


def test_tensor_the_index_does_not_name_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = _copy(tmp_path)
    weight_map = _weight_map(ck)
    dropped = "model.layers.0.mlp.up_proj.biases"
    del weight_map[dropped]
    _write_index(ck, weight_map)
    with caplog.at_level(logging.WARNING, logger="qir"):
        store = TensorStore(ck)
    assert dropped not in store and dropped not in list(store)
    [record] = caplog.records
    assert "1 tensor(s) not in model.safetensors.index.json" in record.getMessage()
    assert repr(dropped) in record.getMessage()


def test_tensor_in_a_shard_the_index_puts_in_another_is_refused(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    shutil.copy(ck / "model.safetensors", ck / "copy.safetensors")
    weight_map = _weight_map(ck)
    moved = "model.layers.0.mlp.up_proj.biases"
    weight_map[moved] = "copy.safetensors"
    _write_index(ck, weight_map)
    with pytest.raises(FormatError, match=r"holds tensor '.+', which .*index\.json puts in"):
        load(ck)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"weight_map": []}', "no weight_map object"),
        ("[]", "no weight_map object"),
        ('{"metadata": {}}', "no weight_map object"),
        ('{"weight_map": {"a": 1}}', r"weight_map\['a'\] is 1, expected a file name"),
        ('{"weight_map": {"a": "x", "a": "y"}}', "key 'a' appears twice"),
        ('{"weight_map": {"a": NaN}}', "NaN is not JSON"),
        ("[" * 5000, "not JSON"),
        ("\ufeff{}", "not JSON"),
    ],
)
def test_index_that_is_not_an_index(tmp_path: Path, text: str, message: str) -> None:
    ck = _copy(tmp_path)
    (ck / INDEX).write_text(text)
    with pytest.raises(FormatError, match=message) as err:
        load(ck)
    assert str(err.value).startswith(str(ck / INDEX))


# ---- config.json ----------------------------------------------------------------------------


def _with_config(
    tmp_path: Path, edit: dict[str, Any] | None = None, text: str | None = None
) -> Path:
    ck = _copy(tmp_path)
    config = json.loads((ck / "config.json").read_text())
    config.update(edit or {})
    (ck / "config.json").write_text(text if text is not None else json.dumps(config))
    return ck


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}", "nested deeper than 127"),
        (b"[" * 100_000, "not JSON"),
        (b'{"hidden_size": 256, "hidden_size": 512}', "key 'hidden_size' appears twice"),
        ('{"hidden_size": 256}'.encode("utf-16"), "not UTF-8"),
        (b'{"hidden_size": Infinity}', "Infinity is not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"", "not JSON"),
    ],
)
def test_config_that_is_not_json(tmp_path: Path, raw: bytes, message: str) -> None:
    ck = _copy(tmp_path)
    (ck / "config.json").write_bytes(raw)
    with pytest.raises(FormatError, match=message) as err:
        load(ck)
    assert str(err.value).startswith(str(ck / "config.json")) and "\n" not in str(err.value)


def _bad_values(f: Field) -> list[Any]:
    """Values `f` must refuse: every other JSON kind, and its range's edges."""
    other = {int: [2.0, "2", True], float: ["1", [1]], str: [1, ["x"]], bool: [1, "true"]}
    values = [*other.get(f.kind, []), *([{}] if f.kind is list else [[]])]
    if f.kind is list and f.items is not None:
        values.append(["1"] if f.items is int else [1])
    if f.at_least is not None:
        values.append(int(f.at_least) - 1)
    return values


TOP_LEVEL = [f for f in FIELDS if "." not in f.key and f.kind is not dict]


@pytest.mark.parametrize("field", TOP_LEVEL, ids=[f.key for f in TOP_LEVEL])
def test_every_top_level_field_is_checked_when_opened(tmp_path: Path, field: Field) -> None:
    for i, value in enumerate(_bad_values(field)):
        ck = _with_config(tmp_path / str(i), {field.key: value})
        with pytest.raises(FormatError, match=rf"config\.json: {field.key} is .*, expected "):
            load(ck)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_hidden_layers": -1}, "num_hidden_layers is -1, expected an integer >= 1"),
        ({"hidden_size": None}, "hidden_size is missing"),
        ({"torch_dtype": ["bf16"]}, "torch_dtype is \\['bf16'\\], expected a string"),
        ({"quantization": {"bits": 4, "group_size": 64, "mode": []}}, r"quantization\.mode is"),
        (
            {
                "quantization": {
                    "bits": 4,
                    "group_size": 64,
                    "model.layers.0.mlp.up_proj": {"bits": "3"},
                }
            },
            r"quantization\.model\.layers\.0\.mlp\.up_proj\.bits is '3'",
        ),
    ],
)
def test_field_errors_name_the_key(tmp_path: Path, edit: dict[str, Any], message: str) -> None:
    ck = _with_config(tmp_path, edit)
    with pytest.raises(FormatError, match=message):
        load(ck)


def test_quantization_fields_of_other_families(tmp_path: Path) -> None:
    awq = _copy(tmp_path, DATA / "awq_gemm_g64_S", "awq")
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = 7
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=r"modules_to_not_convert is 7, expected a list of str"):
        load(awq)
    ct = _copy(tmp_path, DATA / "ct_w4a16_int4_S", "ct")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["ignore"] = "lm_head"  # a string iterates as characters
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=r"quantization_config\.ignore is 'lm_head'"):
        load(ct)
    config["quantization_config"]["ignore"] = ["re:model.(layers"]
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=r"'re:model\.\(layers' is not a regular expression"):
        load(ct).linear("model.layers.0.mlp.up_proj")


def test_table_applies_under_wildcards_and_skips_what_is_absent() -> None:
    fields = (Field("q.*.bits", int, at_least=1), Field("n", int, required=True))
    check_config({"n": 1, "q": {"bits": 4, "m": {"bits": 3}, "k": False}}, "c", fields)
    with pytest.raises(FormatError, match=r"c: q\.m\.bits is 0, expected an integer >= 1"):
        check_config({"n": 1, "q": {"m": {"bits": 0}}}, "c", fields)
    with pytest.raises(FormatError, match="c: n is missing"):
        check_config({"q": {}}, "c", fields)


def test_field_defaults(tmp_path: Path) -> None:
    ck = load(_with_config(tmp_path, {"head_dim": None, "num_key_value_heads": None}))
    assert (ck.head_dim, ck.num_kv_heads) == (64, 4)
    assert ck.field("head_dim") is None and ck.field("hidden_size") == 256
