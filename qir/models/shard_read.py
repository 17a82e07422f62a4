"""Loading one tensor-parallel rank's part of a checkpoint, reading only its shard's bytes.

1. Types: the model block is built from a copy of the checkpoint whose 2-D+ tensors read as
   zeros of their header's shape and dtype (no file bytes; small tensors, such as norms, biases
   and per-tensor scales, are read), and tensor_parallel rewrites it into the rank's graph: which
   weight each rank holds, and which rows or inputs of it. The families' readers still run on
   those zeros (AWQ GEMM's repack, for one), which costs CPU time and transient memory of the
   whole model, though no I/O; a header-only type reader per family would remove it.
2. Bytes: each sharded linear is read through its family's table of tensor axes
   (qir.models.families.Axes): a tensor's rows or columns of the shard are sliced from the
   memory-mapped file before they are copied, so only they are read; the family's reader then
   repacks the part as a weight of the part's shape. A tensor that cannot be cut in proportion
   (AWQ GEMV's padded zeros, GPTQ's g_idx on a K split, a fused Phi-3 projection, a format
   without a table) is read whole and cut after (WeightFormat.rows/columns), as is the tied
   lm_head's part of the embedding table (the embedding reads it whole anyway).

`ShardReader.bytes_read` counts every byte handed out, so a test can check a rank's share.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from qir.dtypes import DType
from qir.formats.base import FormatError
from qir.models.blocks import Block, build
from qir.models.checkpoint import Checkpoint, Linear
from qir.models.shards import shard_buffers, tensor_parallel
from qir.passes.tensor_parallel import TensorParallel
from qir.types import QExperts, QWeight, TensorType

Shard = tuple[str, str, int, int, int]  # (source, axis, start, stop, whole)


class Unsliceable(Exception):
    """A tensor that its family's axes do not let the reader cut in proportion."""


class ShardReader:
    """A checkpoint's tensors with `plan`'s modules cut to their shards before reading."""

    def __init__(self, store: Any, plan: Mapping[str, Shard], axes: Mapping[str, tuple[str, ...]]):
        self.store = store
        self.plan = dict(plan)
        self.axes = axes
        self.whole: set[str] = set()  # modules read whole (then cut) instead
        self.bytes_read = 0
        self._last: dict[str, np.ndarray] = {}  # the tensors of the module being read
        self._names: dict[str, list[str]] | None = None  # module -> its tensors

    def __contains__(self, name: object) -> bool:
        return name in self.store

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def keys(self) -> list[str]:
        return list(self.store.keys())

    def dtype(self, name: str) -> np.dtype:
        return self.store.dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get_view(name).shape)

    def check(self, module: str) -> None:
        """Raise Unsliceable before any byte is read if a tensor of `module` cannot be cut."""
        if self._names is None:
            self._names = {}
            for name in self.store:
                self._names.setdefault(name.rpartition(".")[0], []).append(name)
        for name in self._names.get(module, ()):
            self._index(name, tuple(self.store.shape(name)))

    def get_view(self, name: str) -> np.ndarray:
        view = self.store.get(name)
        index = self._index(name, view.shape)
        return view if index is None else view[index]

    def get(self, name: str) -> np.ndarray:
        if name in self._last:  # readers look a tensor up more than once
            return self._last[name]
        view = self.store.get(name)
        index = self._index(name, view.shape)
        if index is None:
            return self._read(name, view)
        part = np.array(view[index])  # the copy reads the part's bytes, no others
        part.flags.writeable = False
        return self._read(name, part)

    def get_whole(self, name: str) -> np.ndarray:
        return self._read(name + "#whole", self.store.get(name))

    def _read(self, key: str, a: np.ndarray) -> np.ndarray:
        """Count `a`'s bytes once while its module is the one being read."""
        module = key.rpartition(".")[0]
        if any(k.rpartition(".")[0] != module for k in self._last):
            self._last = {}
        if key not in self._last:
            self.bytes_read += a.nbytes
            self._last[key] = a
        return a

    def _index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        module, _, suffix = name.rpartition(".")
        shard = self.plan.get(module)
        if shard is None or module in self.whole:
            return None
        _, axis, start, stop, whole = shard
        meaning = self.axes.get(suffix)
        if meaning is None and int(np.prod(shape)) == 1:
            return None  # a per-tensor scale: every shard's
        if meaning is None or len(meaning) != len(shape):
            raise Unsliceable(name)
        index = []
        for dim, m in zip(shape, meaning, strict=True):
            if m == f"{axis}?":
                raise Unsliceable(name)
            if m != axis:
                index.append(slice(None))
                continue
            lo, hi = start * dim, stop * dim
            if lo % whole or hi % whole:
                raise Unsliceable(name)
            index.append(slice(lo // whole, hi // whole))
        return tuple(index) if any(s != slice(None) for s in index) else None


class _MetaStore:
    """Tensors of 2 or more dims as zeros of their shape (no bytes read), others as stored."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader = reader

    def __contains__(self, name: object) -> bool:
        return name in self.reader

    def __iter__(self) -> Iterator[str]:
        return iter(self.reader)

    def keys(self) -> list[str]:
        return self.reader.keys()

    def dtype(self, name: str) -> np.dtype:
        return self.reader.dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.reader.store.shape(name))

    def get(self, name: str) -> np.ndarray:
        shape = self.shape(name)
        if len(shape) < 2:
            return self.reader.get_whole(name)
        a = np.zeros(shape, self.dtype(name))  # pages the OS maps only when written
        a.flags.writeable = False
        return a


def _with_store(ck: Checkpoint, store: Any) -> Checkpoint:
    out = copy.copy(ck)
    out.store = store
    out._fused = None
    return out


def _part(ck: Checkpoint, reader: ShardReader, part: QWeight, shard: Shard) -> dict[str, Any]:
    """The buffers of `part`, shard `shard` of linear `source`, read through `reader`."""
    source = shard[0]
    want = (part.out_features, part.in_features)
    try:
        if ck._segment(source) is not None:  # rows of a fused projection (Phi-3)
            raise Unsliceable(source)
        reader.check(source)
        lin = ck._read_linear(source)  # the family's reader on the part's tensors
        got = (lin.weight.out_features, lin.weight.in_features)
        if got != want:
            raise FormatError(f"{source}: read a {list(got)} part, expected {list(want)}")
        return lin.buffers
    except Unsliceable:
        reader.whole.add(source)
        return _cut(ck.linear(source), part, shard)


def _cut(lin: Linear, part: QWeight, shard: Shard) -> dict[str, Any]:
    return shard_buffers(replace(part, bias=lin.weight.bias), lin.buffers, shard)


def load_rank(
    ck: Checkpoint,
    ranks: int,
    rank: int,
    act: DType | None = None,
    max_seq: int | None = None,
    kv_pages: int | None = None,
    prefill_chunk: int | None = None,
) -> tuple[Block, ShardReader]:
    """Rank `rank`'s model block of `ranks`, and the reader that counted the bytes it read."""
    reader = ShardReader(ck.store, {}, ck.family.axes(ck.config))
    meta = build(
        _with_store(ck, _MetaStore(reader)), "model", 0, act, max_seq, kv_pages, prefill_chunk
    )
    if any(isinstance(meta.graph.node(w).type, QExperts) for w in meta.graph.weights):
        # Stacked experts are read by qir.models.experts, not through a family's linear:
        # a MoE checkpoint is read whole (counted), then cut.
        whole = build(_with_store(ck, reader), "model", 0, act, max_seq, kv_pages, prefill_chunk)
        return tensor_parallel(whole, ranks, rank), reader
    graph = meta.graph.copy()
    TensorParallel(ranks, rank).run(graph)
    shards: list[Shard] = []
    uses: Counter[str] = Counter()
    for w in graph.weights:
        shard = graph.node(w).attr("shard")
        uses[shard[0] if shard else graph.node(w).attr("key")] += 1
        if shard:
            shards.append(tuple(shard))
    reader.plan = {s[0]: s for s in shards if uses[s[0]] == 1}  # a tied table is read whole
    sharded = _with_store(ck, reader)
    weights: dict[str, dict[str, Any]] = {}
    for w in graph.weights:
        node = graph.node(w)
        key, shard, t = node.attr("key"), node.attr("shard"), node.type
        if not isinstance(t, QWeight):  # a norm's weight or the sinks: read in full above
            assert isinstance(t, TensorType)
            vec = meta.weights[shard[0] if shard else key]
            weights[key] = shard_buffers(t, vec, tuple(shard)) if shard else dict(vec)
            continue
        if shard is None:
            bufs = dict(sharded.linear(key).buffers)
        elif shard[0] in reader.plan:
            bufs = dict(_part(sharded, reader, t, tuple(shard)))
        else:
            bufs = _cut(sharded.linear(shard[0]), t, tuple(shard))
        if not t.bias:
            bufs.pop("bias", None)  # a row-parallel bias lives on rank 0
        weights[key] = bufs
    return replace(meta, graph=graph, weights=weights), reader
