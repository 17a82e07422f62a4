"""The safetensors reader: every dtype, and one crafted file per rule of the format, each judged
the same way by qir and by the official library (whose verdict is asserted too, so a safetensors
release that changes its rules fails here first)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from qir.formats.base import FormatError
from qir.models.safetensors_io import SafetensorsFile, TensorStore
from qir.models.strict_json import serde_number

ALL_DTYPES = [
    np.float64,
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint64,
    np.uint32,
    np.uint16,
    np.uint8,
    np.bool_,
]


def test_reader_reads_every_dtype_without_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors = {
        f"t{i}": (rng.standard_normal((3, 5)) * 4).astype(dt) for i, dt in enumerate(ALL_DTYPES)
    }
    tensors["scalar"] = np.array(2.5, np.float32)
    tensors["empty"] = np.zeros((0, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert sorted(f.keys()) == sorted(tensors) and f.metadata == {"format": "np"}
    for name, want in tensors.items():
        got = f.get(name)
        assert f.shape(name) == want.shape and f.dtype(name) == want.dtype
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes() == f.raw(name).tobytes()
    t0 = f.get("t0")
    assert not t0.flags.writeable and not t0.flags.owndata
    store = TensorStore(tmp_path)
    assert "t3" in store and store.dtype("t3") == ml_dtypes.bfloat16


def _file(path: Path, header: Any, data: bytes = b"", n: int | None = None) -> Path:
    """A safetensors file with `header` (JSON text, bytes, or an object to dump) and `data`;
    `n` overrides the header length field."""
    if isinstance(header, bytes):
        raw = header
    else:
        raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes((len(raw) if n is None else n).to_bytes(8, "little") + raw + data)
    return path


def _e(dtype: Any = "F32", shape: Any = (2,), offsets: Any = (0, 8), **extra: Any) -> Any:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


def _j(text: str) -> str:
    """A header given as JSON text, for what json.dumps cannot write (duplicates, -0, NaN)."""
    return text.replace("'", '"')


E = '"dtype":"F32","shape":[2],"data_offsets":[0,8]'  # a well-formed entry's fields, as text
EIGHT = bytes(range(8))


def _case(
    rule: str, header: Any, data: bytes = EIGHT, refused: str = "", n: int | None = None
) -> Any:
    """One rule: a header (None: the file is `data` alone), the data after it, and qir's message
    for a refusal (a regex; empty: the file is accepted); `n` overrides the header length."""
    return pytest.param(header, data, n, refused, id=rule)


EXTRA = "{'a':{" + E + ",'x':%s}}"  # a well-formed entry with an ignored field x

CASES = [
    _case("well-formed", {"a": _e()}),
    _case("empty file", None, b"", "0 bytes, too short"),
    _case("7 bytes", None, b"\0" * 7, "7 bytes, too short"),
    _case("header length past the file", "{}", b"", "header length 1000", n=1000),
    _case("header length over 100 MB", "{}", b"", "limit is 100000000", n=100_000_001),
    _case("empty header text", "", b"", "not JSON"),
    _case("no tensors", "{}", b""),
    _case("metadata only", {"__metadata__": {"k": "v"}}, b""),
    _case("not UTF-8", b'{"a\xff":{' + E.encode() + b"}}", refused="not UTF-8"),
    _case("byte-order mark", "\ufeff" + json.dumps({"a": _e()}), refused="not JSON"),
    _case("NaN", _j(EXTRA % "NaN"), refused="NaN is not JSON"),
    _case("number out of f64 range", _j(EXTRA % "1e400"), refused="out of range"),
    _case("lone surrogate", _j("{'\\ud800':{" + E + "}}"), refused="lone UTF-16 surrogate"),
    _case("nesting 127 deep", _j(EXTRA % ("[" * 125 + "]" * 125))),
    _case("nesting 128 deep", _j(EXTRA % ("[" * 126 + "]" * 126)), refused="deeper than 127"),
    _case("nesting 100000 deep", "[" * 100_000, b"", "not JSON"),
    _case("trailing text", json.dumps({"a": _e()}) + "x", refused="not JSON"),
    _case("trailing spaces", json.dumps({"a": _e()}) + "  "),
    _case("header not an object", "[]", b"", "not an object"),
    _case("entry not an object", {"a": 5}, b"", "tensor 'a': header entry 5"),
    _case("entry as [dtype, shape, offsets]", {"a": ["F32", [2], [0, 8]]}),
    _case("entry list of 4", {"a": ["F32", [2], [0, 8], 1]}, refused="tensor 'a': header entry"),
    _case("missing dtype", {"a": {"shape": [2], "data_offsets": [0, 8]}}, refused="'a': no dtype"),
    _case("field twice", _j("{'a':{" + E + ",'dtype':'F32'}}"), refused="dtype appears twice"),
    _case("unknown extra field (ignored)", {"a": _e(extra=[1])}),
    _case("unknown dtype", {"a": _e("Q4")}, refused="tensor 'a': dtype \"Q4\""),
    _case("dtype as {name: null}", {"a": _e({"F32": None})}),
    _case("F4, whole bytes", {"a": _e("F4", [4], [0, 2])}, b"\0\0"),
    _case("F4, half a byte", {"a": _e("F4", [3], [0, 2])}, b"\0\0", "'a': F4 \\[3\\] is 12 bits"),
    _case("C64, F8_E4M3FNUZ", {"a": _e("C64", [1]), "b": _e("F8_E4M3FNUZ", [1], [8, 9])}, bytes(9)),
    _case("shape of floats", {"a": _e(shape=[2.0])}, refused="tensor 'a': shape \\[2.0\\]"),
    _case("shape of booleans", {"a": _e(shape=[True, 2])}, refused="tensor 'a': shape"),
    _case("shape -0", _j("{'a':{'dtype':'F32','shape':[-0],'data_offsets':[0,0]}}"), b"", "-0.0"),
    _case("shape dim 2**64", {"a": _e(shape=[0, 2**64], offsets=[0, 0])}, b"", "'a': shape"),
    _case("shape dim 2**64-1, empty", {"a": _e(shape=[0, 2**64 - 1], offsets=[0, 0])}, b""),
    _case(
        "shape product overflows before a 0",
        {"a": _e(shape=[2**63, 4, 0], offsets=[0, 0])},
        b"",
        "tensor 'a': shape .* overflows",
    ),
    _case("offsets as floats", {"a": _e(offsets=[0.0, 8.0])}, refused="'a': data_offsets"),
    _case(
        "offsets 8e0",
        _j("{'a':{'dtype':'F32','shape':[2],'data_offsets':[0,8e0]}}"),
        refused="tensor 'a': data_offsets",
    ),
    _case("three offsets", {"a": _e(offsets=[0, 8, 8])}, refused="tensor 'a': data_offsets"),
    _case("offsets end before begin", {"a": _e(offsets=[8, 0])}, refused="ends before it begins"),
    _case("size disagrees with shape", {"a": _e(shape=[3])}, refused="'a' has 8 bytes, but F32"),
    _case("first tensor not at 0", {"a": _e(offsets=[4, 12])}, bytes(12), "hole .* at the start"),
    _case("overlap", {"a": _e(), "b": _e(offsets=[4, 12])}, bytes(12), "'b' .* overlaps .*'a'"),
    _case("hole", {"a": _e(), "b": _e(offsets=[12, 20])}, bytes(20), "'b' .* hole .* after .*'a'"),
    _case("bytes after the last tensor", {"a": _e()}, bytes(9), "1 byte.* after the last tensor"),
    _case("truncated", {"a": _e(), "b": _e(offsets=[8, 16])}, bytes(12), "'b' runs past the end"),
    _case(
        "empty tensors sharing an offset",
        {"a": _e(shape=[0], offsets=[8, 8]), "b": _e(), "c": _e(shape=[0, 3], offsets=[8, 8])},
    ),
    _case("unaligned offsets", {"a": _e("U8", [1], [0, 1]), "b": _e(offsets=[1, 9])}, bytes(9)),
    _case(
        "name twice: the last counts",
        _j("{'a':{'dtype':'F32','shape':[2],'data_offsets':[8,16]},'a':{" + E + "}}"),
    ),
    _case(
        "name twice, first malformed",
        _j("{'a':{'dtype':'Q4','shape':[2],'data_offsets':[0,8]},'a':{" + E + "}}"),
        refused="tensor 'a': dtype",
    ),
    _case("__metadata__ null", {"__metadata__": None, "a": _e()}),
    _case("__metadata__ of non-strings", {"__metadata__": {"k": 1}, "a": _e()}, refused="__metad"),
    _case(
        "__metadata__ twice",
        _j("{'__metadata__':{},'__metadata__':{},'a':{" + E + "}}"),
        refused="__metadata__ appears twice",
    ),
]


def _official(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy"):
            return True
    except SafetensorError:
        return False


@pytest.mark.parametrize(("header", "data", "n", "refused"), CASES)
def test_rule_judged_like_the_official_library(
    tmp_path: Path, header: Any, data: bytes, n: int | None, refused: str
) -> None:
    path = tmp_path / "m.safetensors"
    if header is None:  # the whole file is `data`
        path.write_bytes(data)
    else:
        _file(path, header, data, n)
    before = path.read_bytes()
    assert _official(path) == (not refused), "the official library's verdict changed"
    if not refused:
        f = SafetensorsFile(path)
        blobs = {name: t["data"] for name, t in safetensors.deserialize(before)}
        assert {name: f.raw(name).tobytes() for name in f} == blobs
    else:
        with pytest.raises(FormatError, match=refused) as err:
            SafetensorsFile(path)
        assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)
    assert path.read_bytes() == before


def test_unaligned_tensor_is_an_aligned_read_only_copy(tmp_path: Path) -> None:
    vals = np.arange(2, dtype=np.float32)
    header = {"a": _e("U8", [1], [0, 1]), "b": _e(offsets=[1, 9])}
    f = SafetensorsFile(_file(tmp_path / "u.safetensors", header, b"\7" + vals.tobytes()))
    b = f.get("b")
    assert b.flags.aligned and not b.flags.writeable
    np.testing.assert_array_equal(b, vals)


def test_sub_byte_and_huge_shapes_are_refused_by_name_when_read(tmp_path: Path) -> None:
    header = {"f4": _e("F4", [4], [0, 2]), "big": _e("U8", [0, 2**64 - 1], [2, 2])}
    f = SafetensorsFile(_file(tmp_path / "s.safetensors", header, b"\x12\x34"))
    assert f.raw("f4").tobytes() == b"\x12\x34"
    with pytest.raises(FormatError, match="tensor 'f4' is F4"):
        f.get("f4")
    with pytest.raises(FormatError, match="tensor 'big': numpy cannot hold shape"):
        f.get("big")


# Number literals in an ignored field, where only their range matters: serde_json's own
# parser (no float_roundtrip) decides, not correct rounding: 1.7976931348623158e308 rounds to
# the largest double but serde_json finds it out of range.
NUMBERS = [
    "1.7976931348623157e308",
    "1.7976931348623158e308",
    "1e400",
    "1e-400",
    "-1e400",
    "9" * 30,
    "9" * 309,
    str(2**1024 - 2**970),
    "1e2147483648",
    "0e99999999999",
    "18446744073709551616",
    "-9223372036854775809",
    "-0",
    "-0.0e-5",
]


@pytest.mark.parametrize("literal", NUMBERS)
def test_number_ranges_as_the_official_parser(tmp_path: Path, literal: str) -> None:
    path = _file(tmp_path / "n.safetensors", "{'a':{%s,'x':%s}}".replace("'", '"') % (E, literal))
    path.write_bytes(path.read_bytes() + EIGHT)
    try:
        serde_number(literal)
        in_range = True
    except ValueError:
        in_range = False
    assert _official(path) is in_range
    assert _accepts(path) is in_range


def _accepts(path: Path) -> bool:
    try:
        SafetensorsFile(path)
        return True
    except FormatError:
        return False


def test_reader_missing_tensor(tmp_path: Path) -> None:
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match=r"model\.safetensors: no tensor 'b'"):
        SafetensorsFile(tmp_path / "model.safetensors").get("b")
    with pytest.raises(FormatError, match="no tensor 'b' in the checkpoint"):
        TensorStore(tmp_path).get("b")


def test_open_benchmark_runs_at_a_tiny_scale(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_open.py"
    spec = importlib.util.spec_from_file_location("benchmarks.checkpoint_open", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--layers", "2", "--shards", "2", "--repeat", "1"])
    assert len(rows) == 2 and all(q > 0 and o > 0 for q, o in rows.values())
    assert "49 tensors, 2 layers" in capsys.readouterr().out
