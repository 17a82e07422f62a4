"""Differential fuzzing of checkpoint reading, from the real fixtures in tests/data.

- safetensors headers: mutated copies of real fixture files (type swaps of each field, offsets
  shifted or swapped, entries duplicated, dropped or renamed, nesting, truncation, byte flips,
  extra bytes) must be opened by qir exactly when `safetensors.safe_open` opens them, and where
  both do, every tensor's bytes must be the official library's;
- config.json and model.safetensors.index.json, against qir's own documented rules
  (docs/checkpoints.md), written out again here independently of the code under test.
Whatever the file, qir may raise its own errors (QirError) and nothing else.

The examples are derandomized with a small budget, so CI runs the same few hundred cases in a
few seconds. `QIR_FUZZ=long` runs a random search of `QIR_FUZZ_EXAMPLES` (default 5000) per
test instead, e.g. `QIR_FUZZ=long .venv/bin/pytest tests/models/test_checkpoint_fuzz.py
--hypothesis-show-statistics`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

from qir.errors import QirError
from qir.models import load
from qir.models.config_fields import FIELDS
from qir.models.multimodal import MULTIMODAL
from qir.models.safetensors_io import SafetensorsFile, TensorStore

DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURES = sorted(p.name for p in DATA.iterdir() if (p / "model.safetensors").is_file())

_PROFILES = {
    "ci": settings(
        max_examples=int(os.environ.get("QIR_FUZZ_EXAMPLES", "150")),
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    ),
    "long": settings(
        max_examples=int(os.environ.get("QIR_FUZZ_EXAMPLES", "5000")),
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    ),
}
FUZZ = _PROFILES[os.environ.get("QIR_FUZZ", "ci")]


# ---- JSON trees that keep repeats and raw number spellings ------------------------------------


class Obj(list[list[Any]]):
    """A JSON object as [key, value] pairs in order (repeats allowed)."""


@dataclass(frozen=True)
class Raw:
    """A token written as it is (-0, 8.0, 1e400, NaN, ...)."""

    text: str


def tree(text: str) -> Any:
    return json.loads(text, object_pairs_hook=lambda pairs: Obj([list(p) for p in pairs]))


def dump(v: Any) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, Obj):
        return "{" + ",".join(json.dumps(k) + ":" + dump(x) for k, x in v) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dump(x) for x in v) + "]"
    return json.dumps(v)


def _walk(v: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys are pair indices, list indices) into a tree."""
    out = [path]
    if isinstance(v, list):
        for i, x in enumerate(v):
            out += _walk(x[1] if isinstance(v, Obj) else x, (*path, i))
    return out


def _get(v: Any, path: tuple[Any, ...]) -> Any:
    for i in path:
        v = v[i][1] if isinstance(v, Obj) else v[i]
    return v


def _set(v: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = _get(v, path[:-1])
    if isinstance(parent, Obj):
        parent[path[-1]][1] = value
    else:
        parent[path[-1]] = value
    return v


# Values that break a type or a range somewhere, spelled every way JSON can.
# fmt: off
ODD = st.sampled_from([
    None, True, False, 0, 1, -1, 2, 8, 2**31, 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
    1.0, 8.0, 0.5, -0.0, "", "8", "F32", "bfloat16", [], [0], [0, 8], [[0, 8]],
    Obj(), Obj([["F32", None]]), Obj([["a", "b"]]),
    Raw("-0"), Raw("8e0"), Raw("1E2"), Raw("8.0"), Raw("1e400"), Raw("-1e400"), Raw("1e-400"),
    Raw("9" * 25), Raw("1" * 320), Raw("NaN"), Raw("Infinity"),
    Raw('"\\ud800"'), Raw('"\\ud83d\\ude00"'),
    Raw("[" * 126 + "]" * 126), Raw("[" * 130 + "]" * 130), Raw("{" * 5 + "}" * 5),
    Raw("[" * 700 + "]" * 700), Raw("[" * 5000 + "]" * 5000),
]).map(copy.deepcopy)  # drawn values get mutated in place
# fmt: on


def _nested(depth: int, inner: Any) -> Any:
    for _ in range(depth):
        inner = [inner]
    return inner


def mutate_tree(data: st.DataObject, t: Any) -> Any:
    """One structural mutation of a JSON tree (a header or a config)."""
    paths = _walk(t)
    kind = data.draw(st.sampled_from(["set", "nest", "dup", "drop", "rename", "extra"]))
    path = data.draw(st.sampled_from(paths))
    target = _get(t, path)
    if kind == "set":
        return _set(t, path, data.draw(ODD))
    if kind == "nest":
        return _set(t, path, _nested(data.draw(st.sampled_from([1, 2, 60, 126, 127])), target))
    objects = [p for p in paths if isinstance(_get(t, p), Obj) and _get(t, p)]
    if not objects:
        return t
    obj = _get(t, data.draw(st.sampled_from(objects)))
    i = data.draw(st.integers(0, len(obj) - 1))
    if kind == "dup":
        obj.insert(
            data.draw(st.integers(0, len(obj))), [obj[i][0], data.draw(ODD | st.just(obj[i][1]))]
        )
    elif kind == "drop":
        del obj[i]
    elif kind == "rename":
        obj[i][0] = data.draw(st.sampled_from([k for k, _ in obj] + ["", "__metadata__", "x"]))
    else:
        obj.insert(i, [data.draw(st.sampled_from(["x", "dtype", "shape"])), data.draw(ODD)])
    return t


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    """One byte-level mutation of a JSON text."""
    kind = data.draw(st.sampled_from(["cut", "flip", "insert", "pad", "bom", "utf16", "garbage"]))
    i = data.draw(st.integers(0, len(raw)))
    if kind == "cut":
        return raw[:i]
    if kind == "flip" and raw:
        i = min(i, len(raw) - 1)
        return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1 :]
    if kind == "insert":
        return raw[:i] + data.draw(st.binary(min_size=1, max_size=4)) + raw[i:]
    if kind == "pad":
        return raw + b" \t\n\r"
    if kind == "bom":
        return b"\xef\xbb\xbf" + raw
    if kind == "utf16":
        return raw.decode("utf-8", "replace").encode("utf-16")
    return raw + b"]"


# ---- safetensors headers against the official library -----------------------------------------

_SOURCES: dict[str, tuple[bytes, bytes]] = {}


def _source(case: str) -> tuple[bytes, bytes]:
    """(header text, data) of a fixture's model.safetensors."""
    if case not in _SOURCES:
        raw = (DATA / case / "model.safetensors").read_bytes()
        n = int.from_bytes(raw[:8], "little")
        _SOURCES[case] = raw[8 : 8 + n], raw[8 + n :]
    return _SOURCES[case]


def _entries(t: Obj) -> list[list[Any]]:
    return [p for p in t if p[0] != "__metadata__" and isinstance(p[1], Obj)]


def _field(entry: Obj, name: str) -> list[Any] | None:
    return next((p for p in entry if p[0] == name), None)


# safetensors dtypes by bits: swapping within a group keeps every size right
_SAME_BITS = [["F16", "BF16", "I16", "U16"], ["F32", "I32", "U32"], ["U8", "I8", "BOOL",
              "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ"], ["F64", "I64", "U64", "C64"]]  # fmt: skip


def _nbytes(entry: Obj) -> int | None:
    offsets = _field(entry, "data_offsets")
    ok = offsets and isinstance(offsets[1], list) and len(offsets[1]) == 2
    return offsets[1][1] - offsets[1][0] if ok and all(type(o) is int for o in offsets[1]) else None


def mutate_header(data: st.DataObject, t: Any, data_len: int, hostile: bool) -> Any:
    """One mutation aimed at a safetensors rule; unless `hostile`, one of those that keep a
    valid file valid (swapped or permuted tensors, other spellings), so that bytes are compared
    often too."""
    entries = _entries(t) if isinstance(t, Obj) else []
    kinds = ["same_size_swap", "permute", "retype", "reshape", "spell", "meta_ok", "dup_same"]
    if hostile:
        kinds += ["tree", "shift", "swap", "reverse", "dtype", "shape", "meta"]
    kind = data.draw(st.sampled_from(kinds))
    if kind == "tree" or not entries:
        return mutate_tree(data, t)
    e = data.draw(st.sampled_from(entries))[1]
    offsets, shape, dtype = _field(e, "data_offsets"), _field(e, "shape"), _field(e, "dtype")
    if kind == "same_size_swap":
        same = [p[1] for p in entries if p[1] is not e and _nbytes(p[1]) == _nbytes(e)]
        other = _field(data.draw(st.sampled_from(same)), "data_offsets") if same else None
        if offsets and other:
            offsets[1], other[1] = other[1], offsets[1]
    elif kind == "permute":
        t[:] = data.draw(st.permutations(list(t)))
    elif kind == "retype" and dtype:
        group = next((g for g in _SAME_BITS if dtype[1] in g), [dtype[1]])
        dtype[1] = data.draw(st.sampled_from(group))
    elif kind == "reshape" and shape and isinstance(shape[1], list):
        count = 1
        for d in shape[1]:
            count *= d if type(d) is int else 1
        shape[1] = data.draw(st.sampled_from([[count], [1, count], [count, 1], [count, 1, 1]]))
    elif kind == "spell" and dtype and shape and offsets:
        spelling = data.draw(st.sampled_from(["list", "enum", "extra", "order"]))
        index = next(i for i, p in enumerate(t) if p[1] is e)
        if spelling == "list":
            t[index][1] = [dtype[1], shape[1], offsets[1]]
        elif spelling == "enum" and isinstance(dtype[1], str):
            dtype[1] = Obj([[dtype[1], None]])
        elif spelling == "extra":
            e.insert(data.draw(st.integers(0, len(e))), ["x", data.draw(ODD)])
        else:
            e.reverse()
    elif kind == "meta_ok":
        value = data.draw(st.sampled_from([None, Obj(), Obj([["format", "pt"], ["k", "\u00e9"]])]))
        metas = [p for p in t if p[0] == "__metadata__"]
        if metas:
            metas[0][1] = value
        else:
            t.insert(data.draw(st.integers(0, len(t))), ["__metadata__", value])
    elif kind == "dup_same":
        index = next(i for i, p in enumerate(t) if p[1] is e)
        t.insert(data.draw(st.integers(0, len(t))), [t[index][0], copy.deepcopy(e)])
    elif kind == "shift" and offsets and isinstance(offsets[1], list) and len(offsets[1]) == 2:
        delta = data.draw(st.sampled_from([-8, -2, -1, 1, 2, 4, 8, data_len, -data_len]))
        for w in data.draw(st.sampled_from([[0], [1], [0, 1]])):
            if isinstance(offsets[1][w], int):
                offsets[1][w] += delta
    elif kind == "swap" and offsets:
        other = _field(data.draw(st.sampled_from(entries))[1], "data_offsets")
        if other:
            offsets[1], other[1] = other[1], offsets[1]
    elif kind == "reverse" and offsets and isinstance(offsets[1], list):
        offsets[1] = offsets[1][::-1]
    elif kind == "dtype" and dtype:
        names = ["F32", "F16", "U8", "I32", "F4", "F6_E2M3", "C64", "f32", "Q4", "F8_E4M3FN"]
        dtype[1] = data.draw(st.sampled_from([*names, Obj([["F16", None]]), Obj([["F16", 0]])]))
    elif kind == "shape" and shape and isinstance(shape[1], list) and shape[1]:
        dims = shape[1]
        op = data.draw(st.sampled_from(["inc", "dec", "zero", "append", "pop"]))
        j = data.draw(st.integers(0, len(dims) - 1))
        if isinstance(dims[j], int) and op in ("inc", "dec", "zero"):
            dims[j] = {"inc": dims[j] + 1, "dec": dims[j] - 1, "zero": 0}[op]
        elif op == "append":
            dims.append(data.draw(st.sampled_from([2, 0])))
        elif op == "pop":
            dims.pop()
    elif kind == "meta":
        t.insert(data.draw(st.integers(0, len(t))), ["__metadata__", data.draw(ODD)])
    return t


def _official(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy"):
            return True
    except SafetensorError:
        return False


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(st.data())
def test_header_accepted_exactly_when_the_official_library_accepts(
    scratch: Path, data: st.DataObject
) -> None:
    case = data.draw(st.sampled_from(FIXTURES))
    text, payload = _source(case)
    t = tree(text.decode())
    hostile = data.draw(st.integers(0, 4)) > 1  # else only mutations that keep the file valid
    for _ in range(data.draw(st.integers(1, 3))):
        t = mutate_header(data, t, len(payload), hostile)
    header = dump(t).encode()
    if hostile and data.draw(st.integers(0, 3)) == 0:
        header = mutate_bytes(data, header)
    n = len(header) + (data.draw(st.sampled_from([0] * 8 + [-1, 1, 8, 2**40])) if hostile else 0)
    tail = data.draw(st.sampled_from(["same"] * 6 + ["cut", "extend"])) if hostile else "same"
    body = {"same": payload, "cut": payload[:-4], "extend": payload + b"\0" * 8}[tail]
    whole = max(0, n).to_bytes(8, "little") + header + body
    path = scratch / "model.safetensors"
    path.write_bytes(whole)

    official = _official(path)
    try:
        f = SafetensorsFile(path)
    except QirError:
        assert not official, f"qir refused a file the official library opens: {header[:300]!r}"
        event("both refuse")
        return
    event("both accept")
    assert official, f"qir opened a file the official library refuses: {header[:300]!r}"
    want = {name: t["data"] for name, t in safetensors.deserialize(whole)}
    assert {name: f.raw(name).tobytes() for name in f} == want
    with safe_open(str(path), framework="numpy") as o:
        assert o.metadata() == f.metadata
    for name in f:
        with contextlib.suppress(QirError):  # F4/F6, or a shape numpy cannot hold: by name
            assert f.get(name).tobytes() == want[name]


# ---- config.json against qir's rules ---------------------------------------------------------

_MODEL_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Copies of the fixtures (config, index, tensors) that the fuzz tests may rewrite."""
    root = tmp_path_factory.mktemp("fixtures")
    out = {}
    for case in FIXTURES:
        dst = root / case
        dst.mkdir()
        for f in (DATA / case).iterdir():
            if f.suffix in (".json", ".safetensors"):
                shutil.copy(f, dst / f.name)
        out[case] = dst
    return out


def _exercise(path: Path) -> None:
    """What `qir inspect` does with a checkpoint: open it, read every linear."""
    ck = load(path)
    for name in ck.store:
        if name.endswith((".qweight", ".weight_packed")) or (
            name.endswith(".weight") and len(ck.store.shape(name)) == 2
        ):
            ck.linear(name.rsplit(".", 1)[0])
    _ = (ck.num_kv_heads, ck.head_dim, ck.act_dtype)


def _depth_and_strings(value: Any) -> tuple[int, list[str]]:
    deepest, strings, stack = 0, [], [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, str):
            strings.append(v)
        elif isinstance(v, dict):
            deepest = max(deepest, d)
            strings += list(v)
            stack += [(x, d + 1) for x in v.values()]
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack += [(x, d + 1) for x in v]
    return deepest, strings


def _strict_parse(raw: bytes) -> Any:
    """config.json or an index as qir's rules read it (docs/checkpoints.md), written
    with plain json: raises ValueError where qir must refuse the text."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("repeated key")
        return dict(pairs)

    def finite(literal: str) -> float:
        if abs(float(literal)) == float("inf"):
            raise ValueError("out of range")
        return float(literal) if any(c in literal for c in ".eE") else int(literal)

    def refuse(_: str) -> None:
        raise ValueError("not JSON")

    if raw.startswith(b"\xef\xbb\xbf"):
        raise ValueError("BOM")
    value = json.loads(
        raw.decode("utf-8"),
        object_pairs_hook=unique,
        parse_constant=refuse,
        parse_int=finite,
        parse_float=finite,
    )
    depth, strings = _depth_and_strings(value)
    if depth > 127:
        raise ValueError("too deep")
    if any(0xD800 <= ord(c) <= 0xDFFF for text in strings for c in text):
        raise ValueError("lone surrogate")
    return value


@FUZZ
@given(st.data())
def test_config_only_qir_errors_and_checked_fields(
    checkpoints: dict[str, Path], data: st.DataObject
) -> None:
    path = checkpoints[data.draw(st.sampled_from(FIXTURES))]
    original = path.parent / f"{path.name}.config.json"
    if not original.exists():
        shutil.copy(path / "config.json", original)
    t = tree(original.read_text())
    keys = sorted({f.key.split(".")[0] for f in FIELDS})
    # A third of the examples only touch what qir ignores or may leave out, so that checkpoints
    # open often too.
    benign = data.draw(st.integers(0, 2)) == 0
    for _ in range(data.draw(st.integers(1, 2))):
        if benign:
            optional = ["head_dim", "num_key_value_heads", "torch_dtype", "rope_theta", "x"]
            key = data.draw(st.sampled_from(optional))
            value = None if key in keys else data.draw(ODD)
            t = Obj([p for p in t if p[0] != key] + [[key, value]])
        elif isinstance(t, Obj) and data.draw(st.booleans()):  # aim at a field qir reads
            key = data.draw(st.sampled_from(keys))
            where = [p for p in t if p[0] == key]
            if where:
                where[0][1] = data.draw(ODD)
            else:
                t.append([key, data.draw(ODD)])
        else:
            t = mutate_tree(data, t)
    raw = dump(t).encode()
    if not benign and data.draw(st.integers(0, 3)) == 0:
        raw = mutate_bytes(data, raw)
    (path / "config.json").write_bytes(raw)

    try:
        expected = _strict_parse(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        expected = None
    if isinstance(expected, dict) and expected.get("model_type") in MULTIMODAL:
        # a multimodal checkpoint's model fields are its text_config's (qir.models.multimodal)
        expected = expected.get("text_config")
    model_ok = isinstance(expected, dict) and all(
        type(expected.get(k)) is int and expected[k] >= 1 for k in _MODEL_INTS
    )
    try:
        ck = load(path)
    except QirError as e:
        assert "\n" not in str(e)
        # a refusal of a well-formed model names the config file or the quantization key
        assert not model_ok or any(w in str(e) for w in ("config.json", "quantization"))
        event("refused when opened")
        return
    event("opened")
    # Opened: the text was JSON by qir's rules and the model fields are ints >= 1 as written
    # (no 256.0, "256" or true taken for 256), whichever command opens it.
    assert model_ok, f"qir opened a config.json it must refuse: {raw[:300]!r}"
    assert isinstance(expected, dict)
    assert (ck.hidden_size, ck.num_layers) == (
        expected["hidden_size"],
        expected["num_hidden_layers"],
    )
    try:
        _exercise(path)
    except QirError as e:
        assert "\n" not in str(e)


# ---- the index against qir's rules -----------------------------------------------------------


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mlx_affine4_g64_S split in two shards, plus a symlink inside and one leading outside."""
    src = DATA / "mlx_affine4_g64_S"
    root = tmp_path_factory.mktemp("sharded")
    dst = root / "ckpt"
    dst.mkdir()
    shutil.copy(src / "config.json", dst)
    tensors = {n: (t["dtype"], t["shape"], t["data"]) for n, t in safetensors.deserialize(
        (src / "model.safetensors").read_bytes()
    )}  # fmt: skip
    layers = {n: v for n, v in tensors.items() if n.startswith("model.layers.")}
    _write_safetensors(dst / SHARDS[0], layers)
    _write_safetensors(dst / SHARDS[1], {n: v for n, v in tensors.items() if n not in layers})
    (root / "outside.safetensors").write_bytes((dst / SHARDS[1]).read_bytes())
    (dst / "inside-link.safetensors").symlink_to(SHARDS[1])
    (dst / "outside-link.safetensors").symlink_to(root / "outside.safetensors")
    (dst / "sub").mkdir()
    shutil.copy(dst / SHARDS[1], dst / "sub" / "copy.safetensors")
    weight_map = {n: SHARDS[0] if n in layers else SHARDS[1] for n in tensors}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


SHARD_NAMES = [
    *SHARDS,
    "inside-link.safetensors",
    "sub/copy.safetensors",
    "outside-link.safetensors",
    "../outside.safetensors",
    "sub/../" + SHARDS[1],
    "./" + SHARDS[1],
    "sub//copy.safetensors",
    "/etc/hostname",
    "",
    ".",
    "sub",
    "missing.safetensors",
    "config.json",
    "model.safetensors\0",
    "sub\\copy.safetensors",
]


def _expected_index(ckpt: Path, raw: bytes, readable: dict[str, set[str]]) -> bool:
    """qir's index rules, written again: see docs/checkpoints.md."""
    try:
        doc = _strict_parse(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        return False
    if not all(isinstance(shard, str) for shard in weight_map.values()):
        return False
    root = os.path.realpath(ckpt)
    for shard in set(weight_map.values()):
        if shard not in readable:
            return False
        parts = shard.split("/")
        real = os.path.realpath(os.path.join(ckpt, shard))
        if shard.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in shard:
            return False
        if not real.startswith(root + os.sep) or not os.path.isfile(real):
            return False
    for name, shard in weight_map.items():
        if name not in readable[shard]:
            return False
    opened = set(weight_map.values())
    return all(weight_map.get(n, s) == s for s in opened for n in readable[s])


@FUZZ
@given(st.data())
def test_index_judged_by_the_documented_rules(sharded: Path, data: st.DataObject) -> None:
    index = sharded / "model.safetensors.index.json"
    original = json.loads(index.read_text())["weight_map"]
    readable = {s: set(SafetensorsFile(sharded / s).keys()) for s in SHARD_NAMES[:4]}
    wm = Obj([[k, v] for k, v in original.items()])
    hostile = data.draw(st.integers(0, 2)) > 0  # else only changes that keep the index valid
    for _ in range(data.draw(st.integers(1, 3))):
        kinds = ["drop", "relink"] + (["shard", "add", "move", "type"] if hostile else [])
        kind = data.draw(st.sampled_from(kinds))
        i = data.draw(st.integers(0, len(wm) - 1)) if wm else 0
        if kind == "relink":  # the second shard by another name: a link to it, or a copy
            other = data.draw(st.sampled_from(["inside-link.safetensors", "sub/copy.safetensors"]))
            for pair in wm:
                pair[1] = other if pair[1] == SHARDS[1] else pair[1]
        elif kind == "shard" and wm:
            wm[i][1] = data.draw(st.sampled_from(SHARD_NAMES))
        elif kind == "drop" and wm:
            del wm[i]
        elif kind == "add":
            wm.append([data.draw(st.sampled_from(["x.weight", *original])), SHARDS[0]])
        elif kind == "move" and wm:
            wm[i][1] = SHARDS[1] if wm[i][1] == SHARDS[0] else SHARDS[0]
        elif kind == "type" and wm:
            wm[i][1] = data.draw(ODD)
    t = Obj([["metadata", Obj([["total_size", 1]])], ["weight_map", wm]])
    if hostile and data.draw(st.integers(0, 3)) == 0:
        t = mutate_tree(data, t)
    raw = dump(t).encode()
    if hostile and data.draw(st.integers(0, 4)) == 0:
        raw = mutate_bytes(data, raw)
    index.write_bytes(raw)
    try:
        store = TensorStore(sharded)
        accepted = True
    except QirError as e:
        accepted = False
        assert "\n" not in str(e)
    finally:
        index.write_text(json.dumps({"weight_map": original}))
    assert accepted == _expected_index(sharded, raw, readable), raw[:300]
    event("accepted" if accepted else "refused")
    if accepted:
        full = DATA / "mlx_affine4_g64_S" / "model.safetensors"
        want = {n: t["data"] for n, t in safetensors.deserialize(full.read_bytes())}
        for name in store:
            assert store.raw(name).tobytes() == want[name]
