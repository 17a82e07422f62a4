"""Paged KV caches: kv_append and attention through a block table, the kernels against the
interpreter on ragged batches (rows of different sequences and lengths, pages out of order, a
page boundary inside a prompt, padding rows at -1), in both kernel families (rows of many
sequences: split-K; rows of one sequence: tiled), under a reversed schedule."""

from __future__ import annotations

import numpy as np
import pytest

from qir.api import compile
from qir.builder import Builder, Value
from qir.codegen.layer_kernels import (
    AttentionSpec,
    CacheShape,
    RopeSpec,
    attention_prefill_kernel,
    attention_split_kernel,
    kv_append_kernel,
)
from qir.dtypes import BF16, F16, F32, I32, DType
from qir.interpret import BindError, interpret
from qir.ops import IRTypeError
from qir.runtime import nvrtc
from qir.types import TensorType
from tests.conftest import BACKENDS

PAGE, PAGES, TABLE = 8, 12, 5  # a pool of 12 pages of 8 rows; 40 positions per sequence
HEADS, KV_HEADS, D = 4, 2, 32


def paged_graph(act: DType) -> Builder:
    b = Builder("paged")
    q = b.input("q", ("M", HEADS * D), act)
    k = b.input("k", ("M", KV_HEADS * D), act)
    v = b.input("v", ("M", KV_HEADS * D), act)
    pos = b.input("pos", ("M",), I32)
    pages = b.input("pages", ("M", TABLE), I32)
    cache = TensorType((PAGES * PAGE, KV_HEADS, D), act)
    kc, vc = b.state("k", cache, name="kc"), b.state("v", cache, name="vc")
    rope = {"head_dim": D, "theta": 10000.0, "rope_type": "default"}
    kc, vc = b.kv_append(
        kc, vc, b.rope(k, pos, rope), v, pos, name="kv", pages=pages, page_size=PAGE
    )
    a = b.attention(b.rope(q, pos, rope), kc, vc, pos, name="attn", pages=pages, page_size=PAGE)
    b.output("y", a)
    return b


# Three sequences on shuffled pages: A has 13 positions, B 21, C 3 (pages 1, 2, 3 of 8 rows).
TABLES = {
    "A": [7, 2, 0, 0, 0],
    "B": [4, 9, 11, 0, 0],
    "C": [5, 0, 0, 0, 0],
}


def rows(rng: np.random.Generator, act: DType, seqs: list[tuple[str, list[int]]]) -> dict:
    """Inputs with one row per (sequence, position); position -1 rows are padding."""
    m = len([p for _, ps in seqs for p in ps])
    table = np.array([TABLES[s] for s, ps in seqs for _ in ps], np.int32)
    return {
        "q": rng.standard_normal((m, HEADS * D)).astype(act.np),
        "k": rng.standard_normal((m, KV_HEADS * D)).astype(act.np),
        "v": rng.standard_normal((m, KV_HEADS * D)).astype(act.np),
        "pos": np.array([p for _, ps in seqs for p in ps], np.int32),
        "pages": table,
    }


def prompts_then_decodes() -> list[list[tuple[str, list[int]]]]:
    return [
        [("A", list(range(13)))],  # a prefill crossing a page boundary (8)
        [("B", list(range(21)))],
        [("C", [0, 1, 2])],
        # a decode batch: one row per sequence, and padding rows
        [("B", [21]), ("A", [13]), ("C", [3]), ("A", [-1]), ("B", [-1])],
        [("C", [4]), ("B", [22])],
    ]


def run_all(compiled, act: DType, both: bool) -> list[np.ndarray]:
    """Every run of prompts_then_decodes, in order, on one block (its caches carry over); a
    one-sequence run also in the other kernel family (it rewrites the same rows)."""
    rng = np.random.default_rng(1)
    outs = []
    for run in prompts_then_decodes():
        x = rows(rng, act, run)
        kinds = ["one", "many"] if len({s for s, _ in run}) == 1 and both else ["many"]
        for kind in kinds:
            y = compiled(x, rows=kind)["y"] if compiled.backend != "reference" else compiled(x)["y"]
            outs.append(np.asarray(y).view(act.np).copy())
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", [F16, F32], ids=lambda d: d.name)
def test_paged_kernels_equal_the_interpreter(backend, act, monkeypatch) -> None:
    graph = paged_graph(act).graph
    ref = compile(graph, {}, backend="reference")
    ours = compile(graph, {}, backend=backend)
    want, got = run_all(ref, act, False), run_all(ours, act, True)
    tol = 2e-3 if act == F16 else 1e-5
    expanded = []
    for run, w in zip(prompts_then_decodes(), want, strict=True):
        expanded += [w, w] if len({s for s, _ in run}) == 1 else [w]
    for i, (g, w) in enumerate(zip(got, expanded, strict=True)):
        g32, w32 = g.astype(np.float32), w.astype(np.float32)
        assert np.max(np.abs(g32 - w32)) <= tol * max(1.0, float(np.max(np.abs(w32)))), i
    decode = prompts_then_decodes()[3]
    padding = rows(np.random.default_rng(0), act, decode)["pos"] < 0
    assert padding.any() and not got[-2][padding].any() and not expanded[-2][padding].any()
    # The caches, through the pages: every row as the interpreter wrote it (v copied, k rotated
    # by RoPE: the kernel's sinf/cosf may round an f32 ulp away from numpy's).
    state_ref, state_ours = ref.state(), ours.state()
    assert np.array_equal(np.asarray(state_ours["v"]).view(act.np), state_ref["v"])
    k = np.asarray(state_ours["k"]).view(act.np).astype(np.float32)
    np.testing.assert_allclose(k, state_ref["k"].astype(np.float32), rtol=tol, atol=tol)
    if backend == "host":  # no race: a reversed schedule gives the same bytes
        monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
        backward = run_all(compile(graph, {}, backend="host"), act, True)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, backward, strict=True))


def test_paged_semantics_match_a_contiguous_cache() -> None:
    """One sequence on pages 0, 1, 2 in order is the unpaged cache of its positions."""
    rng = np.random.default_rng(2)
    paged = paged_graph(F32).graph
    b = Builder("flat")
    q = b.input("q", ("M", HEADS * D), F32)
    k = b.input("k", ("M", KV_HEADS * D), F32)
    v = b.input("v", ("M", KV_HEADS * D), F32)
    pos = b.input("pos", ("M",), I32)
    cache = TensorType((TABLE * PAGE, KV_HEADS, D), F32)
    kc, vc = b.state("k", cache), b.state("v", cache)
    rope = {"head_dim": D, "theta": 10000.0, "rope_type": "default"}
    kc, vc = b.kv_append(kc, vc, b.rope(k, pos, rope), v, pos)
    b.output("y", b.attention(b.rope(q, pos, rope), kc, vc, pos))
    x = rows(rng, F32, [("A", list(range(17)))])
    x["pages"][:] = [0, 1, 2, 3, 4]
    flat = {k: a for k, a in x.items() if k != "pages"}
    np.testing.assert_allclose(
        interpret(paged, x, {})["y"], interpret(b.graph, flat, {})["y"], rtol=1e-6, atol=1e-6
    )


def test_bad_tables_and_positions_are_named() -> None:
    graph = paged_graph(F32).graph
    x = rows(np.random.default_rng(3), F32, [("A", [0, 1])])
    x["pages"][:, 0] = PAGES  # outside the pool
    with pytest.raises(BindError, match=r"block table pages 12\.\.12 are outside the pool of 12"):
        interpret(graph, x, {})
    x = rows(np.random.default_rng(3), F32, [("A", [0, TABLE * PAGE])])
    with pytest.raises(BindError, match=r"positions 0\.\.40 are outside the 40 a block table"):
        interpret(graph, x, {})
    b = paged_graph(F32)
    cache = TensorType((PAGES * PAGE, KV_HEADS, D), F32)
    kc, vc = b.state("k2", cache), b.state("v2", cache)
    q, pos, pages = (b.graph.node(n) for n in ("q", "pos", "pages"))
    with pytest.raises(IRTypeError, match="page_size must be an int >= 1 dividing"):
        b.attention(
            Value("q", q.type),
            kc,
            vc,
            Value("pos", pos.type),
            pages=Value("pages", pages.type),
            page_size=7,
        )


@pytest.mark.skipif(not nvrtc.available(), reason="needs cuda-core 1.x (qir[compile])")
def test_paged_kernels_build_without_spills() -> None:
    """Llama-3-8B's attention (32 heads on 8, head_dim 128), paged, bf16: the kv_append and both
    attention families on sm_80/90/100a/120a."""
    cache = CacheShape(BF16, 4096 * 16, 8, 128, page_size=16, table_pages=256)
    rope = RopeSpec.of({"head_dim": 128, "theta": 500000.0, "rope_type": "default"})
    spec = AttentionSpec(cache, 32, 128**-0.5, rope)
    for kernel in (
        kv_append_kernel(cache, rope),
        attention_split_kernel(spec),
        attention_prefill_kernel(spec),
    ):
        nvrtc.check_no_spills(kernel)
