"""Block builders: IR for parts of a Llama/Qwen-style checkpoint, up to the whole model.

mlp:      y = x + down(silu(gate(x)) * up(x))   (starts at the MLP input: no norm)
qkv:      q, k, v = x @ Wq^T, x @ Wk^T, x @ Wv^T
o_proj:   y = x + o_proj(a)                     (a: the attention output)
norm_qkv: q, k, v of rms_norm(x)                (the layer's input_layernorm first)
norm_mlp: y = x + mlp(rms_norm(x))              (post_attention_layernorm first)
layer:    a whole decoder layer at positions `pos`, with its KV cache as state:
          h = x + o_proj(attention(rope(q), kv_append(rope(k), v)))   (q, k, v of rms_norm(x))
          y = h + mlp(rms_norm(h))
model:    logits = lm_head(rms_norm(layers(embedding(ids))))  (lm_head tied or not), and
          next = sample(logits, sampling, seed, pos): each row's next id (qir.sampling)

Blocks with attention take `pos` (int32 [M]: each row's position; row m attends to its
positions 0..pos[m]) and keep one KV cache per layer. The layer block's holds one sequence of
`max_seq` rows. The model block's is paged (qir.ops): a pool of `kv_pages` pages of PAGE_SIZE
rows (default: one sequence's worth), and an input `pages` (int32 [M, table_pages]) says where
each row's positions are, so one block serves many sequences at once (qir.serving).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from qir.builder import Builder, Value
from qir.dtypes import ACTIVATION, F32, I32, DType
from qir.errors import UsageError
from qir.formats.base import FormatError
from qir.graph import Graph
from qir.models.checkpoint import Checkpoint
from qir.ops import SAMPLING_PARAMS
from qir.types import QWeight, TensorType

# The KV cache's default length: the config's max_position_embeddings, at most this (a 128k
# context would preallocate gigabytes of cache nobody asked for).
MAX_SEQ_CAP = 4096
# Rows per page of a paged KV cache (vLLM's default block size).
PAGE_SIZE = 16

Weights = dict[str, dict[str, np.ndarray]]


@dataclass
class Block:
    graph: Graph
    weights: Weights  # weight key (module path) -> kernel-layout buffers
    max_seq: int = 0  # the positions a sequence has room for (0 without attention)
    kv_pages: int = 0  # pages of a paged cache's pool (0: not paged)

    @property
    def table_pages(self) -> int:
        """Pages in a row of the block table: a sequence's max_seq positions."""
        return -(-self.max_seq // PAGE_SIZE)

    def token_inputs(
        self, ids: np.ndarray, start: int = 0, table: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """The inputs of the model block for one sequence's token `ids` at positions start..,
        its pages `table` (default: pages 0, 1, ... in order); no row sampled (every row's
        temperature below 0; set a row of `sampling` and `seed` to draw one)."""
        m = len(ids)
        row = np.arange(self.table_pages, dtype=np.int32) if table is None else table
        return {
            "ids": np.asarray(ids, np.int32),
            "pos": np.arange(start, start + m, dtype=np.int32),
            "pages": np.tile(np.asarray(row, np.int32), (m, 1)),
            "sampling": np.tile(UNSAMPLED, (m, 1)),
            "seed": np.zeros(m, np.int32),
        }

    def inputs(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The inputs of a block that starts at activations x [M, hidden]: x itself and, for
        blocks with attention, positions 0..M-1 (a fresh sequence)."""
        out = {"x": x}
        if "pos" in self.graph:
            capacity = self.max_seq
            if len(x) > capacity:
                raise UsageError(
                    f"{len(x)} rows are {len(x)} positions: past --max-seq {capacity} (the "
                    "KV cache's rows)"
                )
            out["pos"] = np.arange(len(x), dtype=np.int32)
        return out


# A sample op's params row that draws nothing (qir.sampling: temperature below 0).
UNSAMPLED = np.array([-1.0, 0.0, 1.0, 0.0], np.float32)


class _Builder:
    """One block's Builder with the checkpoint it reads and the weights it collects."""

    def __init__(
        self, ck: Checkpoint, name: str, act: DType, max_seq: int = 0, kv_pages: int = 0
    ) -> None:
        self.ck, self.act, self.max_seq, self.kv_pages = ck, act, max_seq, kv_pages
        self.b = Builder(name)
        self.weights: Weights = {}
        self.pages: Value | None = None  # the block table input, once a paged layer asks

    def block(self) -> Block:
        return Block(self.b.graph, self.weights, self.max_seq, self.kv_pages)

    def linear(self, module: str, name: str) -> Value:
        lin = self.ck.linear(module)
        self.weights[module] = lin.buffers
        rule = lin.weight.format.act_quant_rule(lin.buffers)
        return self.b.weight(module, lin.weight, name=name, act_rule=rule)

    def proj(self, layer: int, proj: str, prefix: str = "") -> Value:
        return self.linear(self.ck.layer_module(layer, proj), f"{prefix}w_{proj}")

    def norm(self, x: Value, module: str, name: str) -> Value:
        key = f"{module}.weight"
        w = self.ck.tensor(key)
        hidden = self.ck.hidden_size
        if w.shape != (hidden,):
            raise FormatError(f"{key}: shape {list(w.shape)}, expected [{hidden}] (hidden_size)")
        self.weights[module] = {"weight": w}
        t = TensorType((hidden,), _param_dtype(w, key))
        p = self.b.param(module, t, name=f"{name}.w")
        return self.b.rms_norm(x, p, self.ck.rms_norm_eps, name=name)

    def qkv(self, x: Value, layer: int, prefix: str = "") -> tuple[Value, Value, Value]:
        q, k, v = (
            self.b.qlinear(x, self.proj(layer, p, prefix), name=f"{prefix}{p}") for p in "qkv"
        )
        return q, k, v

    def mlp(self, x: Value, residual: Value, layer: int, prefix: str = "") -> Value:
        from qir.models.experts import is_moe_layer, moe_mlp

        if is_moe_layer(self.ck, layer):  # routed experts (qir.models.experts)
            return moe_mlp(self, x, residual, layer, prefix)
        b = self.b
        gate = b.qlinear(x, self.proj(layer, "gate", prefix), name=f"{prefix}gate")
        up = b.qlinear(x, self.proj(layer, "up", prefix), name=f"{prefix}up")
        h = b.mul(b.silu(gate, name=f"{prefix}act"), up, name=f"{prefix}h")
        down = b.qlinear(h, self.proj(layer, "down", prefix), name=f"{prefix}down")
        return b.add(residual, down, name=f"{prefix}y")

    def layer(self, x: Value, pos: Value, layer: int, prefix: str = "") -> Value:
        ck, b = self.ck, self.b
        problem = ck.attention_problem()
        if problem:
            raise FormatError(f"{ck.path}/config.json: {problem}")
        rope = ck.rope
        attn = f"model.layers.{layer}.self_attn"
        h = self.norm(x, f"model.layers.{layer}.input_layernorm", f"{prefix}attn_norm")
        q, k, v = self.qkv(h, layer, prefix)
        rows = self.kv_pages * PAGE_SIZE if self.kv_pages else self.max_seq
        cache = TensorType((rows, ck.num_kv_heads, ck.head_dim), self.act)
        kc = b.state(f"{attn}.k_cache", cache, name=f"{prefix}k_cache")
        vc = b.state(f"{attn}.v_cache", cache, name=f"{prefix}v_cache")
        q = b.rope(q, pos, rope, name=f"{prefix}q_rot")
        k = b.rope(k, pos, rope, name=f"{prefix}k_rot")
        paging: dict[str, Any] = {}
        if self.kv_pages:
            if self.pages is None:
                self.pages = b.input("pages", ("M", -(-self.max_seq // PAGE_SIZE)), I32)
            paging = {"pages": self.pages, "page_size": PAGE_SIZE}
        kc, vc = b.kv_append(kc, vc, k, v, pos, name=f"{prefix}kv", **paging)
        a = b.attention(q, kc, vc, pos, ck.head_dim**-0.5, name=f"{prefix}attn", **paging)
        o = b.qlinear(a, self.proj(layer, "o", prefix), name=f"{prefix}o")
        r = b.add(x, o, name=f"{prefix}attn_y")
        hn = self.norm(r, f"model.layers.{layer}.post_attention_layernorm", f"{prefix}mlp_norm")
        return self.mlp(hn, r, layer, prefix)

    def positions(self) -> Value:
        return self.b.input("pos", ("M",), I32)

    def x(self) -> Value:
        return self.b.input("x", ("M", self.ck.hidden_size), self.act)


def _param_dtype(w: np.ndarray, key: str) -> DType:
    for d in ACTIVATION:
        if d.np == w.dtype:
            return d
    raise FormatError(f"{key}: dtype {w.dtype}, expected float16, bfloat16 or float32")


def mlp(ck: Checkpoint, layer: int, act: DType, max_seq: int) -> Block:
    bb = _Builder(ck, "mlp", act)
    x = bb.x()
    bb.b.output("y", bb.mlp(x, x, layer))
    return bb.block()


def qkv(ck: Checkpoint, layer: int, act: DType, max_seq: int) -> Block:
    bb = _Builder(ck, "qkv", act)
    for name, value in zip("qkv", bb.qkv(bb.x(), layer), strict=True):
        bb.b.output(name, value)
    return bb.block()


def o_proj(ck: Checkpoint, layer: int, act: DType, max_seq: int) -> Block:
    bb = _Builder(ck, "o_proj", act)
    b = bb.b
    x = bb.x()
    a = b.input("a", ("M", ck.num_heads * ck.head_dim), act)
    o = b.qlinear(a, bb.proj(layer, "o"), name="o")
    b.output("y", b.add(x, o, name="y"))
    return bb.block()


def norm_qkv(ck: Checkpoint, layer: int, act: DType, max_seq: int) -> Block:
    bb = _Builder(ck, "norm_qkv", act)
    h = bb.norm(bb.x(), f"model.layers.{layer}.input_layernorm", "attn_norm")
    for name, value in zip("qkv", bb.qkv(h, layer), strict=True):
        bb.b.output(name, value)
    return bb.block()


def norm_mlp(ck: Checkpoint, layer: int, act: DType, max_seq: int) -> Block:
    bb = _Builder(ck, "norm_mlp", act)
    x = bb.x()
    h = bb.norm(x, f"model.layers.{layer}.post_attention_layernorm", "mlp_norm")
    bb.b.output("y", bb.mlp(h, x, layer))
    return bb.block()


def layer_block(ck: Checkpoint, layer: int, act: DType, max_seq: int) -> Block:
    bb = _Builder(ck, "layer", act, max_seq)
    x = bb.x()
    bb.b.output("y", bb.layer(x, bb.positions(), layer))
    return bb.block()


def model(ck: Checkpoint, layer: int, act: DType, max_seq: int, kv_pages: int = 0) -> Block:
    """Every layer; `layer` is ignored. The lm_head is embed_tokens' weight when the config ties
    them. The KV caches are paged: a pool of `kv_pages` pages (default: one sequence's)."""
    bb = _Builder(ck, "model", act, max_seq, kv_pages or -(-max_seq // PAGE_SIZE))
    b = bb.b
    ids = b.input("ids", ("M",), I32)
    pos = bb.positions()
    table = bb.linear("model.embed_tokens", "w_embed")
    _check_table(ck, table, "model.embed_tokens")
    h = b.embedding(ids, table, act, name="embed")
    for i in range(ck.num_layers):
        h = bb.layer(h, pos, i, prefix=f"l{i}.")
    h = bb.norm(h, "model.norm", "final_norm")
    head = table if ck.tie_word_embeddings else bb.linear("lm_head", "w_lm_head")
    _check_table(ck, head, "lm_head")
    logits = b.qlinear(h, head, name="logits")
    b.output("logits", logits)
    # The next id per row, drawn on the device (qir.sampling): a decode step hands back 4 bytes.
    params = b.input("sampling", ("M", SAMPLING_PARAMS), F32)
    seed = b.input("seed", ("M",), I32)
    b.output("next", b.sample(logits, params, seed, pos, name="next"))
    return bb.block()


def _check_table(ck: Checkpoint, w: Value, module: str) -> None:
    assert isinstance(w.type, QWeight)
    shape = (w.type.out_features, w.type.in_features)
    if shape != (ck.vocab_size, ck.hidden_size):
        raise FormatError(
            f"{module}.weight: holds a {list(shape)} table, but config.json implies "
            f"[{ck.vocab_size}, {ck.hidden_size}] (vocab_size, hidden_size)"
        )


BlockFn = Callable[..., Block]
BLOCKS: dict[str, BlockFn] = {
    "mlp": mlp,
    "qkv": qkv,
    "o_proj": o_proj,
    "norm_qkv": norm_qkv,
    "norm_mlp": norm_mlp,
    "layer": layer_block,
    "model": model,
}
# Blocks with attention: they take positions and keep a KV cache of max_seq rows per layer.
CACHED = ("layer", "model")


def default_max_seq(ck: Checkpoint) -> int:
    """The config's max_position_embeddings, capped at MAX_SEQ_CAP."""
    return min(ck.max_position_embeddings or MAX_SEQ_CAP, MAX_SEQ_CAP)


def check_max_seq(ck: Checkpoint, max_seq: int | None) -> int:
    """`max_seq`, or the default, checked against the config."""
    if max_seq is None:
        return default_max_seq(ck)
    limit = ck.max_position_embeddings
    if isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 1:
        raise UsageError(f"--max-seq must be a positive int, got {max_seq!r}")
    if limit is not None and max_seq > limit:
        raise UsageError(f"--max-seq {max_seq} is past the model's max_position_embeddings {limit}")
    return max_seq


def build(
    ck: Checkpoint,
    block: str,
    layer: int,
    act: DType | None = None,
    max_seq: int | None = None,
    kv_pages: int | None = None,
) -> Block:
    """`block` of `ck` at decoder layer `layer`; blocks with attention size their KV caches for
    `max_seq` positions (default: default_max_seq); the model block's is a pool of `kv_pages`
    pages of PAGE_SIZE rows (default: one sequence's)."""
    if block not in BLOCKS:
        raise UsageError(f"unknown block {block!r}; choose one of {', '.join(BLOCKS)}")
    if not 0 <= layer < ck.num_layers:
        raise UsageError(
            f"layer {layer} is out of range: the checkpoint has {ck.num_layers} layer(s)"
        )
    seq = check_max_seq(ck, max_seq) if block in CACHED else 0
    if kv_pages is not None:
        if block != "model":
            raise UsageError(f"kv_pages: only the model block's KV cache is paged, not {block}'s")
        if isinstance(kv_pages, bool) or not isinstance(kv_pages, int) or kv_pages < 1:
            raise UsageError(f"kv_pages must be a positive int, got {kv_pages!r}")
        return model(ck, layer, act or ck.act_dtype, seq, kv_pages)
    return BLOCKS[block](ck, layer, act or ck.act_dtype, seq)
