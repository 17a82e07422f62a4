"""Lazy, memory-mapped safetensors reading, exactly as strict as the official library.

The format is an 8-byte little-endian header length n, a JSON header mapping tensor names to
{dtype, shape, data_offsets} (offsets relative to the end of the header), then the raw data.
We parse it ourselves rather than use safetensors.safe_open: its numpy backend cannot return
F8_E4M3 and returns BF16 only once ml_dtypes happens to be imported, while a memmap view of the
bytes reads every dtype without a copy.

The whole header is validated when a file is opened, before any tensor is used, by the rules of
the official reader (safetensors 0.8's Rust `SafeTensors::read_metadata`), so that qir opens a
file exactly when `safetensors.safe_open` does (tests/models/test_safetensors_fuzz.py checks
this differentially):
- n <= 100_000_000 (the official limit) and 8 + n <= the file size;
- the header is JSON as serde_json reads it (qir.models.strict_json: UTF-8, nesting <= 127, no
  NaN, ...), an object; its `__metadata__` (once at most; null means none) is an object of
  strings; every other key is a tensor: an object holding `dtype`, `shape` and `data_offsets`
  once each (other keys are ignored, as the official reader ignores them), or the list
  [dtype, shape, data_offsets]; a name given twice means its last entry (each must be
  well-formed);
- dtype is one of DTYPES (or {"F32": null}, serde's other spelling of an enum value); shape a
  list of integers in [0, 2**64); data_offsets exactly two such integers (never floats, "-0"
  or booleans);
- sorted by offset, the tensors tile the data exactly: the first begins at 0, each begins where
  the one before ended (no hole, no overlap; empty tensors may share an offset), the last ends
  at the end of the file;
- a tensor holds (element count) * (dtype bits) / 8 bytes, a whole number; the element count
  (multiplied left to right) and the bit count must fit in 64 bits.
Each refusal is a FormatError naming the file and, where there is one, the tensor. The cost is
a sort: n log n in the number of tensors.

Alignment is not part of the format (the official reader does not require it): a tensor whose
bytes are not aligned for its dtype is returned as an aligned read-only copy, the others as
read-only views of the file. F4 and F6 (packed sub-byte floats) have no numpy dtype: `raw` reads
them, `get` refuses them by name.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from qir.errors import FormatError
from qir.models import strict_json
from qir.models.checkpoint_dir import check_name, find, read_bytes

log = logging.getLogger("qir.models")

# safetensors dtype -> (bits per element, numpy dtype or None where numpy has none)
DTYPES: dict[str, tuple[int, np.dtype | None]] = {
    "BOOL": (8, np.dtype("?")),
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
    "U8": (8, np.dtype("u1")),
    "I8": (8, np.dtype("i1")),
    "F8_E5M2": (8, np.dtype(ml_dtypes.float8_e5m2)),
    "F8_E4M3": (8, np.dtype(ml_dtypes.float8_e4m3fn)),
    "F8_E8M0": (8, np.dtype(ml_dtypes.float8_e8m0fnu)),
    "F8_E4M3FNUZ": (8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    "F8_E5M2FNUZ": (8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    "I16": (16, np.dtype("<i2")),
    "U16": (16, np.dtype("<u2")),
    "F16": (16, np.dtype("<f2")),
    "BF16": (16, np.dtype(ml_dtypes.bfloat16)),
    "I32": (32, np.dtype("<i4")),
    "U32": (32, np.dtype("<u4")),
    "F32": (32, np.dtype("<f4")),
    "C64": (64, np.dtype("<c8")),
    "F64": (64, np.dtype("<f8")),
    "I64": (64, np.dtype("<i8")),
    "U64": (64, np.dtype("<u8")),
}

MAX_HEADER = 100_000_000  # the official reader's limit on n
_U64_MAX = 2**64 - 1
_FIELDS = ("dtype", "shape", "data_offsets")


class TensorInfo(NamedTuple):  # a NamedTuple: made once per tensor of a large header, fast
    name: str
    dtype: str  # the safetensors name, a key of DTYPES
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data, which starts after the header
    end: int


def _show(value: Any, limit: int = 60) -> str:
    """A bad header value for an error message: JSON-like, one line, short, whatever its size
    or depth (the header parse leaves nesting to the reader: see strict_json.check)."""

    def plain(v: Any, depth: int) -> Any:
        if isinstance(v, list) and depth > 3:
            return "..."
        if isinstance(v, strict_json.Pairs):
            return {k: plain(x, depth + 1) for k, x in v[:8]}
        return [plain(x, depth + 1) for x in v[:8]] if isinstance(v, list) else v

    text = json.dumps(plain(value, 0), ensure_ascii=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _u64s(v: Any) -> bool:
    """Whether `v` is a JSON array of integers in [0, 2**64) (never floats, booleans or -0)."""
    if type(v) is not list:
        return False
    # a generator beats set/min/max on the 1-4 items of a shape
    return all(type(d) is int and 0 <= d <= _U64_MAX for d in v)


class SafetensorsFile:
    """One .safetensors file, its header validated on opening; tensors are read-only views of a
    memory map, made on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = int.from_bytes(f.read(8), "little")
                if size < 8:
                    raise FormatError(
                        f"{self.path}: {size} bytes, too short for a safetensors header"
                    )
                if n > MAX_HEADER or 8 + n > size:
                    raise FormatError(
                        f"{self.path}: bad safetensors header length {n} (file is {size} bytes, "
                        f"the limit is {MAX_HEADER})"
                    )
                raw = f.read(n)
        except OSError as e:
            raise FormatError(f"{self.path}: cannot read ({e.strerror})") from None
        where = f"{self.path}: safetensors header"
        header = strict_json.loads(raw, where, pairs=True)
        if not isinstance(header, strict_json.Pairs):
            raise FormatError(f"{self.path}: safetensors header is {_show(header)}, not an object")
        self.metadata: dict[str, str] | None = None
        self._entries: dict[str, TensorInfo] = {}
        unchecked = strict_json.Pairs()  # what nothing below validates: names, ignored fields
        seen_metadata = False
        for key, value in header:
            if key != "__metadata__":
                self._entries[key] = self._entry(key, value, unchecked)
            elif seen_metadata:
                raise FormatError(f"{self.path}: __metadata__ appears twice in the header")
            else:
                seen_metadata = True
                self.metadata = self._metadata(value)
                unchecked += (self.metadata or {}).items()
        # Entries sit 2 levels down; their ignored fields are parsed all the same. Only a \u
        # escape makes a lone surrogate.
        strict_json.check(unchecked, where, depth=2, strings=b"\\u" in raw)
        self._data_start = 8 + n
        self._check_tiling(size - self._data_start)
        self._map: np.memmap | None = None

    def _metadata(self, value: Any) -> dict[str, str] | None:
        if value is None:
            return None
        if not isinstance(value, strict_json.Pairs) or not all(
            isinstance(v, str) for _, v in value
        ):
            raise FormatError(
                f"{self.path}: __metadata__ is {_show(value)}, expected an object of strings"
            )
        return dict(value)

    def _entry(self, name: str, e: Any, unchecked: strict_json.Pairs) -> TensorInfo:
        """The entry `e` of tensor `name`; its ignored fields go to `unchecked`."""
        unchecked.append((name, None))
        if type(e) is strict_json.Pairs:
            fields: dict[str, Any] = {}
            for k, v in e:
                if k not in _FIELDS:
                    unchecked.append((k, v))
                elif k in fields:
                    raise self._bad(name, f"{k} appears twice")
                else:
                    fields[k] = v
            if len(fields) < 3:
                missing = next(k for k in _FIELDS if k not in fields)
                raise self._bad(name, f"no {missing} in its header entry {_show(e)}")
            dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
        elif type(e) is list and len(e) == 3:
            dtype, shape, offsets = e
        else:
            raise self._bad(
                name, f"header entry {_show(e)}, expected {{dtype, shape, data_offsets}}"
            )
        if type(dtype) is strict_json.Pairs and len(dtype) == 1 and dtype[0][1] is None:
            dtype = dtype[0][0]  # {"F32": null}
        if type(dtype) is not str or dtype not in DTYPES:
            known = ", ".join(DTYPES)
            raise self._bad(name, f"dtype {_show(dtype)} is not a safetensors dtype ({known})")
        if not _u64s(shape):
            raise self._bad(name, f"shape {_show(shape)} is not a list of integers >= 0")
        if not _u64s(offsets) or len(offsets) != 2:
            raise self._bad(name, f"data_offsets {_show(offsets)}, expected two integers >= 0")
        return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])

    def _bad(self, name: str, what: str) -> FormatError:
        return FormatError(f"{self.path}: tensor {name!r}: {what}")

    def _nbytes(self, t: TensorInfo) -> int:
        count = 1
        for d in t.shape:  # as the official reader multiplies: left to right, checked
            count *= d
            if count > _U64_MAX:
                raise FormatError(
                    f"{self.path}: tensor {t.name!r}: shape {list(t.shape)} overflows"
                )
        bits = count * DTYPES[t.dtype][0]
        if bits > _U64_MAX:
            raise FormatError(
                f"{self.path}: tensor {t.name!r}: {t.dtype} {list(t.shape)} overflows"
            )
        if bits % 8:
            raise FormatError(
                f"{self.path}: tensor {t.name!r}: {t.dtype} {list(t.shape)} is {bits} bits, "
                "not a whole number of bytes"
            )
        return bits // 8

    def _check_tiling(self, data_bytes: int) -> None:
        end, last = 0, None
        for t in sorted(self._entries.values(), key=lambda t: (t.begin, t.end)):
            where = f"{self.path}: tensor {t.name!r} at data_offsets [{t.begin}, {t.end}]"
            if t.end < t.begin:
                raise FormatError(f"{where}: ends before it begins")
            if t.begin < end:
                raise FormatError(f"{where}: overlaps tensor {last!r}, which ends at {end}")
            if t.begin > end:
                after = f"after tensor {last!r}" if last is not None else "at the start"
                raise FormatError(f"{where}: leaves a hole of {t.begin - end} bytes {after}")
            nbytes = self._nbytes(t)
            if t.end - t.begin != nbytes:
                raise FormatError(
                    f"{self.path}: tensor {t.name!r} has {t.end - t.begin} bytes, but "
                    f"{t.dtype} {list(t.shape)} needs {nbytes}"
                )
            end, last = t.end, t.name
        if end > data_bytes:
            raise FormatError(
                f"{self.path}: truncated: tensor {last!r} runs past the end of the file "
                f"(data ends at byte {self._data_start + end}, "
                f"file has {self._data_start + data_bytes})"
            )
        if end < data_bytes:
            after = f"the last tensor ({last!r})" if last is not None else "the header"
            raise FormatError(
                f"{self.path}: {data_bytes - end} byte(s) after {after} belong to no tensor"
            )

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._entries[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> np.dtype:
        t = self.info(name)
        dtype = DTYPES[t.dtype][1]
        if dtype is None:
            raise FormatError(
                f"{self.path}: tensor {name!r} is {t.dtype} (packed sub-byte floats), "
                "which qir cannot read as an array"
            )
        return dtype

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, as a read-only uint8 view of the file."""
        t = self.info(name)
        if self._map is None:
            try:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise FormatError(f"{self.path}: cannot map ({e})") from None
        return np.asarray(self._map[self._data_start + t.begin : self._data_start + t.end])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file (no copy, unless its bytes are unaligned)."""
        dtype, shape = self.dtype(name), self.shape(name)
        try:
            view = self.raw(name).view(dtype).reshape(shape)
        except ValueError as e:
            raise FormatError(
                f"{self.path}: tensor {name!r}: numpy cannot hold shape {list(shape)} ({e})"
            ) from None
        if not view.flags.aligned:
            view = view.copy()
            view.flags.writeable = False
        return view


class TensorStore:
    """The tensors of a checkpoint directory: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json`. Every file's header is validated when the store is made;
    tensor bytes are mapped only when a tensor is asked for.

    With an index (see docs/checkpoints.md): its `weight_map` is an object of tensor
    name -> shard name, each a file inside the directory (qir.models.checkpoint_dir); a shard
    the index names must exist and hold every tensor the index puts in it; a tensor a shard holds
    that the index puts in another shard is refused (two copies, which one is meant?); one the
    index does not name at all is logged as a warning and never read.
    """

    INDEX = "model.safetensors.index.json"
    SINGLE = "model.safetensors"

    def __init__(
        self,
        path: str | Path,
        singles: tuple[str, ...] = (),
        rename: Callable[[str], str | None] | None = None,
    ) -> None:
        """`singles`: names of a single-file checkpoint to try after model.safetensors (a
        producer's own name, such as auto-gptq's gptq_model-4bit-128g.safetensors). `rename`:
        the name a stored tensor goes by (None: not one of the model's, never read), for a
        multimodal checkpoint's text model."""
        self.path = Path(path)
        self._files: dict[str, SafetensorsFile] = {}
        self._open(singles)
        self._stored: dict[str, str] = {n: n for n in self._shard_of}
        if rename is not None:
            self._stored = {new: n for n in self._shard_of if (new := rename(n)) is not None}

    def _open(self, singles: tuple[str, ...]) -> None:
        index = find(self.path, self.INDEX, self.INDEX)
        names = (self.SINGLE, *singles)
        if index is not None:
            self._shard_of = self._read_index(index)
            for shard in sorted(set(self._shard_of.values())):
                self._files[shard] = self._open_shard(shard)
            self._check_index(index)
            return
        for name in names:
            check_name(name, f"{self.path}: checkpoint file")
            if (single := find(self.path, name, name)) is not None:
                self._files[name] = SafetensorsFile(single)
                self._shard_of = dict.fromkeys(self._files[name].keys(), name)
                return
        raise FormatError(f"{self.path}: none of {', '.join((*names, self.INDEX))} found")

    def _read_index(self, index: Path) -> dict[str, str]:
        doc = strict_json.loads(read_bytes(index), str(index))
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise FormatError(f"{index}: not a safetensors index (no weight_map object)")
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise FormatError(
                    f"{index}: weight_map[{name!r}] is {_show(shard)}, expected a file name"
                )
            check_name(shard, f"{index}: weight_map[{name!r}]")
        return weight_map

    def _open_shard(self, shard: str) -> SafetensorsFile:
        f = find(self.path, shard, f"{self.path / self.INDEX}: shard")
        if f is None:
            raise FormatError(f"{self.path / shard}: shard listed in {self.INDEX} is missing")
        return SafetensorsFile(f)

    def _check_index(self, index: Path) -> None:
        for name, shard in self._shard_of.items():
            if name not in self._files[shard]:
                raise FormatError(
                    f"{self._files[shard].path}: no tensor {name!r} (the index says it is there)"
                )
        for shard, f in self._files.items():
            unindexed = [name for name in f if name not in self._shard_of]
            elsewhere = [name for name in f if self._shard_of.get(name, shard) != shard]
            if elsewhere:
                name = elsewhere[0]
                raise FormatError(
                    f"{f.path}: holds tensor {name!r}, which {index.name} puts in "
                    f"{self._shard_of[name]} (two copies)"
                )
            if unindexed:
                log.warning(
                    "%s: %d tensor(s) not in %s, never read (first: %r)",
                    f.path,
                    len(unindexed),
                    index.name,
                    unindexed[0],
                )

    def _file(self, name: str) -> tuple[SafetensorsFile, str]:
        """The file holding tensor `name` and the name it is stored under there."""
        stored = self._stored.get(name)
        if stored is None:
            raise FormatError(f"{self.path}: no tensor {name!r} in the checkpoint")
        return self._files[self._shard_of[stored]], stored

    def keys(self) -> list[str]:
        return list(self._stored)

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def shape(self, name: str) -> tuple[int, ...]:
        f, stored = self._file(name)
        return f.shape(stored)

    def dtype(self, name: str) -> np.dtype:
        f, stored = self._file(name)
        return f.dtype(stored)

    def raw(self, name: str) -> np.ndarray:
        f, stored = self._file(name)
        return f.raw(stored)

    def get(self, name: str) -> np.ndarray:
        f, stored = self._file(name)
        return f.get(stored)
