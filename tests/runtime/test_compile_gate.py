"""The compile gate: one list of the distinct kernels qir emits (GATE), each lowered for and built
by NVRTC once per target arch (so sm_100a/sm_120a build their FP4-conversion variants and
sm_120a its block-scaled FP4 GEMMs: qir.target), with no spills, a cubin, and ptxas' registers
within the register file. The figures are ptxas' own, the ones `nvcc -Xptxas -v` prints for the
dumped .cu (tests/runtime/test_nvrtc.py compares them).

What makes two kernels distinct here is what can change ptxas' register allocation:
- the family and its template (GEMV, each GEMM tile, quantize_act, the layer kernels, ...);
- the format's dequant fragment and the code path it takes (MLX codes straddling words or not,
  2-bit rows per warp, AWQ's nibble order, GPTQ act-order's float path, FP8 per row or tensor
  and per 128 x 128 block, MX, NVFP4 W4A16 and W4A4, dense weights);
- the fusion (gate/up pair with silu(g) * u, residual, merged outputs, silu and RMSNorm
  prologues, W4A4's activation modes, unfused) and the activation dtype (f32 takes the GEMV's
  float path, bf16 its own pair type);
- the shapes where spills appear: a GEMV's loop over K is unrolled by ptxas, so GEMVs are
  built at Llama-3-8B's K (4096 and 14336) and at a checkpoint's (512 and 1408: issue 14's W4A4
  down projection spilled there); a GEMM's K loop is `#pragma unroll 1` (K-independent code)
  and its tile follows N: 64 x 64 and 128 x 128 at Llama's N, 64 x 32 and 128 x 64 below 4096.
Bit widths, group sizes and scale dtypes beyond those pick constants, not code paths; the host
tests (test_every_format, test_gemm_kernels) run every format of FORMAT_ZOO.

The GEMVs of most formats sit at their register cap on sm_100a/sm_120a (168 = 64K / (128
threads x 3 blocks)), the GEMMs well below 255: so every entry is built for every arch.

Adding a kernel: one entry in GATE, a name and a function from the target arch to the kernels
(`graph(...)` lowers a graph the way `qir compile` does). `must` lists name fragments the
entry's kernels must contain, so an entry that silently stops producing its kernel fails.
Kernels an earlier entry already has are built once. Every kernel template must be reached by
some entry (test_every_template_is_gated)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from qir.builder import Builder
from qir.codegen.gemv import for_target
from qir.codegen.kernel import Kernel
from qir.codegen.layer_kernels import (
    AttentionSpec,
    CacheShape,
    HeadNorm,
    RopeSpec,
    adjust_logits_kernel,
    attention_combine_kernel,
    attention_prefill_kernel,
    attention_split_kernel,
    kv_append_kernel,
    logprobs_kernel,
    rms_norm_kernel,
    rope_kernel,
    sample_kernel,
)
from qir.codegen.lower import lower
from qir.codegen.moe import ExpertGemvSpec, expert_gemv_kernel
from qir.codegen.plan import Launch
from qir.dtypes import BF16, F16, F32, DType
from qir.formats.awq import Awq
from qir.formats.base import WeightFormat
from qir.formats.ct_int import CtInt
from qir.formats.dense import Dense
from qir.formats.fp8 import Fp8
from qir.formats.fp8_block import Fp8Block
from qir.formats.ggml import Ggml
from qir.formats.ggml_blocks import SPECS
from qir.formats.gptq import Gptq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4, Mxfp8
from qir.formats.nvfp4 import Nvfp4
from qir.graph import Graph
from qir.logits import MAX_BIAS
from qir.models import load
from qir.models.blocks import build
from qir.ops import MAX_TOP_LOGPROBS, W4A4_MAX_M
from qir.passes.manager import PassOptions, run_pipeline
from qir.runtime import nvrtc
from qir.target import Target
from qir.types import QExperts, QWeight, TensorType
from tests import ptxas_record
from tests.conftest import DATA, FORMAT_ZOO
from tests.moe_common import moe_graph
from tests.requires import requires

pytestmark = requires("nvrtc")

TEMPLATES = Path(__file__).parents[2] / "qir" / "codegen" / "templates"


@dataclass(frozen=True)
class Shapes:
    hidden: int
    inter: int
    kv: int  # k and v projections' rows


LLAMA3_8B = Shapes(4096, 14336, 1024)
CHECKPOINT = Shapes(512, 1408, 128)


def mlp(
    fmt: WeightFormat,
    s: Shapes,
    act: DType = F16,
    gate_act: str = "silu",
    up: WeightFormat | None = None,
) -> Graph:
    """gate/up paired (silu(g) * u epilogue, or gate_act's) at K = hidden, down + residual at
    K = inter; `up`: the up projection's format where it is not the others'."""
    b = Builder("mlp")
    x = b.input("x", ("M", s.hidden), act)
    ws = {
        n: b.weight(n, QWeight(up if n == "up" and up else fmt, o, i), name=f"w_{n}")
        for n, (o, i) in {
            "gate": (s.inter, s.hidden),
            "up": (s.inter, s.hidden),
            "down": (s.hidden, s.inter),
        }.items()
    }
    h = b.mul(getattr(b, gate_act)(b.qlinear(x, ws["gate"])), b.qlinear(x, ws["up"]))
    b.output("y", b.add(x, b.qlinear(h, ws["down"])))
    return b.graph


def qkv(fmt: WeightFormat, s: Shapes, act: DType = F16, bias: bool = False) -> Graph:
    """q, k and v merged into one launch of three outputs (biased as Qwen2's: the bias joins
    the sums after the warp reduction)."""
    b = Builder("qkv")
    x = b.input("x", ("M", s.hidden), act)
    for n, o in {"q": s.hidden, "k": s.kv, "v": s.kv}.items():
        w = b.weight(n, QWeight(fmt, o, s.hidden, bias=bias), name=f"w_{n}")
        b.output(n, b.qlinear(x, w))
    return b.graph


def prologue_mlp(
    gate: WeightFormat, up: WeightFormat, down: WeightFormat, s: Shapes, gate_act: str = "silu"
) -> Graph:
    """gate and up that do not pair (up reads x + x, not the gate's x): silu(g) * u (or
    gate_act's) is down_proj's prologue."""
    b = Builder("prologue")
    x = b.input("x", ("M", s.hidden), F16)
    g = b.qlinear(x, b.weight("gate", QWeight(gate, s.inter, s.hidden), name="w_gate"))
    u = b.qlinear(b.add(x, x), b.weight("up", QWeight(up, s.inter, s.hidden), name="w_up"))
    w = b.weight("down", QWeight(down, s.hidden, s.inter), name="w_down")
    b.output("y", b.qlinear(b.mul(getattr(b, gate_act)(g), u), w))
    return b.graph


def one(fmt: WeightFormat, n: int, k: int, act: DType = F16) -> Graph:
    b = Builder("one")
    x = b.input("x", ("M", k), act)
    b.output("y", b.qlinear(x, b.weight("w", QWeight(fmt, n, k), name="w_w")))
    return b.graph


def graph(
    make: Callable[[], Graph],
    keep: Callable[[Launch], bool] = lambda launch: True,
    passes: str = "default",
) -> Callable[[str], list[Kernel]]:
    """The kernels `qir compile --arch` plans for a graph (those of the launches `keep`
    accepts)."""

    def kernels(arch: str) -> list[Kernel]:
        passed, _ = run_pipeline(make(), passes, options=PassOptions())
        launches = lower(passed, target=Target(arch)).launches
        return [la.kernel for la in launches if keep(la)]

    return kernels


def gemm(la: Launch) -> bool:
    return la.kernel.name.startswith("qgemm_")


def decode_and_res_prefill(la: Launch) -> bool:
    """All but the 16-bit GEMMs of the 64-row bucket and the epilogues other than the residual
    in the 128-row one: per format, the GEMMs differ only in the weight tile's decode, and the
    128-row tiles hold the most accumulators (W4A4's GEMMs, 64-row only, all stay)."""
    name = la.kernel.name
    residual = re.search(r"_res(_sm\w+)?$", name) is not None  # the name ends with the target
    return not gemm(la) or "_a4" in name or (la.when[1] > W4A4_MAX_M and residual)


def model(fixture: str) -> Callable[[str], list[Kernel]]:
    """A fixture's whole model (every layer kernel, embedding, final norm, lm_head, sampler),
    except what other entries build at larger shapes: GEMVs and GEMMs without a norm prologue,
    attention with its small head, the sampler."""

    def keep(la: Launch) -> bool:
        name = la.kernel.name
        if name.startswith(("qgemv_", "qgemm_")):
            return "_rmsnorm_" in name
        # The sampler's code does not depend on the vocabulary: sample-qwen-vocab's.
        return not name.startswith("sample_") and not (name.startswith("attn_") and "_d64_" in name)

    return graph(lambda: build(load(DATA / fixture), "model", 0).graph, keep)


LLAMA3_ROPE = RopeSpec.of(
    {
        "head_dim": 128,
        "theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
)


PLAIN = CacheShape(BF16, 4096, 8, 128)  # a layer block's cache at Llama-3-8B's KV heads
PLAIN_8K = CacheShape(BF16, 8192, 16, 128)  # Gemma-2-27B's


def attention(heads: int) -> Callable[[str], list[Kernel]]:
    """Llama-3's attention kernels (8 KV heads of 128, a 4096-row cache) for `heads` q heads."""
    a = AttentionSpec(PLAIN, heads, 128**-0.5, LLAMA3_ROPE)
    return lambda arch: [
        attention_split_kernel(a),
        attention_combine_kernel(a),
        attention_prefill_kernel(a),
        kv_append_kernel(a.cache, LLAMA3_ROPE),
        rope_kernel(BF16, heads, LLAMA3_ROPE),
    ]


def head_norm_attention() -> Callable[[str], list[Kernel]]:
    """Qwen3-8B's: q/k RMSNorm per head folded into the append and attention's q load, in a
    layer block's cache and a model's paged one, and the unfused per-head norm (--passes none)."""
    rope = RopeSpec.of({"head_dim": 128, "theta": 1000000.0, "rope_type": "default"})
    norm = HeadNorm(BF16, 1e-6)
    paged = CacheShape(BF16, 4096 * 16, 8, 128, page_size=16, table_pages=256)
    specs = [AttentionSpec(c, 32, 128**-0.5, rope, norm) for c in (PLAIN, paged)]
    return lambda arch: [
        *(
            k
            for a in specs
            for k in (
                attention_split_kernel(a),
                attention_prefill_kernel(a),
                kv_append_kernel(a.cache, rope, norm),
            )
        ),
        rms_norm_kernel(BF16, BF16, 128, 1e-6, groups=32),
    ]


def sliding_window_attention() -> Callable[[str], list[Kernel]]:
    """Mistral-7B's (32 heads on 8 of 128, window 4096): a ring of the window plus a prefill
    chunk of 256, unpaged (a layer block) and in pages (a model block)."""
    rope = RopeSpec.of({"head_dim": 128, "theta": 1000000.0, "rope_type": "default"})
    caches = (
        CacheShape(BF16, 4096 + 255, 8, 128, window=4096),
        CacheShape(BF16, 272 * 16 * 4, 8, 128, page_size=16, table_pages=272, window=4096),
    )
    specs = [AttentionSpec(c, 32, 128**-0.5, rope) for c in caches]
    return lambda arch: [
        k
        for a in specs
        for k in (
            kv_append_kernel(a.cache, rope),
            attention_split_kernel(a),
            attention_prefill_kernel(a),
        )
    ]


def softcap_attention(window: int = 0) -> Callable[[str], list[Kernel]]:
    """Gemma-2-27B's (32 heads on 16 of 128, scale 144^-0.5, attn_logit_softcapping 50): a full
    layer's cache, or with `window` a sliding layer's ring (the window plus a prefill chunk)."""
    rope = RopeSpec.of({"head_dim": 128, "theta": 10000.0, "rope_type": "default"})
    cache = CacheShape(BF16, window + 255, 16, 128, window=window) if window else PLAIN_8K
    a = AttentionSpec(cache, 32, 144**-0.5, rope, softcap=50.0)
    return lambda arch: [attention_split_kernel(a), attention_prefill_kernel(a)]


def wide_head_attention() -> Callable[[str], list[Kernel]]:
    """Gemma-3-4B's (8 heads on 4 of 256, q/k norms): a full layer's cache and a sliding one's
    ring of 1024; the prefill's tiles in bf16 so that they fit 48 KB."""
    rope = RopeSpec.of({"head_dim": 256, "theta": 1000000.0, "rope_type": "default"})
    norm = HeadNorm(BF16, 1e-6)
    caches = (CacheShape(BF16, 4096, 4, 256), CacheShape(BF16, 1024 + 255, 4, 256, window=1024))
    specs = [AttentionSpec(c, 8, 256**-0.5, rope, norm) for c in caches]
    return lambda arch: [
        k
        for a in specs
        for k in (
            attention_split_kernel(a),
            attention_combine_kernel(a),
            attention_prefill_kernel(a),
            kv_append_kernel(a.cache, rope, norm),
        )
    ]


def longrope_attention() -> Callable[[str], list[Kernel]]:
    """Phi-3-mini-128k's (32 heads of 96, MHA, a 4096-position cache: its short factors, cos and
    sin scaled by sqrt(1 + ln 32 / ln 4096)): the rotating append and attention's q prologue."""
    factors = tuple(1.0 + 0.05 * i for i in range(48))
    scale = (1 + math.log(32) / math.log(4096)) ** 0.5
    rope = RopeSpec.of(
        {
            "head_dim": 96,
            "theta": 10000.0,
            "rope_type": "longrope",
            "factors": factors,
            "attention_factor": scale,
        }
    )
    a = AttentionSpec(CacheShape(BF16, 4096, 32, 96), 32, 96**-0.5, rope)
    return lambda arch: [
        kv_append_kernel(a.cache, rope),
        attention_split_kernel(a),
        attention_prefill_kernel(a),
        rope_kernel(BF16, 32, rope),
    ]


def moe(fmt: WeightFormat) -> Callable[[str], list[Kernel]]:
    """A mixture-of-experts layer at a checkpoint's shapes (8 experts, 2 a token) behind its
    RMSNorm: route, the grouping, the expert GEMVs (gate/up with the norm as their prologue and
    silu(g) * u; down with the combine and the residual at K = 1408), the grouped GEMMs of the
    64-row bucket (gate/up's normalising its gathered rows) and the combine."""
    act = BF16 if isinstance(fmt, Nvfp4) else F16

    def make() -> Graph:
        rng = np.random.default_rng(0)
        args = (rng, CHECKPOINT.hidden, CHECKPOINT.inter, 8, 2, fmt, act)
        return moe_graph(*args, norm=True, with_weights=False)[0]

    def keep(la: Launch) -> bool:
        name = la.kernel.name
        return name.startswith("moe_") and (not name.startswith("moe_qgemm") or la.when[1] <= 64)

    return graph(make, keep)


def shared_expert(fmt: WeightFormat) -> Callable[[str], list[Kernel]]:
    """Qwen2-MoE's shared expert at a checkpoint's shapes: its gate's sigmoid (route's
    sigmoid_topk, one of one) and its down projection as an expert qlinear of one expert whose
    combine adds the residual (the expert GEMV on a row per token, the grouping, the 64-row
    grouped GEMM, the combine of one slot)."""

    def make() -> Graph:
        b = Builder("shared_expert")
        x = b.input("x", ("M", CHECKPOINT.hidden), BF16)
        h = b.input("h", ("M", CHECKPOINT.inter), BF16)
        gate = b.weight("gate", QWeight(fmt, 1, CHECKPOINT.hidden), name="w_gate")
        ids, w = b.route(b.qlinear(x, gate, name="logit"), 1, "sigmoid_topk", name="route")
        down = QExperts(QWeight(fmt, CHECKPOINT.hidden, CHECKPOINT.inter), 1)
        b.output("y", b.expert_qlinear(h, b.weight("down", down, name="w_down"), ids, w, x))
        return b.graph

    def keep(la: Launch) -> bool:
        name = la.kernel.name
        return name.startswith("moe_") and (not name.startswith("moe_qgemm") or la.when[1] <= 64)

    return graph(make, keep)


def expert_gemvs(fmt: WeightFormat) -> Callable[[str], list[Kernel]]:
    """A format's fragment in both expert GEMVs (its pointers move per expert)."""
    act = BF16 if isinstance(fmt, Nvfp4) else F16
    w = QExperts(QWeight(fmt, 128, 128), 5)
    return lambda arch: [
        expert_gemv_kernel(ExpertGemvSpec((w, w), act, 8, 2)),
        expert_gemv_kernel(
            ExpertGemvSpec((w,), act, 8, 2, combine="combine_residual", per_slot=True)
        ),
    ]


def paged_attention() -> Callable[[str], list[Kernel]]:
    """Llama-3-8B's attention over a paged KV cache (pages of 16 rows, 256 a sequence)."""
    cache = CacheShape(BF16, 4096 * 16, 8, 128, page_size=16, table_pages=256)
    rope = RopeSpec.of({"head_dim": 128, "theta": 500000.0, "rope_type": "default"})
    a = AttentionSpec(cache, 32, 128**-0.5, rope)
    return lambda arch: [
        kv_append_kernel(cache, rope),
        attention_split_kernel(a),
        attention_prefill_kernel(a),
    ]


# gpt-oss-20b: 24 layers of 64 q heads on 8 kv heads of 64, YaRN (truncate false), sliding
# layers of window 128, 32 MXFP4 experts of 2880 x 2880 with biases, 4 a token.
GPTOSS_ROPE = RopeSpec.of(
    {
        "head_dim": 64,
        "theta": 150000.0,
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "attention_factor": 0.1 * np.log(32.0) + 1.0,
    }
)


def gptoss_20b() -> Callable[[str], list[Kernel]]:
    """gpt-oss-20b's layer kernels: the sinks in the combine and the prefill attention (a full
    and a sliding layer's cache: a ring of the window plus a prefill chunk), YaRN in the append
    and attention's q load; the router (bf16 with a bias), top-4-then-softmax of 32, the biased
    MXFP4 expert GEMVs with the clamped SwiGLU, the grouped GEMMs of the 64-row bucket; the
    router and the gate/up with the post-attention norm as their prologue."""
    hidden, experts = 2880, 32
    caches = (CacheShape(BF16, 4096, 8, 64), CacheShape(BF16, 128 + 255, 8, 64, window=128))
    specs = [AttentionSpec(c, 64, 64**-0.5, GPTOSS_ROPE, sinks=True) for c in caches]

    def make() -> Graph:
        b = Builder("gptoss_moe")
        x = b.input("x", ("M", hidden), BF16)
        xn = b.rms_norm(x, b.param("norm", TensorType((hidden,), BF16)), 1e-5)
        router = b.weight("router", QWeight(Dense(BF16), experts, hidden, bias=True))
        ids, rw = b.route(b.qlinear(xn, router, name="logits"), 4, "topk_softmax", name="route")
        ws = {
            n: b.weight(n, QExperts(QWeight(Mxfp4(), hidden, hidden, bias=True), experts))
            for n in ("gate", "up", "down")
        }
        act = {"act": "swiglu_clamp", "limit": 7.0, "alpha": 1.702}
        h = b.expert_qlinear(xn, (ws["gate"], ws["up"]), ids, name="h", act=act)
        b.output("y", b.expert_qlinear(h, ws["down"], ids, rw, x, name="y"))
        return b.graph

    def keep(la: Launch) -> bool:
        name = la.kernel.name
        return name.startswith("moe_") and (not name.startswith("moe_qgemm") or la.when[1] <= 64)

    experts_kernels = graph(make, keep)
    return lambda arch: [
        *(
            k
            for a in specs
            for k in (
                kv_append_kernel(a.cache, GPTOSS_ROPE),
                attention_split_kernel(a),
                attention_combine_kernel(a),
                attention_prefill_kernel(a),
            )
        ),
        *experts_kernels(arch),
    ]


@dataclass(frozen=True)
class Entry:
    id: str
    kernels: Callable[[str], Iterable[Kernel]]  # the target arch -> its kernels
    must: tuple[str, ...] = ()  # name fragments some kernel of the entry must contain
    archs: tuple[str, ...] = nvrtc.GATE_ARCHS


# One format per dequant fragment and code path, at Llama-3-8B's MLP: the GEMVs at K 4096 and
# 14336, the 128 x 128 GEMM tiles (and W4A4's 64-row ones).
FRAGMENTS: tuple[tuple[str, WeightFormat, DType], ...] = (
    ("mlx3g64", MlxAffine(3, 64, BF16), F16),  # codes straddle words
    ("mlx2g32", MlxAffine(2, 32, F16), F16),  # two rows a warp, 64-wide K steps
    ("mlx8g64", MlxAffine(8, 64, BF16), F16),
    ("awq4g128", Awq(4, 128), F16),  # AWQ's nibble order
    ("gptq3g128act", Gptq(3, 128, "gptq", 1, F16), F16),  # act-order: the float path
    ("ct4g32", CtInt(4, 32, BF16), F16),
    ("fp8ch", Fp8("channel"), F16),
    ("fp8b128", Fp8Block(), BF16),  # a float32 scale per 128 x 128 block (Qwen3-FP8, DeepSeek)
    ("mxfp8", Mxfp8(), F16),
    ("mxfp4", Mxfp4(), F16),
    ("nvfp4mul", Nvfp4("mul", 16), BF16),  # W4A16
    ("nvfp4diva4", Nvfp4("div", 4), BF16),  # W4A4: quantize_act, the a4 GEMV and GEMMs
    ("densebf16", Dense(BF16), F16),
)

GPTQ_BITS = (
    Gptq(2, 128, "gptq", 1, F16),
    Gptq(8, 128, "gptq", 1, F16),
    Gptq(4, 128, "gptq", 0, F16),
    Gptq(8, 32, "gptq_v2", 0, BF16),
)

# GGUF's types (qir.formats.ggml): each its own decode (code widths, high bits, mins, tables),
# near the register cap; TQ1_0 runs TQ2_0's planes.
GGML = tuple(Ggml(t) for t in SPECS if t != "TQ1_0")


def q4_k_m_qkv(s: Shapes) -> Graph:
    """A Q4_K_M layer's q/k (Q4_K) and v (Q6_K) behind its RMSNorm: one launch of two parts."""
    return mixed_qkv(s, ("Q4_K", "Q4_K", "Q6_K"))


def mixed_qkv(s: Shapes, types: tuple[str, str, str]) -> Graph:
    """q, k, v in these ggml types behind an RMSNorm: one launch, each type's fragment in it."""
    b = Builder("q4km")
    x = b.input("x", ("M", s.hidden), F16)
    xn = b.rms_norm(x, b.param("norm", TensorType((s.hidden,), F16), name="w_norm"), 1e-5)
    for n, o, t in zip(("q", "k", "v"), (s.hidden, s.kv, s.kv), types, strict=True):
        b.output(n, b.qlinear(xn, b.weight(n, QWeight(Ggml(t), o, s.hidden), name=f"w_{n}")))
    return b.graph


GATE: tuple[Entry, ...] = (
    # Every GGUF type's GEMVs at Llama-3-8B's MLP on every arch, its 128-row GEMM with the
    # residual on one (the GEMMs stay far from the register cap), the archs in turn.
    *(
        Entry(
            f"mlp-{fmt.tag()}-llama3-8b",
            graph(lambda f=fmt: mlp(f, LLAMA3_8B), lambda la: not gemm(la)),
            ("qgemv_", "_k4096_m8", "_silumul", "_k14336_m8_res"),
        )
        for fmt in GGML
    ),
    *(
        Entry(
            f"mlp-{fmt.tag()}-llama3-8b-gemm",
            graph(lambda f=fmt: mlp(f, LLAMA3_8B), lambda la: gemm(la) and la.when[1] > 64),
            ("qgemm_", "_res"),
            archs=(nvrtc.GATE_ARCHS[i % len(nvrtc.GATE_ARCHS)],),
        )
        for i, fmt in enumerate(GGML)
    ),
    Entry(
        "qkv-ggml-q4km-llama3-8b",
        graph(lambda: q4_k_m_qkv(LLAMA3_8B)),
        (
            "qgemv_ggmlq4k_ggmlq6k_f16_n4096_1024_1024_k4096_m8_rmsnorm_wf16",
            "qgemm_ggmlq4k_ggmlq6k_f16_n4096_1024_1024_k4096",
        ),
    ),
    # gate (Q4_K) and up (Q6_K) paired: the GEMV runs each format's code over a block's rows in
    # turn, the GEMM decodes each weight's rows of the pair's tiles by its own fragment.
    Entry(
        "mlp-ggml-q4k-q6k-pair-llama3-8b",
        graph(
            lambda: mlp(Ggml("Q4_K"), LLAMA3_8B, up=Ggml("Q6_K")),
            lambda la: "_ggmlq4k_ggmlq6k_" in la.kernel.name,
        ),
        (
            "qgemv_ggmlq4k_ggmlq6k_f16_n14336_14336_k4096_m8_silumul",
            "qgemm_ggmlq4k_ggmlq6k_f16_n14336_14336_k4096_64x64x32s3w2x2_silumul",
            "qgemm_ggmlq4k_ggmlq6k_f16_n14336_14336_k4096_128x128x32s2w2x4_silumul",
        ),
    ),
    # One GEMM of three fragments whose chunks differ (Q8_0's 16 weights, Q2_K's 64: K steps of
    # 64, so both buckets' tiles shrink to fit shared memory), behind the norm prologue.
    Entry(
        "qkv-ggml-mixed-chunks-llama3-8b-gemm",
        graph(lambda: mixed_qkv(LLAMA3_8B, ("Q8_0", "Q2_K", "Q6_K")), gemm),
        ("qgemm_ggmlq80_ggmlq2k_ggmlq6k_f16_n4096_1024_1024_k4096_64x64x64s2w2x4",),
    ),
    *(
        Entry(
            f"mlp-{tag}-llama3-8b",
            graph(lambda f=fmt, a=act: mlp(f, LLAMA3_8B, a), decode_and_res_prefill),
            # K = 4096: 16 lanes a row (2-bit codes' 64-weight chunks) or 32
            ("qgemv_", "_k4096_m8", "_silumul", "_k14336_m8_res", "qgemm_"),
        )
        for tag, fmt, act in FRAGMENTS
    ),
    # The 16-bit GEMM's tiles and epilogues at Llama's N on one format: 64 x 64 and 128 x 128,
    # the gate/up pair and the residual.
    Entry(
        "mlp-mlx4g64-llama3-8b-gemms",
        graph(lambda: mlp(MlxAffine(4, 64, BF16), LLAMA3_8B), gemm),
        ("_64x64x32s3w2x2_silumul", "_64x64x32s3w2x2_res", "_128x128x32s2w2x4_silumul"),
    ),
    # Biased q/k/v (Qwen2): each segment's bias in the GEMV of every fragment, and the GEMMs.
    *(
        Entry(
            f"qkv-biased-{tag}-checkpoint",
            graph(lambda f=fmt, a=act: qkv(f, CHECKPOINT, a, bias=True), lambda la: not gemm(la)),
            ("qgemv_", "b_128b_128b"),
        )
        for tag, fmt, act in FRAGMENTS
    ),
    Entry(
        "qkv-biased-mlx4g64-checkpoint-gemms",
        graph(lambda: qkv(MlxAffine(4, 64, BF16), CHECKPOINT, bias=True), gemm),
        ("qgemm_",),
    ),
    # Below N = 4096: 64 x 32 and 128 x 64, merged outputs (q, k, v in one launch).
    Entry(
        "qkv-mlx3g64-checkpoint",
        graph(lambda: qkv(MlxAffine(3, 64, BF16), CHECKPOINT)),
        ("qgemv_mlx3g64bf16_f16_n512_128_128_k512_m8", "_64x32x32s3w4x1", "_128x64x32s3w2x2"),
    ),
    # Issue 14's W4A4 MLP (its down projection at K = 1408 spilled 608 bytes on sm_80/sm_90);
    # mul mode with f16 activations for the down projection.
    Entry(
        "mlp-nvfp4diva4-checkpoint",
        graph(lambda: mlp(Nvfp4("div", 4), CHECKPOINT, BF16), decode_and_res_prefill),
        ("qgemv_nvfp4diva4_bf16_n512_k1408_m8_l8_res_a4", "quantize_act_", "_res_a4"),
    ),
    Entry(
        "down-nvfp4mula4-checkpoint",
        graph(
            lambda: mlp(Nvfp4("mul", 4), CHECKPOINT, F16),
            lambda la: "_k1408_" in la.kernel.name and "_a4" in la.kernel.name,
        ),
        ("qgemv_nvfp4mula4_f16_n512_k1408_m8_l8_res_a4", "_res_a4"),
    ),
    # silu(g) * u in down_proj's prologue: 16-bit, and W4A4 quantizing it there.
    Entry(
        "prologue-16bit-checkpoint",
        graph(
            lambda: prologue_mlp(
                MlxAffine(4, 64, BF16), MlxAffine(8, 64, BF16), Fp8("channel"), CHECKPOINT
            ),
            lambda la: "_silu" in la.kernel.name,
        ),
        ("qgemv_fp8ch_f16_n512_k1408_m8_l8_silu", "_64x32x32s3w4x1_silu", "_128x64x32s3w2x2_silu"),
    ),
    # W4A4's GEMMs only: its GEMV takes 40-50 s per arch to build (silu(g) * u quantized in
    # every warp) for a form the default passes do not produce from W4A4 checkpoints (their
    # gate and up share one format and pair); the host runs it (test_kernels_nvfp4's
    # mlp-prologue).
    Entry(
        "prologue-w4a4-checkpoint",
        graph(
            lambda: prologue_mlp(Nvfp4("mul", 4), Nvfp4("div", 4), Nvfp4("div", 4), CHECKPOINT),
            lambda la: gemm(la) and "_silu" in la.kernel.name,
        ),
        ("qgemm_nvfp4diva4_f16_n512_k1408_64x32x32s3w4x1_silu_a4dynamic", "_128x64x32s3w2x2_silu"),
    ),
    # Gemma's gelu-tanh where silu fuses: the pair's epilogue and down_proj's prologue, 16-bit
    # (GEMV and GEMMs), and W4A4's prologue GEMM (its GEMV as prologue-w4a4-checkpoint's).
    Entry(
        "gelu-gate-checkpoint",
        lambda arch: [
            *graph(
                lambda: mlp(MlxAffine(4, 64, BF16), CHECKPOINT, BF16, "gelu_tanh"),
                lambda la: "_gelumul" in la.kernel.name,
            )(arch),
            *graph(
                lambda: prologue_mlp(
                    MlxAffine(4, 64, BF16),
                    MlxAffine(8, 64, BF16),
                    Fp8("channel"),
                    CHECKPOINT,
                    "gelu_tanh",
                ),
                lambda la: "_gelu" in la.kernel.name,
            )(arch),
            *graph(
                lambda: prologue_mlp(
                    Nvfp4("mul", 4), Nvfp4("div", 4), Nvfp4("div", 4), CHECKPOINT, "gelu_tanh"
                ),
                lambda la: gemm(la) and "_gelu" in la.kernel.name,
            )(arch),
        ],
        (
            "qgemv_mlx4g64bf16_bf16_n1408_1408_k512_m8_l4_gelumul",
            "qgemv_fp8ch_f16_n512_k1408_m8_l8_gelu",
            "_128x64x32s3w2x2_gelu",
            "_64x32x32s3w4x1_gelu_a4dynamic",
        ),
    ),
    # f32 activations: the GEMV's float path (no GEMM takes f32), one row a warp.
    Entry(
        "f32-acts-checkpoint",
        lambda arch: [
            *graph(lambda: mlp(MlxAffine(4, 64, BF16), CHECKPOINT, F32))(arch),
            *graph(lambda: qkv(Nvfp4("mul", 4), CHECKPOINT, F32))(arch),
            *graph(lambda: qkv(Dense(F32), CHECKPOINT, F32))(arch),
        ],
        (
            "qgemv_mlx4g64bf16_f32_n1408_1408_k512_m8_l4_silumul",
            "qgemv_mlx4g64bf16_f32_n512_k1408_m8_l8_res",
            "qgemv_nvfp4mula4_f32_n512_128_128_k512_m8_l4_a4",
            "quantize_act_nvfp4_f32",
            "qgemv_densef32_f32_",
        ),
    ),
    # GPTQ's other bit widths, act-order (the float path) and not, at Llama's K.
    Entry(
        "one-gptq-bits-llama3-8b",
        lambda arch: [
            k
            for fmt in GPTQ_BITS
            for k in graph(lambda f=fmt: one(f, 4096, 4096), lambda la: not gemm(la))(arch)
        ],
        ("qgemv_gptq2g128act", "qgemv_gptq8g128act", "qgemv_gptq4g128f16", "qgemv_gptqv28g32bf16"),
    ),
    # The passes off: one launch per op (elementwise kernels in each dtype, a GEMV of one
    # output).
    Entry(
        "mlp-unfused-checkpoint",
        lambda arch: [
            k
            for act in (F16, BF16, F32)
            for k in graph(
                lambda a=act: mlp(MlxAffine(4, 64, BF16), CHECKPOINT, a),
                lambda la: (
                    la.kernel.name.startswith("ew_")
                    or la.kernel.name == "qgemv_mlx4g64bf16_f16_n512_k1408_m8_l8"
                ),
                passes="none",
            )(arch)
        ],
        ("ew_silu_f16", "ew_mul_bf16", "ew_add_f32", "qgemv_mlx4g64bf16_f16_n512_k1408_m8_l8"),
    ),
    # NVFP4 rows whose K is an odd multiple of 16: the 64-bit-load chunk path.
    Entry(
        "one-nvfp4-k48",
        graph(lambda: one(Nvfp4("div", 16), 40, 48), lambda la: not gemm(la)),
        ("qgemv_nvfp4div_f16_n40_k48",),
    ),
    # Blackwell's block-scaled FP4 MMA, where the instruction exists (elsewhere it traps).
    Entry(
        "w4a4-gemm-block-scaled-fp4",
        lambda arch: [
            k
            for make in (mlp, qkv)
            for k in graph(
                lambda m=make: m(Nvfp4("div", 4), CHECKPOINT, BF16),
                lambda la: "_nvf4" in la.kernel.name,
            )(arch)
        ],
        ("_silumul_a4dynamic_nvf4", "_res_a4dynamic_nvf4", "_64x32x64s3w4x1_a4dynamic_nvf4"),
        archs=("sm_120a", "sm_121a"),
    ),
    # A decoder layer and a model: RMSNorm (alone, in the GEMV/GEMM prologue, in quantize_act),
    # KV append, split and prefill attention, embedding, lm_head.
    Entry(
        "model-mlx4-w4a16",
        model("mlx_affine4_g64_S"),
        ("embedding_mlx4", "kv_append_", "qgemv_", "qgemm_", "_rmsnorm_wbf16_silumul"),
    ),
    Entry(
        "model-nvfp4-w4a4",
        model("ct_nvfp4_w4a4_S"),
        ("rms_norm_", "quantize_act_nvfp4_bf16_k256_div_rmsnorm"),
    ),
    # Gemma 3: embeddings scaled by 16, RMSNorm weights folded to float32 (1 + w) in the
    # prologues (with the gelu-tanh pair), each post-norm and its residual add in the next
    # projections' prologue (storing h, or not: lm_head), the soft-cap as lm_head's epilogue.
    Entry(
        "model-gemma3-mlx4",
        model("mlx_affine4_gemma3"),
        (
            "embedding_mlx4",
            "_x16",
            "_resnormh_wf32_rmsnorm_wf32_gelumul",
            "_resnormh_wf32_rmsnorm_wf32",
            "_resnorm_wf32_rmsnorm_wf32_softcap_c30",
        ),
    ),
    # A lone Gemma 3 layer keeps its last post-norm as a norm_residual kernel.
    Entry(
        "layer-gemma3-mlx4",
        graph(
            lambda: build(load(DATA / "mlx_affine4_gemma3"), "layer", 1).graph,
            lambda la: la.kernel.name.startswith("rms_norm_"),
        ),
        ("rms_norm_bf16_n256_wf32_res",),
    ),
    Entry("attention-llama3-8b", attention(32), ("attn_split_", "attn_combine_", "attn_prefill_")),
    Entry("attention-llama3-70b", attention(64), ("attn_split_bf16_h64",)),
    Entry("attention-gemma3-4b-d256", wide_head_attention(), ("attn_prefill_bf16_h8_kv4_d256",)),
    Entry(
        "attention-qwen3-8b-head-norm",
        head_norm_attention(),
        ("_qnormbf16_", "_knormbf16", "rms_norm_bf16_n128_wbf16_g32"),
    ),
    Entry(
        "attention-mistral-7b-sliding-window",
        sliding_window_attention(),
        ("kv_append_", "attn_split_", "attn_prefill_"),
    ),
    Entry(
        "attention-gemma2-27b-softcap",
        softcap_attention(),
        ("attn_split_bf16_h32_kv16_d128_c8192_ropedefault10000_softcap_c50_", "_softcap_c50_r16"),
    ),
    # Its sliding layers: on sm_80 ptxas spills the ring's split kernel for 2 q heads per kv head
    # with or without the cap (4 bytes; main's plain kernel at that shape does too).
    Entry(
        "attention-gemma2-27b-softcap-sliding",
        softcap_attention(4096),
        ("_w4096_ropedefault10000_softcap_c50_s256", "_w4096_ropedefault10000_softcap_c50_r16"),
        archs=tuple(a for a in nvrtc.GATE_ARCHS if a != "sm_80"),
    ),
    Entry(
        "attention-phi3-mini-128k-longrope",
        longrope_attention(),
        ("kv_append_bf16_c4096_kv32_d96_ropelongrope10000_f", "attn_split_", "attn_prefill_"),
    ),
    Entry(
        "attention-llama3-8b-paged",
        paged_attention(),
        ("kv_append_bf16_c65536_p16x256", "attn_split_", "attn_prefill_"),
    ),
    # Mixtures of experts, one format per fragment kind (codes straddling words, E4M3 with a
    # per-tensor scale per expert, NVFP4); the grouped GEMMs of all but FP8.
    Entry(
        "moe-mlx3g64-checkpoint",
        moe(MlxAffine(3, 64, BF16)),
        (
            "moe_route_",
            "moe_group_",
            "_silumul_rmsnorm_wbf16",  # the gate/up GEMV
            "_rmsnorm_wbf16_silumul_e8top2",  # the gate/up grouped GEMM
            "moe_combine_",
        ),
    ),
    Entry(
        "moe-fp8tensor-checkpoint",
        lambda arch: [k for k in moe(Fp8("tensor"))(arch) if not k.name.startswith("moe_qgemm")],
        ("_silumul_rmsnorm_wbf16",),
    ),
    Entry(
        "moe-nvfp4mul-checkpoint",
        moe(Nvfp4("mul", 16)),
        ("_silumul_rmsnorm_wbf16", "_rmsnorm_wbf16_silumul_e8top2"),
    ),
    # W4A4 experts (ModelOpt's declared W4A4): the expert GEMVs quantizing each slot's input
    # under its expert's scale; compressed-tensors' encode factor and the per-row scale of
    # --weight-quantization w4a4 on two archs (one with the FP4 conversion, one without).
    Entry(
        "moe-nvfp4mula4-checkpoint",
        lambda arch: [k for k in moe(Nvfp4("mul", 4))(arch) if "_a4" in k.name],
        ("_silumul_a4mul", "_combine_res_slots_in_a4mul"),
    ),
    Entry(
        "expert-gemvs-nvfp4-a4div-a4dynamic-checkpoint",
        lambda arch: [
            expert_gemv_kernel(
                ExpertGemvSpec(
                    (QExperts(QWeight(fmt, n, k), 8),) * (2 if combine == "" else 1),
                    BF16,
                    8,
                    2,
                    combine=combine,
                    per_slot=bool(combine),
                    target=for_target(Target(arch), fmt, n, k),
                    a4_mode=mode,
                )
            )
            for fmt, mode, combine, (n, k) in (
                (Nvfp4("div", 4), "div", "", (CHECKPOINT.inter, CHECKPOINT.hidden)),
                (
                    Nvfp4("div", 16),
                    "dynamic",
                    "combine_residual",
                    (CHECKPOINT.hidden, CHECKPOINT.inter),
                ),
            )
        ],
        ("_silumul_a4div", "_combine_res_slots_in_a4dynamic"),
        archs=("sm_80", "sm_100a"),
    ),
    Entry(
        "moe-shared-expert-mlx4-checkpoint",
        shared_expert(MlxAffine(4, 64, BF16)),
        (
            "moe_route_bf16_e1_top1_sigmoid_topk",
            "moe_gemv_mlx4g64bf16_bf16_e1top1_n512_k1408_m8_l8_combine_res",
            "moe_group_e1_top1",
            "moe_qgemm_",
            "moe_combine_bf16_top1",
        ),
    ),
    # Every format of the zoo in the expert GEMVs, the formats taking the gate archs in turn.
    *(
        Entry(
            f"expert-gemvs-{i}-{type(fmt).__name__.lower()}",
            expert_gemvs(fmt),
            ("moe_gemv_",),
            archs=(nvrtc.GATE_ARCHS[i % len(nvrtc.GATE_ARCHS)],),
        )
        for i, fmt in enumerate(FORMAT_ZOO)
    ),
    # Qwen3-30B-A3B's expert shapes: gate/up at K = 2048 in groups of 16 lanes, down with the
    # combine at K = 768 in groups of 4 (8-bit codes spilled once a lane made two passes).
    Entry(
        "expert-gemvs-qwen3-30b-a3b",
        lambda arch: [
            expert_gemv_kernel(spec)
            for fmt in (Awq(4, 128), Mxfp8())
            for spec in (
                ExpertGemvSpec((QExperts(QWeight(fmt, 768, 2048), 128),) * 2, F16, 8, 8),
                ExpertGemvSpec(
                    (QExperts(QWeight(fmt, 2048, 768), 128),),
                    F16,
                    8,
                    8,
                    combine="combine_residual",
                    per_slot=True,
                ),
            )
        ],
        ("_k2048_m8_l16_silumul", "_k768_m8_l4_combine_res_slots_in"),
    ),
    # gpt-oss: the fixture's whole model (the router's biased GEMV, every kernel it plans but
    # its attention: head_dim 32's prefill attention spills 56 bytes on sm_100a with or without
    # sinks, as main's does; gpt-oss's own head_dim 64 is gptoss-20b's) and gpt-oss-20b's
    # shapes (sinks, YaRN, biased MXFP4 experts with the clamped SwiGLU).
    Entry(
        "model-gptoss-mxfp4",
        lambda arch: [k for k in model("gptoss_mxfp4")(arch) if not k.name.startswith("attn_")],
        ("moe_route_", "_swiglu7a1p702_bias", "kv_append_bf16_c256_p16x16_w8"),
    ),
    Entry(
        "gptoss-20b",
        gptoss_20b(),
        (
            "attn_combine_bf16_h64_d64_n32_sinks",
            "_ropeyarn150000x32_b32_1_sinks",
            "moe_gemv_mxfp4_bf16_e32top4_n2880_k2880_m8_l16_swiglu7a1p702_bias_rmsnorm_wbf16",
            "moe_qgemm_mxfp4_bf16_n2880b_2880b_k2880_",
            "_rmsnorm_wbf16_swiglu7a1p702_e32top4",
            "moe_route_bf16_e32_top4_topk_softmax",
        ),
    ),
    # Qwen's vocabulary: the loops' trip counts do not change the code, the dtype does.
    Entry(
        "sample-qwen-vocab",
        lambda arch: [sample_kernel(act, 151936) for act in (F16, BF16, F32)],
        ("sample_f16", "sample_bf16", "sample_f32"),
    ),
    # The served logits: penalties, bias and allowed ids over a 4096-token context (plus the
    # bias entries), and the top-20 logprobs a client may ask for.
    Entry(
        "serve-logits-qwen-vocab",
        lambda arch: [
            kernel
            for act in (F16, BF16, F32)
            for kernel in (
                adjust_logits_kernel(act, 151936, 4096 + MAX_BIAS),
                logprobs_kernel(act, 151936, MAX_TOP_LOGPROBS),
            )
        ],
        ("adjust_logits_f16", "adjust_logits_f32", "logprobs_bf16_v151936_k20"),
    ),
)


@cache
def _kernels(entry_id: str, arch: str) -> tuple[Kernel, ...]:
    entry = next(e for e in GATE if e.id == entry_id)
    return tuple({k.name: k for k in entry.kernels(arch)}.values())


def _earlier(entry_id: str, arch: str) -> set[tuple[str, str]]:
    """The kernels of the entries before `entry_id` that build for `arch`."""
    seen: set[tuple[str, str]] = set()
    for e in GATE:
        if e.id == entry_id:
            return seen
        if arch in e.archs:
            seen |= {(k.name, k.source) for k in _kernels(e.id, arch)}
    raise KeyError(entry_id)


# NVRTC takes 3 s for a Llama-size GEMV, so the whole matrix was a third of the suite's time. By
# default every entry builds for sm_90 (the H100/H200 the device leases are) and for one other
# arch, in turn down the list, so each arch still builds a third of the entries; QIR_GATE=all
# builds every entry for every arch. An entry of one or two archs builds them all. Both take
# ptxas' figures from tests/ptxas_record.py's record where it holds the kernel's exact text and
# compiler; QIR_GATE=fresh builds every entry for every arch with NVRTC, and `make gate`
# rewrites the record from such a build.
GATE_MODES = ("", "all", "fresh")


def gate_mode() -> str:
    mode = os.environ.get("QIR_GATE", "").strip()
    if mode not in GATE_MODES:
        raise pytest.UsageError(f"QIR_GATE={mode!r}: expected 'all', 'fresh' or nothing")
    return mode


def selected_archs(index: int, entry: Entry, mode: str) -> tuple[str, ...]:
    if mode not in GATE_MODES:
        raise pytest.UsageError(f"QIR_GATE={mode!r}: expected 'all', 'fresh' or nothing")
    if mode or len(entry.archs) <= 2 or "sm_90" not in entry.archs:
        return entry.archs
    others = [a for a in entry.archs if a != "sm_90"]
    return tuple(a for a in entry.archs if a in ("sm_90", others[index % len(others)]))


def gate_matrix(mode: str) -> list[tuple[Entry, str]]:
    return [(e, a) for i, e in enumerate(GATE) for a in selected_archs(i, e, mode)]


def figures(kernel: Kernel, arch: str, mode: str) -> ptxas_record.Figures:
    recorded = None if mode == "fresh" else ptxas_record.lookup(kernel, arch)
    return recorded if recorded is not None else ptxas_record.build(kernel, arch)


@pytest.mark.parametrize(
    ("entry", "arch"),
    [pytest.param(e, a, id=f"{e.id}-{a}") for e, a in gate_matrix(gate_mode())],
)
def test_kernels_build_without_spills(entry: Entry, arch: str) -> None:
    kernels = _kernels(entry.id, arch)
    names = [k.name for k in kernels]
    missing = [m for m in entry.must if not any(m in n for n in names)]
    assert not missing, f"{entry.id}: no kernel named *{missing[0]}* in {names}"
    earlier = _earlier(entry.id, arch)
    mode = gate_mode()
    for kernel in kernels:
        if (kernel.name, kernel.source) in earlier:
            continue  # built by an earlier entry
        got = figures(kernel, arch, mode)
        assert got.spill_bytes == 0, (kernel.name, arch, got)
        assert 0 < got.registers <= 255, (kernel.name, got.registers)


# The kernel families by name prefix, and the template each is rendered from.
FAMILIES = {
    "qgemv_": "qgemv.cu.j2",
    "qgemm_": "qgemm.cu.j2",
    "quantize_act_": "quantize_act.cu.j2",
    "ew_": "elementwise.cu.j2",
    "rms_norm_": "rms_norm.cu.j2",
    "rope_": "rope.cu.j2",
    "kv_append_": "kv_append.cu.j2",
    "attn_split_": "attention_split.cu.j2",
    "attn_combine_": "attention_combine.cu.j2",
    "attn_prefill_": "attention_prefill.cu.j2",
    "embedding_": "embedding.cu.j2",
    "sample_": "sample.cu.j2",
    "adjust_logits_": "adjust_logits.cu.j2",
    "logprobs_": "logprobs.cu.j2",
    "moe_route_": "moe_route.cu.j2",
    "moe_group_": "moe_group.cu.j2",
    "moe_gemv_": "moe_gemv.cu.j2",
    "moe_qgemm_": "moe_gemm.cu.j2",
    "moe_combine_": "moe_combine.cu.j2",
}


# A GEMV of weights in several formats: each format's part qgemv.cu.j2's code, in a namespace.
MIXED_GEMV = "qgemv_mixed.cu.j2"


def template_of(kernel: Kernel) -> str | None:
    """The template a kernel is rendered from (None: no family's)."""
    prefix = next((p for p in FAMILIES if kernel.name.startswith(p)), None)
    if prefix == "qgemv_" and "namespace qir_part" in kernel.source:
        return MIXED_GEMV
    return FAMILIES[prefix] if prefix else None


def test_every_template_is_gated() -> None:
    """A kernel template no entry renders would never be built for a GPU: add an entry (and
    its family here) with the template."""
    templates = {p.name for p in TEMPLATES.glob("*.cu.j2")}
    assert templates == {*FAMILIES.values(), MIXED_GEMV}
    gated = {template_of(k) for e in GATE for k in _kernels(e.id, e.archs[0])}
    assert gated - {None} == templates


def test_the_default_gate_builds_every_arch_and_sm_90_everywhere() -> None:
    """Half the matrix, but sm_90 for every entry and each other arch for a share of them."""
    chosen = [selected_archs(i, e, "") for i, e in enumerate(GATE)]
    assert all(
        "sm_90" in archs for e, archs in zip(GATE, chosen, strict=True) if "sm_90" in e.archs
    )
    counts = {a: sum(a in archs for archs in chosen) for a in nvrtc.GATE_ARCHS}
    assert min(counts.values()) >= len(GATE) // 4, counts
    assert [selected_archs(i, e, "all") for i, e in enumerate(GATE)] == [e.archs for e in GATE]
    with pytest.raises(pytest.UsageError, match="QIR_GATE='every'"):
        selected_archs(0, GATE[0], "every")


def test_gate_entries_are_distinct() -> None:
    ids = [e.id for e in GATE]
    assert len(set(ids)) == len(ids)
    assert all(set(e.archs) <= set(nvrtc.GATE_ARCHS) | {"sm_121a"} for e in GATE)


def test_the_record_holds_what_nvrtc_reports(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The record is ptxas' own figures: the smallest recorded kernels of two archs, built again
    by NVRTC into an empty cache, report what it says; a kernel whose text differs by one
    character is not in it (it is built)."""
    monkeypatch.setenv("QIR_CACHE_DIR", str(tmp_path))
    checked = 0
    for arch in ("sm_90", "sm_80"):
        kernels = {k.name: k for e in GATE if arch in e.archs for k in _kernels(e.id, arch)}
        recorded = [k for k in kernels.values() if ptxas_record.lookup(k, arch) is not None]
        assert len(recorded) >= len(kernels) // 2, f"{arch}: refresh scripts/ptxas_record.py"
        for kernel in sorted(recorded, key=lambda k: len(k.source))[:2]:
            assert ptxas_record.build(kernel, arch) == ptxas_record.lookup(kernel, arch)
            edited = dataclasses.replace(kernel, source=kernel.source + "\n")
            assert ptxas_record.lookup(edited, arch) is None
            checked += 1
    assert checked == 4
