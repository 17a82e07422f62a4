"""Loading one tensor-parallel rank's part of a checkpoint, reading only its shard's bytes.

1. Types: the model block is built from a copy of the checkpoint whose 2-D+ tensors read as
   zeros of their header's shape and dtype (no file bytes; small tensors, such as norms, biases
   and per-tensor scales, are read), and tensor_parallel rewrites it into the rank's graph: which
   weight each rank holds, and which rows or inputs of it. The conventions' readers still run on
   those zeros (AWQ GEMM's repack, for one), which costs CPU time and transient memory of the
   whole model, though no I/O; a header-only type reader per convention would remove it.
2. Bytes: each sharded linear is read through its convention's table of tensor axes
   (qir.models.quant_conventions.Axes): a tensor's rows or columns of the shard are sliced from the
   memory-mapped file before they are copied, so only they are read; the convention's reader then
   repacks the part as a weight of the part's shape. Where the axes cannot say it, the convention
   cuts its tensors itself (QuantConvention.parts): GPTQ reads its slice of g_idx and the zeros and
   scales of only the groups that slice names; AWQ GEMV the qzeros words and scales of its
   groups, laid out in the part's own padded width. A fused projection's segment (Phi-3's
   qkv_proj, gate_up_proj) is those rows of the fused tensors. Stacked experts (mlx-lm's
   switch_mlp, [E, ...]) read each expert's part, as do one module per expert (Mixtral's
   experts.<e>.w1) and gpt-oss's interleaved gate/up blocks (every other row). A part that
   reads in another format than the one the pass gave it (and that recast cannot take), and a
   tensor that cannot be cut before reading, is read whole and cut after
   (WeightFormat.rows/columns, which refuse an inexact cut), as is the tied lm_head's part of
   the embedding table (the embedding reads it whole anyway).

`ShardReader.bytes_read` counts every byte handed out, so a test can check a rank's share.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import numpy as np

from qir.dtypes import DType
from qir.errors import FormatError
from qir.models.blocks import Block, build
from qir.models.checkpoint import Checkpoint
from qir.models.checkpoint_view import Linear
from qir.models.experts import stack, stacked_experts
from qir.models.quant_conventions.base import Cut, Unsliceable
from qir.models.quant_conventions.hf_mxfp4 import stacked_experts as hub_experts
from qir.models.shards import shard_buffers
from qir.passes.tensor_parallel import TensorParallel
from qir.types import QExperts, QWeight, TensorType

Shard = tuple[str, str, int, int, int]  # (source, axis, start, stop, whole)
T = TypeVar("T")


class ShardReader:
    """A checkpoint's tensors, with one module at a time read as its shard's part
    (`read_part`): its tensors are cut before they are read, by the convention's axes or its own
    `parts`. Every other tensor is read whole."""

    def __init__(
        self,
        store: Any,
        axes: Mapping[str, tuple[str, ...]],
        parts: Callable[..., dict[str, np.ndarray] | None] | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        self.store = store
        self.axes = axes
        self.parts = parts
        self.config = config or {}
        self.plan: dict[str, Shard] = {}  # the modules a rank reads as parts, by source
        self.whole: set[str] = set()  # modules read whole (then cut) instead
        self.bytes_read = 0
        self._last: dict[str, np.ndarray] = {}  # the tensors of the module being read whole
        self._part: dict[str, np.ndarray] = {}  # the tensors of the module being read as a part
        self._names: dict[str, list[str]] | None = None  # module -> its tensors

    def __contains__(self, name: object) -> bool:
        return name in self.store

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def keys(self) -> list[str]:
        return list(self.store.keys())

    def dtype(self, name: str) -> np.dtype:
        result: np.dtype = self.store.dtype(name)
        return result

    def shape(self, name: str) -> tuple[int, ...]:
        part = self._part.get(name)
        return tuple(self.store.shape(name) if part is None else part.shape)

    def tensors(self, module: str) -> list[str]:
        """The names of `module`'s tensors (`module.<suffix>`)."""
        if self._names is None:
            self._names = {}
            for name in self.store:
                self._names.setdefault(name.rpartition(".")[0], []).append(name)
        return self._names.get(module, [])

    def read(self, name: str, index: tuple[Any, ...] | None = None) -> np.ndarray:
        """`index` of tensor `name` (a slice or an integer array per dim; None: all of it),
        copied from the mapped file so that only its bytes are read, and counted."""
        view = self.store.get(name)
        if index is None:
            a = view
        else:
            a = np.array(view[index])
            a.flags.writeable = False
        self.bytes_read += a.nbytes
        result: np.ndarray = a
        return result

    def get(self, name: str) -> np.ndarray:
        if name in self._part:
            return self._part[name]
        return self._whole(name, name)

    def get_whole(self, name: str) -> np.ndarray:
        return self._whole(name + "#whole", name)

    def _whole(self, key: str, name: str) -> np.ndarray:
        """Read `name` whole, counted once while its module is the one being read (readers
        look a tensor up more than once)."""
        module = key.rpartition(".")[0]
        if any(k.rpartition(".")[0] != module for k in self._last):
            self._last = {}
        if key not in self._last:
            self._last[key] = self.read(name)
        return self._last[key]

    def read_part(
        self, module: str, cut: Cut, read: Callable[[], T], expert: int | None = None
    ) -> T:
        """`read()` (a convention's reader of `module`) on the part `cut` = (axis, start, stop,
        whole) of `module`'s tensors (of expert `expert` of stacked ones): part_tensors."""
        return self.serving(self.part_tensors(module, cut, expert), read)

    def part_tensors(
        self, module: str, cut: Cut, expert: int | None = None
    ) -> dict[str, np.ndarray]:
        """`module`'s tensors (of expert `expert` of stacked ones) for the part `cut`, in the
        checkpoint's layout, cut before any byte is read: by the convention's own `parts`, else in
        proportion along its axes. Raises Unsliceable where neither can cut them."""
        tensors = None
        if self.parts is not None and expert is None:
            tensors = self.parts(self, self.config, module, cut)
        if tensors is None:
            indices = {n: self._index(n, cut, expert) for n in self.tensors(module)}
            tensors = {n: self._take(n, ix, cut) for n, ix in indices.items()}  # checked first
        return tensors

    def serving(self, tensors: dict[str, np.ndarray], read: Callable[[], T]) -> T:
        """`read()` with `tensors` (parts already read) in place of the stored ones."""
        self._part = tensors
        try:
            return read()
        finally:
            self._part = {}

    def proportional(self, name: str, cut: Cut) -> np.ndarray:
        """Tensor `name`'s part for `cut` by its convention's axes, read (Unsliceable if none)."""
        return self._take(name, self._index(name, cut, None), cut)

    def _take(self, name: str, index: tuple[Any, ...] | None, cut: Cut) -> np.ndarray:
        if self.axes.get(name.rpartition(".")[2]) != ("shape",):
            return self.read(name, index)
        shape = self.read(name).copy()  # the weight's [out, in]: the part's
        axis, start, stop, _ = cut
        shape.reshape(-1)[0 if axis == "out" else 1] = stop - start
        shape.flags.writeable = False
        return shape

    def _index(self, name: str, cut: Cut, expert: int | None) -> tuple[Any, ...] | None:
        """The index of `name`'s part for `cut`, by its convention's axes (None: all of it)."""
        axis, start, stop, whole = cut
        shape = tuple(self.store.shape(name))
        lead: tuple[Any, ...] = ()
        if expert is not None:  # stacked experts: [E, ...] read at one
            shape, lead = shape[1:], (expert,)
        meaning = self.axes.get(name.rpartition(".")[2])
        if meaning == ("shape",):
            if int(np.prod(shape)) != 2 or expert is not None:
                raise Unsliceable(name)
            return None
        if int(np.prod(shape)) == 1:
            return lead or None  # a per-tensor scale: every shard's
        if meaning is None or len(meaning) < len(shape):
            raise Unsliceable(name)
        index: list[Any] = []
        for dim, m in zip(shape, meaning, strict=False):
            word, _, block = m.partition("/")
            if word not in (axis, f"{axis}?"):
                index.append(slice(None))
                continue
            if block and word == axis:  # one entry per block: those the part covers
                b = int(block)
                first, last = start // b, (stop - 1) // b
                # The part's blocks must index its rows or inputs as the whole's do: a row part
                # starts a block or lies in one, a K part starts and ends on blocks (or at K).
                if axis == "out" and start % b and first != last:
                    raise Unsliceable(name)
                if axis == "in" and (start % b or (stop % b and stop != whole)):
                    raise Unsliceable(name)
                index.append(slice(first, last + 1))
                continue
            lo, hi = start * dim, stop * dim
            if m != axis or lo % whole or hi % whole:
                raise Unsliceable(name)
            index.append(slice(lo // whole, hi // whole))
        if expert is None and all(s == slice(None) for s in index):
            return None
        return (*lead, *index)


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
    source, axis, start, stop, whole = shard
    module, cut = source, (axis, start, stop, whole)
    segment = ck._segment(source)
    if segment is not None:  # rows of a fused projection (Phi-3): those rows of the fused one
        fused, first, _ = segment
        module, cut = fused, (axis, first + start, first + stop, ck.fused_rows(fused))
    try:
        if segment is not None and axis != "out":
            raise Unsliceable(source)
        lin = reader.read_part(module, cut, lambda: ck._read_linear(module))
        return _as_part(lin, part, source)
    except (Unsliceable, FormatError):  # the whole's error, or the cut's refusal, then
        reader.whole.add(source)
        return _cut(ck.linear(source), part, shard)


def _as_part(lin: Linear, want: QWeight, source: str) -> dict[str, Any]:
    """The buffers of `lin`, a part read on its own, as `want` (the cut's shape, the whole's
    format): recast where the part came out in a simpler variant (a GPTQ act-order part whose
    inputs keep their groups in order). Else (a per-channel scale's group size) the whole is
    read and cut, which gives the exact part or the cut's refusal."""
    got = lin.weight
    if (got.out_features, got.in_features) != (want.out_features, want.in_features):
        raise Unsliceable(source)
    bufs = want.format.recast(got.format, lin.buffers, want.in_features)
    if bufs is None:
        raise Unsliceable(source)
    return bufs


def _experts_part(
    ck: Checkpoint, reader: ShardReader, part: QExperts, shard: Shard | None, key: str
) -> dict[str, Any] | None:
    """Each expert's part of stacked experts (mlx-lm's switch_mlp, [E, ...] tensors), of one
    module per expert (`experts.*.w1`) or of one linear stacked alone (a shared expert's
    down_proj) or gpt-oss's blocks, stacked; with no shard, each whole. None where the experts
    are none of these, or cannot be cut before reading (read whole, then cut)."""
    source = key if shard is None else shard[0]
    if shard is not None and (hub := _hub_mxfp4(ck, reader, part, shard)) is not None:
        return hub
    tensors = reader.tensors(source)
    stacked = any(len(reader.store.shape(t)) >= 3 for t in tensors)
    if stacked or "*" in source or (tensors and part.count == 1):
        modules = [source.replace("*", str(e)) for e in range(part.count)]
    else:
        return None
    if shard is None:
        if stacked:
            return stack(stacked_experts(ck, source, part.count))[1]
        return stack([ck.linear(m) for m in modules])[1]
    cut = shard[1:]
    experts = []
    try:
        for e, module in enumerate(modules):
            if stacked:
                lin = reader.read_part(source, cut, lambda: ck.convention.linear(ck, source), e)
            else:
                lin = reader.read_part(module, cut, partial(ck._read_linear, module))
            experts.append(replace(lin, buffers=_as_part(lin, part.expert, source)))
    except (Unsliceable, FormatError):
        return None
    return stack(experts)[1]


def _hub_mxfp4(
    ck: Checkpoint, reader: ShardReader, part: QExperts, shard: Shard
) -> dict[str, Any] | None:
    """gpt-oss's stacked MXFP4 experts (`<module>_blocks/_scales/_bias`, [E, rows, ...]): a
    gate's or up's part is every other row of gate_up_proj from 2*start (+1 for up), which
    reads as runs of whole rows; a down part its blocks of 32 inputs of every row. None where
    `shard` is no such weight's, or a K cut falls inside a block (read whole: refused)."""
    source, axis, start, stop, _ = shard
    fused, _, proj = source.rpartition(".")
    if f"{source}_blocks" in reader:
        fused, first, step = source, 0, 1
    elif proj in ("gate", "up") and f"{fused}_blocks" in reader:
        first, step = ("gate", "up").index(proj), 2
    else:
        return None
    every = slice(first, None, step)
    if axis == "out":
        rows, blocks = slice(first + step * start, first + step * stop, step), slice(None)
    elif start % 32 or stop % 32:
        return None
    else:
        rows, blocks = every, slice(start // 32, stop // 32)
    each, bias = slice(None), f"{fused}_bias"
    tensors = {
        f"{fused}_blocks": reader.read(f"{fused}_blocks", (each, rows, blocks)),
        f"{fused}_scales": reader.read(f"{fused}_scales", (each, rows, blocks)),
        # a K part's bias is rank 0's to add: the others' reader gets zeros, not its bytes
        bias: reader.read(bias, (each, rows))
        if part.expert.bias
        else np.zeros(reader.store.shape(bias), reader.dtype(bias)),
    }
    qe, bufs = reader.serving(tensors, lambda: hub_experts(ck, fused, part.count))
    want = part.expert
    if (qe.out_features, qe.in_features, qe.expert.format) != (
        want.out_features,
        want.in_features,
        want.format,
    ):
        return None
    return bufs


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
    convention = ck.convention
    reader = ShardReader(ck.store, convention.axes(ck.config), convention.parts, ck.config)
    meta = build(
        _with_store(ck, _MetaStore(reader)), "model", 0, act, max_seq, kv_pages, prefill_chunk
    )
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
    whole: Block | None = None  # the whole block, for what can only be cut after reading
    weights: dict[str, dict[str, Any]] = {}
    for w in graph.weights:
        node = graph.node(w)
        key, shard, t = node.attr("key"), node.attr("shard"), node.type
        bufs: dict[str, Any] | None = None
        if isinstance(t, QExperts):
            source = key if shard is None else shard[0]
            bufs = _experts_part(sharded, reader, t, None if shard is None else tuple(shard), key)
            if bufs is None:
                reader.whole.add(source)
                if whole is None:
                    whole = build(sharded, "model", 0, act, max_seq, kv_pages, prefill_chunk)
                bufs = dict(whole.weights[source])
                if shard is not None:
                    bufs = shard_buffers(t, bufs, tuple(shard))
        elif not isinstance(t, QWeight):  # a norm's weight or the sinks: read in full above
            assert isinstance(t, TensorType)
            vec = meta.weights[shard[0] if shard else key]
            weights[key] = shard_buffers(t, vec, tuple(shard)) if shard else dict(vec)
            continue
        elif shard is None:
            bufs = dict(sharded.linear(key).buffers)
        elif shard[0] in reader.plan:
            bufs = dict(_part(sharded, reader, t, tuple(shard)))
        else:
            bufs = _cut(sharded.linear(shard[0]), t, tuple(shard))
        if not (t.expert if isinstance(t, QExperts) else t).bias:
            bufs.pop("bias", None)  # a row-parallel bias lives on rank 0
        weights[key] = bufs
    return replace(meta, graph=graph, weights=weights), reader
