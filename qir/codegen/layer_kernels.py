"""Kernels of a decoder layer besides the qlinears: RMSNorm, RoPE, the KV-cache append,
attention (split-K decode with its combine, tiled prefill) and the embedding gather.

Python decides every constant (tiles, splits, the RoPE frequency table); the templates only
substitute. Kernel names spell the specialisation."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import numpy as np

from qir import logits, rope, sampling
from qir.codegen.fragments import fragment_for
from qir.codegen.gemv import cap_suffix
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.render import TEMPLATES, common_header, render
from qir.dtypes import DType
from qir.errors import Unsupported
from qir.types import QWeight

LAYER_HEADER = "qir_layer.cuh"
THREADS = 128
NORM_THREADS = 256
# Attention: query rows per prefill block (4 warps x 4 rows), and the heads it supports: a
# lane holds head_dim / 32 elements, and the prefill tiles must fit 48 KB of shared memory.
PREFILL_ROWS = 16
HEAD_DIMS = (32, 64, 96, 128, 256)


@cache
def layer_header() -> tuple[str, str]:
    return LAYER_HEADER, (TEMPLATES / LAYER_HEADER).read_text()


def _headers() -> tuple[tuple[str, str], ...]:
    return (common_header(), layer_header())


def c_double(v: float) -> str:
    """A C double literal holding v exactly (Python's repr round-trips)."""
    return repr(float(v))


def c_float(v: float) -> str:
    """A C float literal holding float32(v) exactly."""
    return f"{float(np.float32(v))!r}f"


def _buf(name: str, c_type: str, const: bool = True) -> KernelParam:
    return KernelParam(name, f"{'const ' if const else ''}{c_type}* __restrict__", "buffer")


_M = KernelParam("M", "int", "int")


@dataclass(frozen=True)
class RopeSpec:
    """A RoPE rotation (qir.rope attributes), frozen so kernels can be cached by it."""

    attrs: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(attrs: Mapping[str, Any]) -> RopeSpec | None:
        """The rotation in a node's attributes, if it has one."""
        if "rope_type" not in attrs:
            return None
        return RopeSpec(tuple(sorted((k, v) for k, v in attrs.items() if k in rope.ATTRS)))

    @property
    def tag(self) -> str:
        a = dict(self.attrs)
        tag = f"_rope{a['rope_type']}{int(a['theta'])}"
        if "factor" in a:
            tag += f"x{a['factor']:g}".replace(".", "p")
        if "factors" in a:  # longrope: its per-pair factors (a digest) and cos/sin scale
            digest = zlib.crc32(np.asarray(a["factors"], np.float32).tobytes())
            tag += f"_f{digest:08x}_m{a['attention_factor']:.4g}".replace(".", "p")
        if a["rope_type"] == "yarn":  # its ramp's ends (and whether they are whole dims)
            tag += f"_b{a['beta_fast']:g}_{a['beta_slow']:g}{'t' if a['truncate'] else ''}"
            tag = tag.replace(".", "p")
        return tag

    @property
    def desc(self) -> str:
        return ", ".join(
            f"{k}={f'({len(v)} values)' if isinstance(v, tuple) else v}" for k, v in self.attrs
        )

    @property
    def table(self) -> str:
        return ", ".join(c_float(f) for f in rope.inv_freq(dict(self.attrs)))


@dataclass(frozen=True)
class HeadNorm:
    """A per-head RMSNorm prologue: its weight's dtype and eps (attribute norm_eps)."""

    dtype: DType
    eps: float

    def tag(self, which: str) -> str:
        return f"_{which}norm{self.dtype.name}"


def _norm_context(n: HeadNorm | None) -> dict[str, Any]:
    if n is None:
        return {"norm": False, "norm_eps": "", "w_t": ""}
    return {"norm": True, "norm_eps": c_float(n.eps), "w_t": n.dtype.c_type}


def _rope_context(r: RopeSpec | None) -> dict[str, Any]:
    if r is None:
        return {"rope": False, "rope_desc": "", "inv_freq": "", **_rope_scale(1.0)}
    return {
        "rope": True,
        "rope_desc": r.desc,
        "inv_freq": r.table,
        **_rope_scale(rope.cos_sin_scale(dict(r.attrs))),
    }


def _rope_scale(scale: float) -> dict[str, str]:
    """cos and sin's factor (yarn's attention_factor) as the templates take it: an argument of
    qir_rotate and a product; nothing where it is 1."""
    if scale == 1.0:
        return {"rope_scale_arg": "", "rope_scale_mul": ""}
    return {"rope_scale_arg": f", {c_float(scale)}", "rope_scale_mul": f" * {c_float(scale)}"}


def rms_norm_kernel(
    act: DType, w: DType, n: int, eps: float, groups: int = 1, residual: bool = False
) -> Kernel:
    """Rows of `groups` groups of n features, each normed on its own (grid.x = groups); with
    `residual`, r + the norm (rounded first, as a separate add would take it)."""
    name = f"rms_norm_{act.name}_n{n}_w{w.name}" + (f"_g{groups}" if groups > 1 else "")
    name += "_res" if residual else ""
    source = render(
        "rms_norm.cu.j2",
        name=name,
        act_t=act.c_type,
        w_t=w.c_type,
        N=n,
        groups=groups,
        eps=c_float(eps),
        threads=NORM_THREADS,
        residual=residual,
    )
    r = (_buf("r", act.c_type),) if residual else ()
    params = (_buf("x", act.c_type), _buf("w", w.c_type), *r, _buf("y", act.c_type, False), _M)
    return Kernel(name, source, params, (NORM_THREADS, 1, 1), _headers())


def rope_kernel(act: DType, heads: int, r: RopeSpec) -> Kernel:
    head_dim = dict(r.attrs)["head_dim"]
    name = f"rope_{act.name}_h{heads}_d{head_dim}{r.tag}"
    source = render(
        "rope.cu.j2",
        name=name,
        act_t=act.c_type,
        heads=heads,
        head_dim=head_dim,
        threads=THREADS,
        **_rope_context(r),
    )
    params = (_buf("x", act.c_type), _buf("pos", "int32_t"), _buf("y", act.c_type, False), _M)
    return Kernel(name, source, params, (THREADS, 1, 1), _headers(), collectives=False)


@dataclass(frozen=True)
class CacheShape:
    """A KV cache: `capacity` rows of [kv_heads, head_dim]. Paged (page_size > 0): a pool of
    capacity / page_size pages, each row's positions reached through its block table of
    `table_pages` pages (qir.ops); else one sequence, position p at row p. With a sliding
    window (window > 0) a sequence's room is a ring: position p at p % positions."""

    act: DType
    capacity: int
    kv_heads: int
    head_dim: int
    page_size: int = 0
    table_pages: int = 0
    window: int = 0

    @property
    def positions(self) -> int:
        """The positions one sequence has room for."""
        return self.table_pages * self.page_size if self.page_size else self.capacity

    @property
    def tag(self) -> str:
        paged = f"_p{self.page_size}x{self.table_pages}" if self.page_size else ""
        return f"_c{self.capacity}{paged}" + (f"_w{self.window}" if self.window else "")

    def context(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "positions": self.positions,
            "paged": bool(self.page_size),
            "page_size": self.page_size,
            "table_pages": self.table_pages,
            "num_pages": self.capacity // self.page_size if self.page_size else 0,
            "window": self.window,
        }

    def table_param(self) -> tuple[KernelParam, ...]:
        return (_buf("pages", "int32_t"),) if self.page_size else ()


def kv_append_kernel(c: CacheShape, r: RopeSpec | None, norm: HeadNorm | None = None) -> Kernel:
    name = f"kv_append_{c.act.name}{c.tag}_kv{c.kv_heads}_d{c.head_dim}{r.tag if r else ''}"
    name += norm.tag("k") if norm else ""
    source = render(
        "kv_append.cu.j2",
        name=name,
        act_t=c.act.c_type,
        **c.context(),
        kv_heads=c.kv_heads,
        head_dim=c.head_dim,
        width=c.kv_heads * c.head_dim,
        threads=THREADS,
        **_rope_context(r),
        **_norm_context(norm),
    )
    t = c.act.c_type
    params = (
        _buf("k_cache", t, False),
        _buf("v_cache", t, False),
        _buf("k", t),
        _buf("v", t),
        _buf("pos", "int32_t"),
        *c.table_param(),
        *((_buf("kn", norm.dtype.c_type),) if norm else ()),
        _M,
    )
    # Only the key head's norm sums a head with its warp.
    return Kernel(name, source, params, (THREADS, 1, 1), _headers(), collectives=norm is not None)


@dataclass(frozen=True)
class AttentionSpec:
    cache: CacheShape
    heads: int
    scale: float
    rope: RopeSpec | None
    norm: HeadNorm | None = None  # each head of q normed before the rotation
    softcap: float | None = None  # scaled scores s -> tanh(s / softcap) * softcap (Gemma 2)
    # a logit per head (f32 [heads]) in the softmax denominator (gpt-oss): the combine and the
    # prefill kernels take it
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.cache.head_dim not in HEAD_DIMS:
            *some, last = map(str, HEAD_DIMS)
            raise Unsupported(
                f"head_dim {self.cache.head_dim} has no attention kernel: they take head_dim "
                f"{', '.join(some)} or {last} (--backend reference runs any)"
            )

    @property
    def group(self) -> int:
        return self.heads // self.cache.kv_heads

    @property
    def split_keys(self) -> int:
        """Positions per decode split: about 32 splits of a sequence's room, 32..512 positions
        each (a decode step at any position launches every split; those past it return at
        once)."""
        want = max(self.cache.positions // 32, 32)
        return min(1 << (want - 1).bit_length(), 512)

    @property
    def splits(self) -> int:
        return -(-self.cache.positions // self.split_keys)

    @property
    def partial_floats(self) -> int:
        """Floats of a decode row's partial results: per head and split, D outputs, max, sum."""
        return self.heads * self.splits * (self.cache.head_dim + 2)

    def _tag(self) -> str:
        c = self.cache
        return (
            f"{c.act.name}_h{self.heads}_kv{c.kv_heads}_d{c.head_dim}{c.tag}"
            f"{self.rope.tag if self.rope else ''}{self.norm.tag('q') if self.norm else ''}"
            f"{'_softcap' + cap_suffix(self.softcap) if self.softcap is not None else ''}"
            f"{'_sinks' if self.sinks else ''}"
        )

    def _context(self, name: str) -> dict[str, Any]:
        c = self.cache
        return {
            "name": name,
            "act_t": c.act.c_type,
            "heads": self.heads,
            "kv_heads": c.kv_heads,
            "head_dim": c.head_dim,
            **c.context(),
            "group": self.group,
            "per_lane": c.head_dim // 32,
            "scale": c_float(self.scale),
            "softcap": None if self.softcap is None else c_float(self.softcap),
            # qir_softcap's exponent per unit of q.k: scale * 2 log2(e) / cap
            "softcap_k": None
            if self.softcap is None
            else c_float(self.scale * 2 * math.log2(math.e) / self.softcap),
            "threads": THREADS,
            "sinks": self.sinks,
            **_rope_context(self.rope),
            **_norm_context(self.norm),
        }


def _attention_inputs(a: AttentionSpec, sinks: bool = False) -> tuple[KernelParam, ...]:
    """The operands' parameters (the sinks only where `sinks`: the split kernel has none)."""
    t = a.cache.act.c_type
    return (
        _buf("q", t),
        _buf("k_cache", t),
        _buf("v_cache", t),
        _buf("pos", "int32_t"),
        *a.cache.table_param(),
        *((_buf("qn", a.norm.dtype.c_type),) if a.norm else ()),
        *((_buf("sinks", "float"),) if sinks and a.sinks else ()),
    )


def attention_split_kernel(a: AttentionSpec) -> Kernel:
    a = replace(a, sinks=False)  # the combine adds them: the splits are plain attention's
    name = f"attn_split_{a._tag()}_s{a.split_keys}"
    source = render(
        "attention_split.cu.j2", split_keys=a.split_keys, splits=a.splits, **a._context(name)
    )
    params = (*_attention_inputs(a), _buf("part", "float", False), _M)
    return Kernel(name, source, params, (THREADS, 1, 1), _headers())


def attention_combine_kernel(a: AttentionSpec) -> Kernel:
    c = a.cache
    name = f"attn_combine_{c.act.name}_h{a.heads}_d{c.head_dim}_n{a.splits}"
    name += "_sinks" if a.sinks else ""
    source = render(
        "attention_combine.cu.j2",
        name=name,
        act_t=c.act.c_type,
        heads=a.heads,
        head_dim=c.head_dim,
        splits=a.splits,
        threads=THREADS,
        sinks=a.sinks,
    )
    sinks = (_buf("sinks", "float"),) if a.sinks else ()
    params = (_buf("part", "float"), *sinks, _buf("y", c.act.c_type, False), _M)
    return Kernel(name, source, params, (THREADS, 1, 1), _headers(), collectives=False)


def attention_prefill_kernel(a: AttentionSpec) -> Kernel:
    name = f"attn_prefill_{a._tag()}_r{PREFILL_ROWS}"
    # heads wider than 128 keep the prefill's tiles in the activation type (48 KB of shared memory)
    wide = a.cache.head_dim > 128
    source = render("attention_prefill.cu.j2", rows=PREFILL_ROWS, wide=wide, **a._context(name))
    params = (*_attention_inputs(a, sinks=True), _buf("y", a.cache.act.c_type, False), _M)
    return Kernel(name, source, params, (THREADS, 1, 1), _headers())


# Threads of the sampling kernel's block (one block per row).
SAMPLE_THREADS = 256


def sample_kernel(act: DType, vocab: int) -> Kernel:
    name = f"sample_{act.name}_v{vocab}"
    source = render(
        "sample.cu.j2",
        name=name,
        act_t=act.c_type,
        vocab=vocab,
        threads=SAMPLE_THREADS,
        exp_desc="k = floor(x log2(e) + 1/2), r = x - k ln2, Taylor to r^12, times 2^k",
        exp_floor=c_double(sampling.EXP_FLOOR),
        log2e=c_double(sampling.LOG2E),
        ln2_hi=c_double(sampling.LN2_HI),
        ln2_lo=c_double(sampling.LN2_LO),
        exp_coeffs=[c_double(c) for c in sampling.EXP_COEFFS],
        mass_bits=sampling.MASS_BITS,
        mass_scale=c_double(2.0**sampling.MASS_BITS),
    )
    params = (
        _buf("logits", act.c_type),
        _buf("params", "float"),
        _buf("seed", "int32_t"),
        _buf("pos", "int32_t"),
        _buf("next", "int32_t", False),
        _M,
    )
    return Kernel(name, source, params, (SAMPLE_THREADS, 1, 1), _headers())


def adjust_logits_kernel(act: DType, vocab: int, entries: int) -> Kernel:
    name = f"adjust_logits_{act.name}_v{vocab}_c{entries}"
    words = logits.allow_words(vocab)
    source = render(
        "adjust_logits.cu.j2",
        name=name,
        act_t=act.c_type,
        vocab=vocab,
        entries=entries,
        words=words,
        threads=SAMPLE_THREADS,
    )
    params = (
        _buf("logits", act.c_type),
        _buf("penalties", "float"),
        _buf("tokens", "int32_t"),
        _buf("counts", "int32_t"),
        _buf("bias", "float"),
        _buf("allow", "int32_t"),
        _buf("out", "float", False),
        _M,
    )
    return Kernel(name, source, params, (SAMPLE_THREADS, 1, 1), _headers())


def logprobs_kernel(act: DType, vocab: int, k: int) -> Kernel:
    name = f"logprobs_{act.name}_v{vocab}_k{k}"
    source = render(
        "logprobs.cu.j2",
        name=name,
        act_t=act.c_type,
        vocab=vocab,
        k=k,
        threads=SAMPLE_THREADS,
        drawn_flag=logits.DRAWN,
    )
    params = (
        _buf("logits", act.c_type),
        _buf("drawn", "int32_t"),
        _buf("targets", "int32_t"),
        _buf("ids", "int32_t", False),
        _buf("values", "float", False),
        _M,
    )
    return Kernel(name, source, params, (SAMPLE_THREADS, 1, 1), _headers())


def embedding_kernel(
    table: QWeight, act: DType, scale: float | None = None
) -> tuple[Kernel, int, tuple[str, ...]]:
    """The gather kernel, its grid.x and the format's buffers in parameter order; with `scale`
    each row, rounded to `act`, times it (Gemma)."""
    frag = fragment_for(table.format, table.out_features, table.in_features)
    frag_params = [{"c_type": p.c_type, "suffix": p.name.removeprefix("w_")} for p in frag.params]
    chunks = frag.chunks_per_row(table.in_features)
    name = f"embedding_{table.format.tag()}_{act.name}_v{table.out_features}_k{table.in_features}"
    if scale is not None:
        name += f"_x{scale:g}".replace(".", "p").replace("+", "")
    source = render(
        "embedding.cu.j2",
        scale=None if scale is None else f"{float(scale)!r}f",
        name=name,
        format_spelling=table.format.spell(),
        fragment_template=frag.template,
        frag_params=frag_params,
        act_t=act.c_type,
        vocab=table.out_features,
        K=table.in_features,
        chunks_per_row=chunks,
        threads=THREADS,
        **frag.context,
    )
    params = (
        _buf("ids", "int32_t"),
        *(KernelParam(p.name, p.c_type, "buffer") for p in frag.params),
        _buf("y", act.c_type, False),
        _M,
    )
    kernel = Kernel(name, source, params, (THREADS, 1, 1), (common_header(),), collectives=False)
    return kernel, -(-chunks // THREADS), frag.buffers
