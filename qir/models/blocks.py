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
          next = sample(adjust_logits(logits, penalties, tokens, counts, bias, allow),
                        sampling, seed, pos): each row's next id (qir.sampling, qir.logits);
          logprob_ids, logprobs = logprobs(logits, next, targets): scores (qir.logits)

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
from qir.errors import FormatError, UsageError
from qir.graph import Graph
from qir.logits import ALL_ALLOWED, MAX_BIAS, NO_PENALTIES, SKIP, allow_words
from qir.models.architectures import FEATURES, Features
from qir.models.checkpoint import Checkpoint, default_max_seq
from qir.models.checkpoint_view import Linear
from qir.models.experts import (
    PROJECTIONS,
    Moe,
    gate_act,
    is_moe_layer,
    moe_of,
    read_experts,
    router,
    stack,
)
from qir.ops import MAX_TOP_LOGPROBS, PENALTY_PARAMS, SAMPLING_PARAMS
from qir.types import QWeight, TensorType

# Rows per page of a paged KV cache (vLLM's default block size).
PAGE_SIZE = 16
# A sliding layer's KV cache is a ring of its window plus this many positions less one (where
# that is less than max_seq): one run of a sequence (a prefill chunk) may bring this many rows,
# whose keys are all written before any row reads its window.
PREFILL_CHUNK = 256

Weights = dict[str, dict[str, np.ndarray]]


@dataclass
class Block:
    graph: Graph
    weights: Weights  # weight key (module path) -> kernel-layout buffers
    max_seq: int = 0  # the positions a sequence has room for (0 without attention)
    kv_pages: int = 0  # pages of a paged cache's pool (0: not paged)
    # The positions a sequence's cache holds where less than max_seq (every layer a sliding
    # one, its cache a ring); and the rows one run of a sequence may bring then (0: any).
    room: int = 0
    prefill_chunk: int = 0

    @property
    def table_pages(self) -> int:
        """Pages in a row of the block table: a sequence's max_seq positions, or its ring's."""
        return -(-(self.room or self.max_seq) // PAGE_SIZE)

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
            **self.draw_inputs(m),
        }

    def draw_inputs(self, m: int) -> dict[str, np.ndarray]:
        """The model block's per-row inputs of the draw and the scores for `m` rows: nothing
        drawn (temperature below 0), nothing masked or penalized, nothing scored."""
        entries, words = (self._width(k) for k in ("tokens", "allow"))
        return {
            "sampling": np.tile(UNSAMPLED, (m, 1)),
            "seed": np.zeros((m, 2), np.int32),
            "penalties": np.tile(np.array(NO_PENALTIES, np.float32), (m, 1)),
            "tokens": np.full((m, entries), -1, np.int32),
            "counts": np.zeros((m, entries), np.int32),
            "bias": np.zeros((m, entries), np.float32),
            "allow": np.full((m, words), ALL_ALLOWED, np.int32),
            "targets": np.full(m, SKIP, np.int32),
        }

    def _width(self, input_name: str) -> int:
        t = self.graph.node(input_name).type
        assert isinstance(t, TensorType) and isinstance(t.shape[1], int)
        return t.shape[1]

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
            if self.prefill_chunk and len(x) > self.prefill_chunk:
                raise UsageError(
                    f"{len(x)} rows in one run: a sliding layer's ring takes at most "
                    f"{self.prefill_chunk} (its window plus the prefill chunk)"
                )
            out["pos"] = np.arange(len(x), dtype=np.int32)
        return out


# What the builder implements of the features a family may use (qir.models.architectures);
# a checkpoint using another is refused in one line naming its config field.
SUPPORTED: frozenset[str] = frozenset(
    {
        "bias",
        "qk_norm",
        "sliding_window",
        "fused_linears",
        "norm_plus_one",
        "post_norms",
        "embed_scale",
        "attention_scale",
        "local_rope",
        "final_softcap",
        "attn_softcap",
        "sinks",
    }
)
# The MLP activations (config names) and the op each is.
ACTIVATION_OPS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ACTIVATIONS = tuple(ACTIVATION_OPS)


def checked(ck: Checkpoint, only: tuple[str, ...] | None = None) -> Features:
    """`ck`'s layer features, refusing the first one (of `only`, default all) that the builder
    does not implement."""
    f = ck.features
    if f.activation.value not in ACTIVATIONS and (only is None or "activation" in only):
        raise FormatError(
            f"{ck.path}/config.json: {f.activation.refusal()} (supported: {', '.join(ACTIVATIONS)})"
        )
    use = f.unsupported(SUPPORTED | frozenset(() if only is None else FEATURES.keys() - only))
    if use is not None:
        raise FormatError(f"{ck.path}/config.json: {use.refusal()}")
    return f


# A sample op's params row that draws nothing (qir.sampling: temperature below 0).
UNSAMPLED = np.array([-1.0, 0.0, 1.0, 0.0], np.float32)


class _Builder:
    """One block's Builder with the checkpoint it reads and the weights it collects."""

    def __init__(
        self,
        ck: Checkpoint,
        name: str,
        act: DType,
        max_seq: int = 0,
        kv_pages: int = 0,
        chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.ck, self.act, self.max_seq, self.kv_pages = ck, act, max_seq, kv_pages
        self.b = Builder(name)
        self.weights: Weights = {}
        self.pages: Value | None = None  # the block table input, once a paged layer asks
        self.chunk = chunk
        # A paged block's sequences hold this many positions (its block table's pages) where
        # every layer slides (a ring of pages); 0: max_seq.
        self.room = 0
        self.run_rows = 0  # rows one run of a sequence may bring (0: any)

    def block(self) -> Block:
        return Block(
            self.b.graph, self.weights, self.max_seq, self.kv_pages, self.room, self.run_rows
        )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, where it hides any position of max_seq."""
        w = self.ck.features.windows[layer]
        return w if w is not None and w < self.max_seq else None

    def ring(self, window: int) -> int:
        """The positions a sliding layer's (unpaged) cache holds."""
        return min(self.max_seq, window + self.chunk - 1)

    def linear(self, module: str, name: str) -> Value:
        lin = self.ck.linear(module)
        self.weights[module] = lin.buffers
        rule = lin.weight.format.act_quant_rule(lin.buffers)
        return self.b.weight(module, lin.weight, name=name, act_rule=rule)

    def proj(self, layer: int, proj: str, prefix: str = "") -> Value:
        return self.linear(self.ck.layer_module(layer, proj), f"{prefix}w_{proj}")

    def norm(self, x: Value, module: str, name: str, size: int = 0) -> Value:
        """RMSNorm of x by `module`'s weight: of whole rows (hidden_size), or with `size`
        (head_dim) of each head."""
        checked(self.ck, ("norm_plus_one",))
        key = f"{module}.weight"
        w = self.ck.tensor(key)
        n, what = (size, "head_dim") if size else (self.ck.hidden_size, "hidden_size")
        if w.shape != (n,):
            raise FormatError(f"{key}: shape {list(w.shape)}, expected [{n}] ({what})")
        dtype = _param_dtype(w, key)
        if self.ck.features.arch.norm == "x*(1+w)":
            # Gemma stores offsets from 1 and scales by (1 + w) in float32: 1 + w folded here in
            # float32 is that factor exactly, so the norm is the plain x * w one.
            w, dtype = np.float32(1) + w.astype(np.float32), F32
        self.weights[module] = {"weight": w}
        t = TensorType((n,), dtype)
        p = self.b.param(module, t, name=f"{name}.w")
        return self.b.rms_norm(x, p, self.ck.rms_norm_eps, name=name)

    def qkv(self, x: Value, layer: int, prefix: str = "") -> tuple[Value, Value, Value]:
        checked(self.ck, ("fused_linears",))
        q, k, v = (
            self.b.qlinear(x, self.proj(layer, p, prefix), name=f"{prefix}{p}") for p in "qkv"
        )
        return q, k, v

    def mlp(self, x: Value, residual: Value, layer: int, prefix: str = "") -> Value:
        if is_moe_layer(self.ck, layer):  # routed experts (qir.models.experts)
            return _moe_mlp(self, x, residual, layer, prefix)

        f = checked(self.ck, ("activation", "fused_linears", "post_norms"))
        b = self.b
        gate = b.qlinear(x, self.proj(layer, "gate", prefix), name=f"{prefix}gate")
        up = b.qlinear(x, self.proj(layer, "up", prefix), name=f"{prefix}up")
        act = getattr(b, ACTIVATION_OPS[f.activation.value])(gate, name=f"{prefix}act")
        h = b.mul(act, up, name=f"{prefix}h")
        down = b.qlinear(h, self.proj(layer, "down", prefix), name=f"{prefix}down")
        if f.arch.post_norms:
            module = f"model.layers.{layer}.post_feedforward_layernorm"
            down = self.norm(down, module, f"{prefix}ffn_post_norm")
        return b.add(residual, down, name=f"{prefix}y")

    def attn_out(self, x: Value, a: Value, layer: int, prefix: str = "") -> Value:
        """x + o_proj(a), the projection normed first where the family has post-norms."""
        o = self.b.qlinear(a, self.proj(layer, "o", prefix), name=f"{prefix}o")
        if checked(self.ck, ("post_norms",)).arch.post_norms:
            module = f"model.layers.{layer}.post_attention_layernorm"
            o = self.norm(o, module, f"{prefix}attn_post_norm")
        return self.b.add(x, o, name=f"{prefix}attn_y")

    def mlp_norm(self, x: Value, layer: int, prefix: str = "") -> Value:
        """The norm before the MLP: Gemma's pre_feedforward_layernorm (its
        post_attention_layernorm is attention's post-norm), the others' post_attention_layernorm."""
        post = checked(self.ck, ("post_norms",)).arch.post_norms
        which = "pre_feedforward_layernorm" if post else "post_attention_layernorm"
        return self.norm(x, f"model.layers.{layer}.{which}", f"{prefix}mlp_norm")

    def layer(self, x: Value, pos: Value, layer: int, prefix: str = "") -> Value:
        ck, b = self.ck, self.b
        f = checked(ck)
        attn = f"model.layers.{layer}.self_attn"
        h = self.norm(x, f"model.layers.{layer}.input_layernorm", f"{prefix}attn_norm")
        q, k, v = self.qkv(h, layer, prefix)
        if f.arch.qk_norm:  # per head, before RoPE (fold_head_norm moves them into its readers)
            q = self.norm(q, f"{attn}.q_norm", f"{prefix}q_norm", ck.head_dim)
            k = self.norm(k, f"{attn}.k_norm", f"{prefix}k_norm", ck.head_dim)
        window = self.window(layer)
        rope = ck.rope_of(sliding=f.windows[layer] is not None, positions=self.max_seq)
        if self.kv_pages:
            rows, room = self.kv_pages * PAGE_SIZE, (self.room or self.max_seq)
            room = -(-room // PAGE_SIZE) * PAGE_SIZE
        else:
            rows = room = self.ring(window) if window else self.max_seq
        if window and room < self.max_seq:  # a ring: one run's rows must not lap it
            fits = room - window + 1
            self.run_rows = min(self.run_rows or fits, fits)
        cache = TensorType((rows, ck.num_kv_heads, ck.head_dim), self.act)
        kc = b.state(f"{attn}.k_cache", cache, name=f"{prefix}k_cache")
        vc = b.state(f"{attn}.v_cache", cache, name=f"{prefix}v_cache")
        q = b.rope(q, pos, rope, name=f"{prefix}q_rot")
        k = b.rope(k, pos, rope, name=f"{prefix}k_rot")
        paging: dict[str, Any] = {"window": window}
        if self.kv_pages:
            if self.pages is None:
                self.pages = b.input("pages", ("M", room // PAGE_SIZE), I32)
            paging.update(pages=self.pages, page_size=PAGE_SIZE)
        kc, vc = b.kv_append(kc, vc, k, v, pos, name=f"{prefix}kv", **paging)
        cap = f.value("attn_softcap")  # Gemma 2: scores tanh(s / cap) * cap before the softmax
        sinks = self.sinks(layer, prefix) if f.arch.sinks else None
        a = b.attention(
            q,
            kc,
            vc,
            pos,
            f.attention_scale,
            name=f"{prefix}attn",
            softcap=cap,
            sinks=sinks,
            **paging,
        )
        r = self.attn_out(x, a, layer, prefix)
        return self.mlp(self.mlp_norm(r, layer, prefix), r, layer, prefix)

    def sinks(self, layer: int, prefix: str = "") -> Value:
        """gpt-oss's attention sinks of `layer`: a logit per query head, widened to f32."""
        module = f"model.layers.{layer}.self_attn.sinks"
        w = self.ck.tensor(module)
        heads = self.ck.num_heads
        if w.shape != (heads,):
            raise FormatError(
                f"{module}: shape {list(w.shape)}, expected [{heads}] (num_attention_heads)"
            )
        _param_dtype(w, module)  # a float tensor (refused in one line otherwise)
        self.weights[module] = {"weight": w.astype(np.float32)}
        return self.b.param(module, TensorType((heads,), F32), name=f"{prefix}sinks")

    def positions(self) -> Value:
        return self.b.input("pos", ("M",), I32)

    def x(self) -> Value:
        return self.b.input("x", ("M", self.ck.hidden_size), self.act)


def _shaped(lin: Linear, want: tuple[int, int], fields: str) -> Linear:
    got = (lin.weight.out_features, lin.weight.in_features)
    if got != want:
        raise FormatError(
            f"{lin.module}.weight: holds a {list(got)} linear, but config.json implies "
            f"{list(want)} ({fields})"
        )
    return lin


def _shared_expert(
    bb: _Builder, moe: Moe, x: Value, residual: Value, layer: int, prefix: str
) -> Value:
    """residual + sigmoid(x g^T) * the shared expert's MLP of x (qir.models.experts' docstring)."""
    ck, b, fam = bb.ck, bb.b, moe.architecture
    base = f"model.layers.{layer}"
    hidden, size = ck.hidden_size, moe.shared
    fields = f"hidden_size, {fam.shared_key}"
    gate_lin = _shaped(ck.linear(f"{base}.{fam.shared_gate}"), (1, hidden), "1, hidden_size")
    bb.weights[gate_lin.module] = gate_lin.buffers
    w_gate = b.weight(gate_lin.module, gate_lin.weight, name=f"{prefix}w_shared_expert_gate")
    logit = b.qlinear(x, w_gate, name=f"{prefix}shared_expert_gate")
    ids, weight = b.route(logit, 1, "sigmoid_topk", name=f"{prefix}shared_route")
    mlp = f"{base}.{fam.shared}"
    proj = {}
    for name in ("gate", "up"):
        lin = _shaped(
            ck.linear(f"{mlp}.{name}_proj"), (size, hidden), f"{fam.shared_key}, hidden_size"
        )
        bb.weights[lin.module] = lin.buffers
        proj[name] = b.qlinear(
            x,
            b.weight(lin.module, lin.weight, name=f"{prefix}w_shared_{name}"),
            name=f"{prefix}shared_{name}",
        )
    act = ACTIVATION_OPS[checked(ck, ("activation",)).activation.value]
    h = b.mul(
        getattr(b, act)(proj["gate"], name=f"{prefix}shared_act"),
        proj["up"],
        name=f"{prefix}shared_h",
    )
    down = _shaped(ck.linear(f"{mlp}.down_proj"), (hidden, size), fields)
    if down.weight.bias:  # it runs on the expert kernels, which add none
        raise FormatError(f"{down.module}.bias: a shared expert's down_proj bias is not supported")
    qe, bufs = stack([down])
    bb.weights[down.module] = bufs
    w_down = b.weight(down.module, qe, name=f"{prefix}w_shared_down")
    return b.expert_qlinear(h, w_down, ids, weight, residual, name=f"{prefix}shared_y")


def _moe_mlp(bb: _Builder, x: Value, residual: Value, layer: int, prefix: str = "") -> Value:
    """residual + the layer's MoE MLP of x (qir.models.experts' docstring)."""
    ck, b = bb.ck, bb.b
    moe = moe_of(ck)
    assert moe is not None
    lin = router(ck, moe, layer)
    bb.weights[lin.module] = lin.buffers
    w_router = b.weight(lin.module, lin.weight, name=f"{prefix}w_router")
    logits = b.qlinear(x, w_router, name=f"{prefix}router")
    ids, weights = b.route(logits, moe.top_k, moe.rule, name=f"{prefix}route")
    ws = {}
    for proj in PROJECTIONS:
        key, qe, bufs = read_experts(ck, moe, layer, proj)
        bb.weights[key] = bufs
        ws[proj] = b.weight(key, qe, name=f"{prefix}w_experts_{proj}")
    if moe.shared:  # the routed experts' combine adds it with the residual
        residual = _shared_expert(bb, moe, x, residual, layer, prefix)
    h = b.expert_qlinear(
        x, (ws["gate"], ws["up"]), ids, name=f"{prefix}experts_h", act=gate_act(ck, moe)
    )
    return b.expert_qlinear(h, ws["down"], ids, weights, residual, name=f"{prefix}y")


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
    b.output("y", bb.attn_out(x, a, layer))
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
    bb.b.output("y", bb.mlp(bb.mlp_norm(x, layer), x, layer))
    return bb.block()


def layer_block(
    ck: Checkpoint, layer: int, act: DType, max_seq: int, chunk: int = PREFILL_CHUNK
) -> Block:
    bb = _Builder(ck, "layer", act, max_seq, chunk=chunk)
    x = bb.x()
    bb.b.output("y", bb.layer(x, bb.positions(), layer))
    return bb.block()


def model(
    ck: Checkpoint,
    layer: int,
    act: DType,
    max_seq: int,
    kv_pages: int = 0,
    chunk: int = PREFILL_CHUNK,
) -> Block:
    """Every layer; `layer` is ignored. The lm_head is embed_tokens' weight when the config ties
    them. The KV caches are paged: a pool of `kv_pages` pages (default: one sequence's). Where
    every layer slides by one window (Mistral), a sequence's block table is a ring of the
    pages its window and a prefill chunk take, not max_seq's."""
    windows = {w if w is not None and w < max_seq else None for w in ck.features.windows}
    room = 0
    if len(windows) == 1 and (w := next(iter(windows))) is not None:
        room = -(-(w + chunk - 1) // PAGE_SIZE) * PAGE_SIZE
        room = room if room < max_seq else 0
    pages = -(-(room or max_seq) // PAGE_SIZE)
    bb = _Builder(ck, "model", act, max_seq, kv_pages or pages, chunk)
    bb.room = room
    b = bb.b
    ids = b.input("ids", ("M",), I32)
    pos = bb.positions()
    table = bb.linear("model.embed_tokens", "w_embed")
    _check_table(ck, table, "model.embed_tokens")
    f = checked(ck, ("embed_scale", "final_softcap"))
    # Gemma: sqrt(hidden_size) rounded to the activation dtype (transformers' embed_scale)
    scale = (
        float(np.asarray(ck.hidden_size**0.5, np.float32).astype(act.np))
        if f.arch.embed_scale
        else None
    )
    h = b.embedding(ids, table, act, name="embed", scale=scale)
    for i in range(ck.num_layers):
        h = bb.layer(h, pos, i, prefix=f"l{i}.")
    h = bb.norm(h, "model.norm", "final_norm")
    head = table if ck.tie_word_embeddings else bb.linear("lm_head", "w_lm_head")
    _check_table(ck, head, "lm_head")
    logits = b.qlinear(h, head, name="logits")
    cap = f.value("final_softcap")
    if cap is not None:  # tanh(logits / cap) * cap before they are handed back or sampled
        logits = b.softcap(logits, float(cap), name="capped")
    b.output("logits", logits)
    # The next id per row, drawn on the device (qir.sampling) from the logits each sequence's
    # restrictions and penalties leave (qir.logits): a decode step hands back 4 bytes, and the
    # scores a client asked for.
    vocab, entries = ck.vocab_size, min(max_seq, ck.vocab_size) + MAX_BIAS
    adjusted = b.adjust_logits(
        logits,
        b.input("penalties", ("M", PENALTY_PARAMS), F32),
        b.input("tokens", ("M", entries), I32),
        b.input("counts", ("M", entries), I32),
        b.input("bias", ("M", entries), F32),
        b.input("allow", ("M", allow_words(vocab)), I32),
        name="adjusted",
    )
    params = b.input("sampling", ("M", SAMPLING_PARAMS), F32)
    seed = b.input("seed", ("M", 2), I32)
    drawn = b.sample(adjusted, params, seed, pos, name="next")
    b.output("next", drawn)
    targets = b.input("targets", ("M",), I32)
    top = min(MAX_TOP_LOGPROBS, vocab)
    scored_ids, scores = b.logprobs(logits, drawn, targets, top, name="scores")
    b.output("logprob_ids", scored_ids)
    b.output("logprobs", scores)
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
    prefill_chunk: int | None = None,
) -> Block:
    """`block` of `ck` at decoder layer `layer`; blocks with attention size their KV caches for
    `max_seq` positions (default: default_max_seq); the model block's is a pool of `kv_pages`
    pages of PAGE_SIZE rows (default: one sequence's). A sliding layer's cache is a ring of its
    window plus `prefill_chunk` (default PREFILL_CHUNK) positions less one, where that is less
    than max_seq; runs of a sequence then take at most Block.prefill_chunk rows."""
    if block not in BLOCKS:
        raise UsageError(f"unknown block {block!r}; choose one of {', '.join(BLOCKS)}")
    if not 0 <= layer < ck.num_layers:
        raise UsageError(
            f"layer {layer} is out of range: the checkpoint has {ck.num_layers} layer(s)"
        )
    seq = check_max_seq(ck, max_seq) if block in CACHED else 0
    ring: dict[str, int] = {}
    if prefill_chunk is not None:
        if block not in CACHED:
            raise UsageError(f"prefill_chunk: the {block} block keeps no KV cache")
        if (
            isinstance(prefill_chunk, bool)
            or not isinstance(prefill_chunk, int)
            or prefill_chunk < 1
        ):
            raise UsageError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        ring["chunk"] = prefill_chunk
    if kv_pages is not None:
        if block != "model":
            raise UsageError(f"kv_pages: only the model block's KV cache is paged, not {block}'s")
        if isinstance(kv_pages, bool) or not isinstance(kv_pages, int) or kv_pages < 1:
            raise UsageError(f"kv_pages must be a positive int, got {kv_pages!r}")
        return model(ck, layer, act or ck.act_dtype, seq, kv_pages, **ring)
    return BLOCKS[block](ck, layer, act or ck.act_dtype, seq, **ring)
