"""The weights of one tensor-parallel rank: each weight node the tensor_parallel pass sharded
(attribute `shard`) gets its part of the checkpoint weight's kernel-layout buffers, cut exactly by
its format (WeightFormat.rows for rows, .columns for inputs; an inexact cut is refused naming
the tensor and the group size). Rows are views; inputs are views where the layout allows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from qir.errors import FormatError
from qir.graph import Graph
from qir.passes.tensor_parallel import TensorParallel
from qir.types import QExperts, QWeight, TensorType

if TYPE_CHECKING:
    from qir.models.blocks import Block

Weights = Mapping[str, Mapping[str, np.ndarray]]


def shard_buffers(
    part: QWeight | QExperts | TensorType,
    bufs: Mapping[str, np.ndarray],
    shard: tuple[str, str, int, int, int],
) -> dict[str, np.ndarray]:
    """The buffers of `part`, the shard `shard` = (source, axis, start, stop, whole) of a weight
    whose buffers are `bufs` (stacked experts: each expert's part, stacked again; a parameter
    vector, gpt-oss's sinks: its entries start..stop)."""
    if isinstance(part, TensorType):
        return {"weight": bufs["weight"][shard[2] : shard[3]]}
    if isinstance(part, QExperts):
        experts = [
            shard_buffers(part.expert, {k: v[e] for k, v in bufs.items()}, shard)
            for e in range(part.count)
        ]
        return {k: np.stack([x[k] for x in experts]) for k in experts[0]}
    source, axis, start, stop, whole = shard
    fmt = part.format
    if axis == "out":
        out_features, in_features = whole, part.in_features
        cut = fmt.rows(bufs, out_features, in_features, start, stop)
        if part.bias:
            cut["bias"] = bufs["bias"][start:stop]
    elif axis == "in":
        out_features, in_features = part.out_features, whole
        cut = fmt.columns(bufs, out_features, in_features, start, stop, where=source)
        if part.bias:
            cut["bias"] = bufs["bias"]
    else:
        raise FormatError(f"{source}: unknown shard axis {axis!r}")
    return cut


def shard_weights(graph: Graph, weights: Weights) -> dict[str, dict[str, np.ndarray]]:
    """The weights `graph` (one rank's, after tensor_parallel) reads, from the whole model's."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for w in graph.weights:
        node = graph.node(w)
        key = node.attr("key")
        shard = node.attr("shard")
        if shard is None:
            out[key] = dict(weights[key])
            continue
        assert isinstance(node.type, QWeight | QExperts | TensorType)
        out[key] = shard_buffers(node.type, weights[shard[0]], tuple(shard))
    return out


def tensor_parallel(block: Block, ranks: int, rank: int) -> Block:
    """Rank `rank`'s part of `block` split across `ranks` ranks: its graph and its weights."""
    graph = block.graph.copy()
    TensorParallel(ranks, rank).run(graph)
    return replace(block, graph=graph, weights=shard_weights(graph, block.weights))
