"""Block builders: IR for one layer of a Llama/Qwen-style checkpoint.

mlp: y = x + down(silu(gate(x)) * up(x))   (the block starts at the MLP input: no norm)
qkv: q, k, v = x @ Wq^T, x @ Wk^T, x @ Wv^T
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qir.builder import Builder, Value
from qir.dtypes import DType
from qir.errors import UsageError
from qir.graph import Graph
from qir.models.checkpoint import Checkpoint


@dataclass
class Block:
    graph: Graph
    weights: dict[str, dict[str, np.ndarray]]  # weight key (module path) -> kernel-layout buffers


def _weight(
    b: Builder, ck: Checkpoint, weights: dict[str, dict[str, np.ndarray]], layer: int, proj: str
) -> Value:
    module = ck.layer_module(layer, proj)
    lin = ck.linear(module)
    weights[module] = lin.buffers
    rule = lin.weight.format.act_quant_rule(lin.buffers)
    return b.weight(module, lin.weight, name=f"w_{proj}", act_rule=rule)


def mlp(ck: Checkpoint, layer: int, act: DType) -> Block:
    b = Builder("mlp")
    weights: dict[str, dict[str, np.ndarray]] = {}
    x = b.input("x", ("M", ck.hidden_size), act)
    wg = _weight(b, ck, weights, layer, "gate")
    wu = _weight(b, ck, weights, layer, "up")
    wd = _weight(b, ck, weights, layer, "down")
    gate = b.qlinear(x, wg, name="gate")
    up = b.qlinear(x, wu, name="up")
    h = b.mul(b.silu(gate, name="act"), up, name="h")
    down = b.qlinear(h, wd, name="down")
    b.output("y", b.add(x, down, name="y"))
    return Block(b.graph, weights)


def qkv(ck: Checkpoint, layer: int, act: DType) -> Block:
    b = Builder("qkv")
    weights: dict[str, dict[str, np.ndarray]] = {}
    x = b.input("x", ("M", ck.hidden_size), act)
    for p in ("q", "k", "v"):
        w = _weight(b, ck, weights, layer, p)
        b.output(p, b.qlinear(x, w, name=p))
    return Block(b.graph, weights)


BLOCKS: dict[str, Callable[[Checkpoint, int, DType], Block]] = {"mlp": mlp, "qkv": qkv}


def build(ck: Checkpoint, block: str, layer: int, act: DType | None = None) -> Block:
    if block not in BLOCKS:
        raise UsageError(f"unknown block {block!r}; choose one of {', '.join(BLOCKS)}")
    if not 0 <= layer < ck.num_layers:
        raise UsageError(
            f"layer {layer} is out of range: the checkpoint has {ck.num_layers} layer(s)"
        )
    return BLOCKS[block](ck, layer, act or ck.act_dtype)
