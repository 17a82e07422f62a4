"""Lazy, memory-mapped GGUF reading (llama.cpp's model file), as strict as ggml's own loader.

A GGUF file is, little-endian: a header (magic "GGUF", u32 version, u64 tensor count, u64 key
count); the key/value pairs (key: u64 length + UTF-8 bytes; u32 value type; the value); the
tensor infos (name; u32 n_dims; u64 ne[n_dims], ne[0] the contiguous axis; u32 ggml type; u64
offset into the data section); zero padding to the alignment; the data section.

Everything but the tensor bytes is validated when a file is opened, by the rules of ggml's
gguf.cpp (`gguf_init_from_file_impl`), so that qir opens a file exactly when llama.cpp's loader
does (tests/models/test_gguf_fuzz.py checks this differentially against gguf-py's reader plus
these rules):
- magic "GGUF"; version 2 or 3 (a version whose low 16 bits are 0 is a big-endian file, which
  ggml refuses as qir does); the counts fit in the file (a key/value pair takes at least 13
  bytes, a tensor info 28), so a huge count is refused before anything is allocated;
- keys are non-empty UTF-8 and unique; a value type is one of the 13 (u8, i8, u16, i16, u32,
  i32, f32, bool, string, array, u64, i64, f64); an array's element type is one of the others
  (ggml reads no nested arrays) and its items fit in the file; strings are UTF-8;
- general.alignment, where present, is a u32 power of two (default 32);
- a tensor name is UTF-8, shorter than 64 bytes (GGML_MAX_NAME) and unique; n_dims <= 4; each
  ne in [0, 2**63) and their product below 2**63; the type a ggml type
  (qir.formats.ggml_types.TYPES) whose block divides ne[0];
- the tensors tile the data section in file order: each offset is a multiple of the alignment
  and equals the end of the one before it, padded to the alignment (the first is 0): no hole,
  no overlap; every tensor's bytes end inside the file.
Each refusal is a FormatError naming the file and the key, tensor or field. The data section
starts at the end of the tensor infos padded to the alignment.

Split models (llama.cpp's gguf-split: `<prefix>-00001-of-00003.gguf`, ...) are complete GGUF
files each, holding `split.no` (u16, 0-based), `split.count` (u16) and, in the first,
`split.tensors.count` (i32); `GGUFModel` opens the first shard with its siblings and reads the
metadata of the first.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from qir.errors import FormatError
from qir.formats.ggml_types import TYPES, GgmlType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name takes fewer bytes
MAX_DIMS = 4
_I64_MAX = 2**63 - 1

# Value types: id -> (name, struct code, size) of the scalar ones; 8 string, 9 array.
SCALARS: dict[int, tuple[str, str, int]] = {
    0: ("u8", "B", 1),
    1: ("i8", "b", 1),
    2: ("u16", "H", 2),
    3: ("i16", "h", 2),
    4: ("u32", "I", 4),
    5: ("i32", "i", 4),
    6: ("f32", "f", 4),
    7: ("bool", "?", 1),
    10: ("u64", "Q", 8),
    11: ("i64", "q", 8),
    12: ("f64", "d", 8),
}
STRING, ARRAY = 8, 9
TYPE_NAMES = {**{t: s[0] for t, s in SCALARS.items()}, STRING: "string", ARRAY: "array"}
# A key/value pair's least bytes (key length, a 1-byte key, the type, a 1-byte value) and a
# tensor info's (name length, a 0-byte name... plus n_dims, type and offset).
_MIN_KV = 8 + 1 + 4 + 1
_MIN_TENSOR = 8 + 4 + 4 + 8 + 4
# numpy dtypes of the ggml types that are plain elements; the others are blocks of bytes.
ELEMENT_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}
SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class TensorInfo(NamedTuple):
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is contiguous (a linear's in_features)
    type: GgmlType
    offset: int  # into the data section
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The array shape: reversed ne; for a block type the last dim is bytes per row."""
        shape = tuple(reversed(self.ne)) or (1,)
        if self.type.name in ELEMENT_DTYPES:
            return shape
        return (*shape[:-1], self.ne[0] // self.type.block * self.type.block_bytes)


class _Cursor:
    """Reads the header of `buf` from `pos`, refusing any read past its end."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n > len(self.buf) - self.pos:
            raise FormatError(
                f"{self.path}: truncated: {what} at byte {self.pos} needs {n} bytes, "
                f"the file has {len(self.buf) - self.pos} left"
            )

    def scalar(self, code: str, size: int, what: str) -> Any:
        self.need(size, what)
        (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return int(self.scalar("I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar("Q", 8, what))

    def text(self, what: str) -> str:
        n = self.u64(f"{what}'s length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(
                f"{self.path}: {what} is not UTF-8 ({e.reason} at byte {e.start})"
            ) from None

    def count(self, what: str, least: int) -> int:
        """A u64 count of items of at least `least` bytes each, refused where they cannot fit."""
        n = self.u64(what)
        left = len(self.buf) - self.pos
        if n > left // max(least, 1):
            raise FormatError(
                f"{self.path}: {what} {n} cannot fit in the {left} bytes left of the file"
            )
        return n


def _value(c: _Cursor, vtype: int, where: str) -> tuple[Any, tuple[int, ...]]:
    """A value of type `vtype` and its types (the array's element type after ARRAY)."""
    if vtype in SCALARS:
        _, code, size = SCALARS[vtype]
        v = c.scalar(code, size, where)
        if vtype == 6:
            v = float(np.float32(v))
        return v, (vtype,)
    if vtype == STRING:
        return c.text(where), (vtype,)
    if vtype != ARRAY:
        raise FormatError(f"{c.path}: {where}: unknown value type {vtype}")
    etype = c.u32(f"{where}'s element type")
    if etype == ARRAY or (etype != STRING and etype not in SCALARS):
        what = "a nested array" if etype == ARRAY else f"unknown element type {etype}"
        raise FormatError(f"{c.path}: {where}: {what} (ggml reads arrays of the scalar types)")
    if etype == STRING:
        return _strings(c, c.count(f"{where}'s count", 8), where), (ARRAY, etype)
    _, code, size = SCALARS[etype]
    n = c.count(f"{where}'s count", size)
    raw = np.frombuffer(c.buf, np.uint8, n * size, c.pos) if n else np.zeros(0, np.uint8)
    c.pos += n * size
    a = raw.astype(bool) if code == "?" else raw.view("<" + code).copy()
    a.flags.writeable = False
    return a, (ARRAY, etype)


_U64 = struct.Struct("<Q")


def _strings(c: _Cursor, n: int, where: str) -> list[str]:
    """An array of `n` strings: their bounds found in one pass, then decoded from one copy
    (a tokenizer's 150k tokens and merges take tens of milliseconds, not a second)."""
    buf, pos, size, unpack = c.buf, c.pos, len(c.buf), _U64.unpack_from
    bounds = []
    for i in range(n):
        if pos + 8 > size or (k := unpack(buf, pos)[0]) > size - pos - 8:
            c.pos = pos
            c.text(f"{where}[{i}]")  # raises, saying what is truncated
        bounds.append((pos + 8 - c.pos, pos + 8 + k - c.pos))
        pos += 8 + k
    blob = bytes(buf[c.pos : pos])
    try:
        out = [blob[a:b].decode("utf-8") for a, b in bounds]
    except UnicodeDecodeError:
        for i, (a, b) in enumerate(bounds):
            try:
                blob[a:b].decode("utf-8")
            except UnicodeDecodeError as e:
                raise FormatError(
                    f"{c.path}: {where}[{i}] is not UTF-8 ({e.reason} at byte {e.start})"
                ) from None
        raise
    c.pos = pos
    return out


class GGUFFile:
    """One .gguf file, everything but its tensor bytes validated on opening; tensors are
    read-only views of a memory map, made on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = os.stat(self.path).st_size
            if size < 24:
                raise FormatError(f"{self.path}: {size} bytes, too short for a GGUF header")
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise FormatError(f"{self.path}: cannot read ({e.strerror})") from None
        except ValueError as e:
            raise FormatError(f"{self.path}: cannot map ({e})") from None
        c = _Cursor(memoryview(self._map), self.path)  # type: ignore[arg-type]
        magic = bytes(c.buf[:4])
        if magic != MAGIC:
            raise FormatError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        c.pos = 4
        self.version = c.u32("the version")
        if self.version & 0xFFFF == 0 and self.version:
            raise FormatError(
                f"{self.path}: version {self.version:#x}: a big-endian GGUF, which ggml refuses"
            )
        if self.version not in VERSIONS:
            raise FormatError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors = c.u64("the tensor count")
        n_kv = c.count("the key/value count", _MIN_KV)
        self.metadata: dict[str, Any] = {}
        self.types: dict[str, tuple[int, ...]] = {}  # key -> its value type(s)
        for i in range(n_kv):
            key = c.text(f"key {i}")
            if not key:
                raise FormatError(f"{self.path}: key {i} is empty")
            if key in self.metadata:
                raise FormatError(f"{self.path}: key {key!r} appears twice")
            vtype = c.u32(f"{key}'s value type")
            self.metadata[key], self.types[key] = _value(c, vtype, key)
        self.alignment = self._alignment()
        left = len(c.buf) - c.pos
        if n_tensors > left // _MIN_TENSOR:
            raise FormatError(
                f"{self.path}: the tensor count {n_tensors} cannot fit in the {left} bytes "
                "left of the file"
            )
        infos = [self._tensor_info(c, i) for i in range(n_tensors)]
        self.data_start = -(-c.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        self._check_tiling(infos, size)

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        value, types = self.metadata["general.alignment"], self.types["general.alignment"]
        if types != (4,):
            raise FormatError(
                f"{self.path}: general.alignment is a {_type_name(types)}, expected a u32"
            )
        if value == 0 or value & (value - 1):
            raise FormatError(f"{self.path}: general.alignment {value} is not a power of two")
        return int(value)

    def _tensor_info(self, c: _Cursor, i: int) -> TensorInfo:
        name = c.text(f"tensor {i}'s name")
        where = f"{self.path}: tensor {name!r}"
        if len(name.encode()) >= MAX_NAME:
            raise FormatError(f"{where}: a name of {len(name.encode())} bytes (ggml's limit: 63)")
        n_dims = c.u32(f"tensor {name!r}'s n_dims")
        if n_dims > MAX_DIMS:
            raise FormatError(f"{where}: {n_dims} dimensions (ggml's limit: {MAX_DIMS})")
        ne = tuple(c.u64(f"tensor {name!r}'s ne[{d}]") for d in range(n_dims))
        count = 1
        for d in ne:
            if d > _I64_MAX:
                raise FormatError(f"{where}: ne {list(ne)} has a dimension >= 2**63")
            count *= d
        if count > _I64_MAX:
            raise FormatError(f"{where}: ne {list(ne)} has 2**63 or more elements")
        type_id = c.u32(f"tensor {name!r}'s type")
        t = TYPES.get(type_id)
        if t is None:
            raise FormatError(f"{where}: unknown ggml type id {type_id}")
        if ne and ne[0] % t.block:
            raise FormatError(
                f"{where}: {t.name} rows of {ne[0]} elements are not whole blocks of {t.block}"
            )
        offset = c.u64(f"tensor {name!r}'s offset")
        return TensorInfo(name, ne, t, offset, count // t.block * t.block_bytes)

    def _check_tiling(self, infos: list[TensorInfo], size: int) -> None:
        end, last = 0, None
        for t in infos:
            where = f"{self.path}: tensor {t.name!r} at offset {t.offset}"
            if t.name in self.tensors:
                raise FormatError(f"{self.path}: tensor {t.name!r} appears twice")
            if t.offset % self.alignment:
                raise FormatError(f"{where}: not a multiple of the alignment {self.alignment}")
            if t.offset < end:
                raise FormatError(f"{where}: overlaps tensor {last!r}, which ends at {end}")
            if t.offset > end:
                after = f"after tensor {last!r}" if last is not None else "at the start"
                raise FormatError(f"{where}: leaves a hole of {t.offset - end} bytes {after}")
            stop = self.data_start + t.offset + t.nbytes
            if stop > size:
                raise FormatError(
                    f"{self.path}: truncated: tensor {t.name!r} ({t.type.name} {list(t.ne)}) "
                    f"ends at byte {stop}, the file has {size}"
                )
            self.tensors[t.name] = t
            end = -(-(t.offset + t.nbytes) // self.alignment) * self.alignment
            last = t.name

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, a read-only uint8 view of the file."""
        t = self.info(name)
        start = self.data_start + t.offset
        return np.asarray(self._map[start : start + t.nbytes])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view (TensorInfo.shape): elements for the plain types
        (F32, F16, BF16, ...), uint8 rows of blocks for the others."""
        t = self.info(name)
        dtype = ELEMENT_DTYPES.get(t.type.name, np.dtype(np.uint8))
        view = self.raw(name).view(dtype).reshape(t.shape)
        if not view.flags.aligned:  # alignment >= 8 keeps every element aligned; not a smaller one
            view = view.copy()
            view.flags.writeable = False
        return view


def _type_name(types: tuple[int, ...]) -> str:
    if types[0] == ARRAY:
        return f"array of {TYPE_NAMES[types[1]]}"
    return TYPE_NAMES[types[0]]


def is_gguf(path: Path) -> bool:
    """Whether `path` names GGUF input: a .gguf file, or a directory holding one and no
    config.json."""
    try:
        if path.is_file():
            return path.suffix == ".gguf"
        return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))
    except OSError:
        return False


def resolve(path: Path) -> Path:
    """The .gguf file (the first shard of a split model) that `path` names: itself, or the one
    model in a directory."""
    if path.is_dir():
        files = sorted(p for p in path.glob("*.gguf") if p.is_file())
        firsts = [p for p in files if (m := SHARD.match(p.name)) is None or int(m["no"]) == 1]
        if len(firsts) != 1:
            names = ", ".join(p.name for p in firsts) or "none"
            raise FormatError(f"{path}: holds {len(firsts)} GGUF models ({names}); name one file")
        return firsts[0]
    m = SHARD.match(path.name)
    if m is not None and int(m["no"]) != 1:
        first = f"{m['prefix']}-00001-of-{m['count']}.gguf"
        raise FormatError(
            f"{path}: shard {int(m['no'])} of {int(m['count'])} of a split model; give the "
            f"first, {first}"
        )
    return path


class GGUFModel:
    """A GGUF model: one file, or the shards of a split one (opened from the first). Metadata
    is the first file's; tensors are looked up across the shards, each name in one."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve(Path(path))
        first = GGUFFile(self.path)
        self.files = [first]
        self.metadata, self.types = first.metadata, first.types
        m = SHARD.match(self.path.name)
        count = self._split_key(first, "split.count", 2)
        if m is None and count not in (None, 1):
            raise FormatError(
                f"{self.path}: split.count {count}, but the name is not a shard's "
                "(<prefix>-00001-of-0000N.gguf)"
            )
        if m is not None:
            count = int(m["count"])
            self._check_shard(first, 0, count)
            for no in range(2, count + 1):
                shard = self.path.with_name(f"{m['prefix']}-{no:05d}-of-{m['count']}.gguf")
                if not shard.is_file():
                    raise FormatError(f"{shard}: missing (shard {no} of {count})")
                f = GGUFFile(shard)
                self._check_shard(f, no - 1, count)
                self.files.append(f)
        self._file: dict[str, GGUFFile] = {}
        for f in self.files:
            for name in f:
                if name in self._file:
                    raise FormatError(
                        f"{f.path}: tensor {name!r} is also in {self._file[name].path.name}"
                    )
                self._file[name] = f
        want = self._split_key(first, "split.tensors.count", 5)
        if want is not None and want != len(self._file):
            raise FormatError(
                f"{self.path}: split.tensors.count {want}, but the shards hold "
                f"{len(self._file)} tensors"
            )

    @staticmethod
    def _split_key(f: GGUFFile, key: str, vtype: int) -> int | None:
        if key not in f.metadata:
            return None
        if f.types[key] != (vtype,):
            raise FormatError(
                f"{f.path}: {key} is a {_type_name(f.types[key])}, expected a {TYPE_NAMES[vtype]}"
            )
        return int(f.metadata[key])

    def _check_shard(self, f: GGUFFile, no: int, count: int) -> None:
        got_no = self._split_key(f, "split.no", 2)
        got_count = self._split_key(f, "split.count", 2)
        if (got_no, got_count) != (no, count):
            raise FormatError(
                f"{f.path}: split.no {got_no}, split.count {got_count}; the name says shard "
                f"{no} (0-based) of {count}"
            )

    def __contains__(self, name: object) -> bool:
        return name in self._file

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def keys(self) -> list[str]:
        return list(self._file)

    def file_of(self, name: str) -> GGUFFile:
        try:
            return self._file[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        return self.file_of(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self.file_of(name).get(name)

    def value(self, key: str, *vtypes: int) -> Any:
        """Metadata `key` (None where absent), refused unless its value type is one of
        `vtypes` (ids of SCALARS, STRING; ARRAY: any array)."""
        if key not in self.metadata:
            return None
        types = self.types[key]
        if vtypes and types[0] not in vtypes:
            want = " or ".join(TYPE_NAMES[t] for t in vtypes)
            raise FormatError(f"{self.path}: {key} is a {_type_name(types)}, expected {want}")
        return self.metadata[key]
