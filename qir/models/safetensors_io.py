"""Lazy, memory-mapped safetensors reading.

The format is an 8-byte little-endian header length, a JSON header mapping tensor names to
{dtype, shape, data_offsets} (offsets relative to the end of the header), then the raw data.
We parse it ourselves rather than use safetensors.safe_open: its numpy backend cannot return
F8_E4M3 and returns BF16 only once ml_dtypes happens to be imported, while a memmap view of the
bytes reads every dtype without a copy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from qir.formats.base import FormatError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# Real headers are kilobytes to a few megabytes; a larger length means the file is not safetensors.
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file; tensors are read-only views of a memory map, made on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 8:
            raise FormatError(f"{self.path}: {size} bytes, too short for a safetensors header")
        with self.path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise FormatError(
                    f"{self.path}: bad safetensors header length {n} (file is {size} bytes)"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{self.path}: safetensors header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        self._entries = {name: self._entry(name, e) for name, e in header.items()}
        self._check_extent(size - self._data_start)
        self._map: np.memmap | None = None

    def _entry(self, name: str, e: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
        try:
            dtype_name, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise FormatError(f"{self.path}: bad header entry for tensor {name!r}: {e!r}") from None
        if dtype_name not in DTYPES:
            raise FormatError(
                f"{self.path}: tensor {name!r} has dtype {dtype_name}, which qir cannot read "
                f"(known: {', '.join(DTYPES)})"
            )
        dtype = DTYPES[dtype_name]
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not 0 <= begin <= end:
            raise FormatError(f"{self.path}: bad header entry for tensor {name!r}: {e!r}")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise FormatError(
                f"{self.path}: tensor {name!r} has {end - begin} bytes, but {dtype_name} "
                f"{list(shape)} needs {math.prod(shape) * dtype.itemsize}"
            )
        return dtype, shape, begin, end

    def _check_extent(self, data_bytes: int) -> None:
        past = [(b, name) for name, (_, _, b, end) in self._entries.items() if end > data_bytes]
        if past:
            name = min(past)[1]
            raise FormatError(
                f"{self.path}: truncated: tensor {name!r} runs past the end of the file "
                f"(data ends at byte {self._data_start + self._entries[name][3]}, "
                f"file has {self._data_start + data_bytes})"
            )

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def _lookup(self, name: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._lookup(name)[1]

    def dtype(self, name: str) -> np.dtype:
        return self._lookup(name)[0]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file (no copy)."""
        dtype, shape, begin, end = self._lookup(name)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self._data_start + begin
        view = self._map[start : self._data_start + end].view(dtype).reshape(shape)
        return np.asarray(view)


class TensorStore:
    """The tensors of a checkpoint directory: `model.safetensors`, or shards listed in
    `model.safetensors.index.json`; a shard is opened only when one of its tensors is asked for."""

    INDEX = "model.safetensors.index.json"
    SINGLE = "model.safetensors"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, SafetensorsFile] = {}
        index = self.path / self.INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise FormatError(f"{index}: not a safetensors index ({e!r})") from None
            if not isinstance(weight_map, dict):
                raise FormatError(f"{index}: weight_map is not a JSON object")
            self._shard_of = {str(k): str(v) for k, v in weight_map.items()}
        elif (self.path / self.SINGLE).is_file():
            self._shard_of = dict.fromkeys(self._open(self.SINGLE).keys(), self.SINGLE)
        else:
            raise FormatError(f"{self.path}: neither {self.SINGLE} nor {self.INDEX} found")

    def _open(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            f = self.path / shard
            if not f.is_file():
                raise FormatError(f"{f}: shard listed in {self.INDEX} is missing")
            self._files[shard] = SafetensorsFile(f)
        return self._files[shard]

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._shard_of:
            raise FormatError(f"{self.path}: no tensor {name!r} in the checkpoint")
        f = self._open(self._shard_of[name])
        if name not in f:
            raise FormatError(f"{f.path}: no tensor {name!r} (the index says it is there)")
        return f

    def keys(self) -> list[str]:
        return list(self._shard_of)

    def __contains__(self, name: object) -> bool:
        return name in self._shard_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self._file(name).dtype(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(name)
