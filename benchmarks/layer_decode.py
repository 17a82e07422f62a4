"""The decode step of a whole decoder layer at Llama-3-8B shapes (hidden 4096, intermediate
14336, 32 query and 8 key/value heads of 128, Llama 3 RoPE), fused into one captured block,
beside its sub-blocks (norm_qkv, the attention core, o_proj, norm_mlp) captured and run one by
one; on a GPU also the tokens/s of a whole synthetic model (--layers, default 32) decoding one
token per step, and its launches per token.

    python benchmarks/layer_decode.py [--backend cuda|host] [--format mlx4g64bf16]
        [--position 1024] [--max-seq 2048] [--layers 32] [--repeat 15] [--scale 1.0]

Weights are random quantized 64-row tiles repeated (llama_shapes.tiled_weight); the cache holds
whatever it holds: values do not change the speed of these kernels. Each figure is the median
of --repeat wall-clock replays of a capture (a CUDA graph on the GPU), each waited for. The
host backend defaults to --scale 1/16 (heads and widths shrink, head_dim stays 128) and one
layer, to finish in a minute; its times are CPU emulation, useful only side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path

import llama_shapes

import qir
from qir.builder import Builder
from qir.dtypes import BF16, I32
from qir.formats.base import WeightFormat
from qir.models import Model
from qir.models.blocks import Block, build
from qir.models.checkpoint import Checkpoint, Linear
from qir.models.quant_conventions import QuantConvention
from qir.runtime.backend import best_backend
from qir.sampling import Sampling
from qir.types import TensorType

LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
FORMATS = {fmt.tag(): fmt for fmt in llama_shapes.FORMATS}
SUB_BLOCKS = ("norm_qkv", "attention", "o_proj", "norm_mlp")


class SyntheticCheckpoint(Checkpoint):
    """Llama-3-8B's config (scaled) with random tiled weights: one set of buffers per shape,
    shared by every layer in host memory (each layer still gets its own device copy)."""

    def __init__(self, fmt: WeightFormat, layers: int, scale: float) -> None:
        cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
        for key in ("hidden_size", "intermediate_size", "vocab_size"):
            cfg[key] = max(128, round(cfg[key] * scale / 128) * 128)
        for key in ("num_attention_heads", "num_key_value_heads"):
            cfg[key] = max(1, round(cfg[key] * scale))
        convention = QuantConvention("synthetic", lambda c: True, lambda ck, m: self.linear(m))
        self.path = Path(f"<synthetic {fmt.tag()}>")
        self.config, self.convention, self.fmt = cfg, convention, fmt
        self.store: Any = {}  # no tensors: attention_problem finds no biases
        self._buffers: dict[tuple[int, int], Linear] = {}

    def linear(self, module: str) -> Linear:
        if module in ("model.embed_tokens", "lm_head"):
            shape = (self.vocab_size, self.hidden_size)
        else:
            want = self.expected_shape(module)
            assert want is not None, module
            shape = want
        if shape not in self._buffers:
            qw, bufs = llama_shapes.tiled_weight(np.random.default_rng(0), self.fmt, *shape)
            self._buffers[shape] = Linear(module, qw, bufs)
        lin = self._buffers[shape]
        return Linear(module, lin.weight, lin.buffers)

    def tensor(self, name: str) -> np.ndarray:
        return np.ones(self.hidden_size, BF16.np)  # the norms' weights


def attention_core(ck: Checkpoint, max_seq: int) -> Block:
    """The layer's part between q/k/v and o_proj: RoPE, KV append, attention."""
    b = Builder("attention")
    act, d, kv = ck.act_dtype, ck.head_dim, ck.num_kv_heads
    q = b.input("q", ("M", ck.num_heads * d), act)
    k = b.input("k", ("M", kv * d), act)
    v = b.input("v", ("M", kv * d), act)
    pos = b.input("pos", ("M",), I32)
    cache = TensorType((max_seq, kv, d), act)
    kc, vc = b.state("k_cache", cache), b.state("v_cache", cache)
    kc, vc = b.kv_append(kc, vc, b.rope(k, pos, ck.rope), v, pos)
    b.output("y", b.attention(b.rope(q, pos, ck.rope), kc, vc, pos))
    return Block(b.graph, {})


@dataclass
class Timed:
    name: str
    launches: int
    ms: float


def median_ms(step: Callable[[], object], sync: Callable[[], None], repeat: int) -> float:
    step()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_step(block: Block, backend: str, position: int, repeat: int) -> Timed:
    """One row at `position`, replayed from a capture."""
    c = qir.compile(block.graph, block.weights, backend=backend)
    rng = np.random.default_rng(1)
    inputs = {}
    for name in block.graph.inputs:
        t = block.graph.node(name).type
        assert isinstance(t, TensorType)
        inputs[name] = (
            np.array([position], np.int32)
            if t.dtype == I32
            else rng.standard_normal((1, *t.shape[1:])).astype(t.dtype.np)  # type: ignore[misc]
        )
    step = c.capture(1)
    step(inputs)
    assert c._exec is not None
    ms = median_ms(step, c._exec.backend.synchronize, repeat)
    return Timed(block.graph.name, c.launches_for(1), ms)


def main(argv: Sequence[str] | None = None) -> list[Timed]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None, help="host or cuda (default: best available)")
    ap.add_argument("--format", default="mlx4g64bf16", choices=sorted(FORMATS))
    ap.add_argument("--position", type=int, default=1024, help="the decoded token's position")
    ap.add_argument("--max-seq", type=int, default=2048, help="KV cache rows")
    ap.add_argument("--layers", type=int, default=None, help="model layers (cuda; default 32)")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--scale", type=float, default=None, help="default 1 on cuda, 1/16 on host")
    args = ap.parse_args(argv)
    backend = args.backend or best_backend()
    scale = args.scale or (1.0 if backend == "cuda" else 1 / 16)
    if not 0 <= args.position < args.max_seq:
        ap.error(f"--position {args.position} must be below --max-seq {args.max_seq}")
    ck = SyntheticCheckpoint(FORMATS[args.format], 1, scale)
    print(
        f"backend {backend}, {args.format}, hidden {ck.hidden_size}, {ck.num_heads} heads on "
        f"{ck.num_kv_heads}, position {args.position} of {args.max_seq}; median of "
        f"{args.repeat} replays"
    )
    rows = [
        decode_step(build(ck, "layer", 0, None, args.max_seq), backend, args.position, args.repeat)
    ]
    for name in SUB_BLOCKS:
        block = (
            attention_core(ck, args.max_seq)
            if name == "attention"
            else build(ck, name, 0, None, args.max_seq)
        )
        rows.append(decode_step(block, backend, args.position, args.repeat))
    parts = sum(r.ms for r in rows[1:])
    print(f"{'block':10} {'launches':>8} {'ms':>9}")
    for r in rows:
        print(f"{r.name:10} {r.launches:>8} {r.ms:>9.3f}")
    print(
        f"layer vs its {len(SUB_BLOCKS)} sub-blocks one by one: {rows[0].ms:.3f} ms vs "
        f"{parts:.3f} ms ({sum(r.launches for r in rows[1:])} launches): {parts / rows[0].ms:.2f}x"
    )
    layers = args.layers if args.layers is not None else (32 if backend == "cuda" else 0)
    if layers:
        model_ck = SyntheticCheckpoint(FORMATS[args.format], layers, scale)
        model = Model(model_ck, backend=backend, max_seq=args.max_seq)
        step = model.compiled.capture(1)
        ids = model.block.token_inputs(np.array([1]), args.position)
        ids["sampling"][0] = Sampling(temperature=1.0, top_k=50).row()  # the step also draws
        step(ids)
        assert model.compiled._exec is not None
        ms = median_ms(lambda: step(ids), model.compiled._exec.backend.synchronize, args.repeat)
        rows.append(Timed(f"model x{layers}", model.compiled.launches_for(1), ms))
        print(
            f"model of {layers} layers: {1e3 / ms:.1f} tokens/s ({ms:.3f} ms per token), "
            f"{rows[-1].launches} launches per token"
        )
    return rows


if __name__ == "__main__":
    main()
