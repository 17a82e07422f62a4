"""The benchmarks run end to end on the host backend at a tiny scale, so a lent GPU's few minutes
are never spent finding a crash. Their timings are printed, not asserted."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.requires import have, requires

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str) -> ModuleType:
    """A benchmark script as a module (they are scripts, not a package)."""
    if f"benchmarks.{name}" in sys.modules:
        return sys.modules[f"benchmarks.{name}"]
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_llama_shapes_on_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("llama_shapes")
    out = tmp_path / "rows.json"
    argv = ["--backend", "host", "--m", "1", "--repeat", "1", "--formats", "ct4g128bf16"]
    rows = bench.main([*argv, "--json", str(out)])
    launches = {(r.block, r.variant): r.launches for r in rows}
    # Fusion shows in the launch counts: MLP 6 -> 2 (4 without SiLU fusion), q/k/v 3 -> 1.
    assert launches == {
        ("mlp", "fused"): 2,
        ("mlp", "silu_prologue"): 2,
        ("mlp", "no_silu_fusion"): 4,
        ("mlp", "unfused"): 6,
        ("qkv", "fused"): 1,
        ("qkv", "unfused"): 3,
    }
    assert all(r.us > 0 and r.mib > 0 for r in rows)
    assert json.loads(out.read_text())["rows"][0]["format"] == "ct4g128bf16"
    assert "mlp  M=1   fused" in capsys.readouterr().out


def test_llama_shapes_refuses_an_unknown_format() -> None:
    with pytest.raises(SystemExit):
        load("llama_shapes").main(["--backend", "host", "--formats", "int3"])


def test_tiled_weights_repeat_one_quantized_tile() -> None:
    """200 rows (not a multiple of the 64-row tile) of every benchmarked format decode to the
    first tile, repeated: the tiling keeps each buffer's layout."""
    bench = load("llama_shapes")
    for fmt in bench.FORMATS:
        qw, bufs = bench.tiled_weight(np.random.default_rng(0), fmt, 200, 256)
        w = fmt.dequantize(bufs, qw.out_features, qw.in_features)
        assert w.shape == (200, 256) and np.abs(w).max() > 0, fmt.spell()
        np.testing.assert_array_equal(w, np.tile(w[:64], (4, 1))[:200], err_msg=fmt.spell())


@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_dense_baseline_computes_the_block_in_place(block: str) -> None:
    """The cuBLAS baseline's computation, run with numpy: on a GPU it is only reached after
    every qir row is timed, so a crash there would lose them. It writes preallocated buffers
    (a CUDA graph replays them) and computes the block."""
    bench = load("llama_shapes")
    dense = bench.dense_block(np, block, bench.dims(1 / 32), 3, seed=0)
    outs = [o.copy() for o in dense.outs]
    dense.run()
    assert all(not np.array_equal(o, before) for o, before in zip(dense.outs, outs, strict=True))
    x, ws = dense.x.astype(np.float32), [w.astype(np.float32) for w in dense.weights]
    if block == "mlp":
        g, u = x @ ws[0], x @ ws[1]
        want = [x + (g / (1 + np.exp(-g)) * u) @ ws[2]]
    else:
        want = [x @ w for w in ws]
    for got, ref in zip(dense.outs, want, strict=True):
        assert got.dtype == np.float16 and got.shape == ref.shape
        assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max()


class FakeStream:
    """Records what the benchmark asks of a CUDA stream; capture can be made to fail."""

    def __init__(self, capture_fails: bool) -> None:
        self.capture_fails = capture_fails
        self.log: list[str] = []

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None: ...

    def synchronize(self) -> None:
        self.log.append("sync")

    def begin_capture(self) -> None:
        if self.capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.log.append("begin")

    def end_capture(self) -> types.SimpleNamespace:
        self.log.append("end")
        return types.SimpleNamespace(launch=lambda stream: self.log.append("launch"))


def fake_cupy() -> types.SimpleNamespace:
    """numpy under CuPy's names, with events that time every sample as 1 ms."""
    names = ("asarray", "empty", "matmul", "negative", "exp", "add", "divide", "multiply")
    event = types.SimpleNamespace(record=lambda stream: None, synchronize=lambda: None)
    cuda = types.SimpleNamespace(Event=lambda: event, get_elapsed_time=lambda a, b: 1.0)
    return types.SimpleNamespace(
        float16=np.float16, cuda=cuda, **{n: getattr(np, n) for n in names}
    )


@pytest.mark.parametrize(("capture_fails", "how"), [(False, "graph"), (True, "eager")])
def test_cublas_baseline_replays_graphs_or_says_it_ran_eagerly(capture_fails: bool, how: str):
    bench = load("llama_shapes")
    timer = bench.Timer("host", repeat=3, inner=4)
    timer.backend, timer._cp, timer.l2_bytes = "cuda", fake_cupy(), 1 << 20
    timer.stream = FakeStream(capture_fails)
    seconds, got = bench.cublas_seconds(timer, "qkv", bench.dims(1 / 32), 2)
    assert got == how and seconds == pytest.approx(1e-3 / 4)
    copies = timer.copies(2 * 128 * (128 + 2 * 128))
    assert copies > 1  # the fake L2 holds more than one copy of these weights
    if how == "graph":
        # each copy: a first call outside the capture, then captured; then only replays
        assert timer.stream.log[: 3 * copies] == ["sync", "begin", "end"] * copies
        assert set(timer.stream.log[3 * copies :]) == {"launch"}


def test_compile_scale_on_tiny_models(capsys: pytest.CaptureFixture[str]) -> None:
    rows = load("compile_scale").main(["--layers", "1", "2", "--repeat", "1", "--scale", "32"])
    # a layer is 3 qlinear launches (q/k/v, gate/up, down), each a GEMV and two GEMM tile
    # buckets; W4A4 adds 3 quantize_act, and its GEMMs to 64 rows have 16-bit twins above
    assert [(r.format, r.layers, r.launches) for r in rows] == [
        ("w4a16", 1, 9),
        ("w4a16", 2, 18),
        ("w4a4", 1, 12),
        ("w4a4", 2, 24),
    ]
    assert all(r.passes > 0 and r.lower > 0 and r.render > 0 for r in rows)
    assert "time at 2 layers / time at 1 (2 if linear)" in capsys.readouterr().out


def test_llama_shapes_sweep_on_host(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a GPU the M sweep says so, prints its plan (GEMV for decode, the GEMM's tiles for
    prefill) and times the host backend's GEMM against its GEMV."""
    bench = load("llama_shapes")
    argv = ["--backend", "host", "--no-blocks", "--sweep", "--formats", "mlx4g64bf16"]
    bench.main([*argv, "--shapes", "o", "--sweep-m", "1", "4096", "--repeat", "1"])
    out = capsys.readouterr().out
    assert "M sweep (device time, GB/s, TFLOP/s, vs cuBLAS f16): not measured: no GPU" in out
    assert "M=1     qgemv_mlx4g64bf16_f16_n4096_k4096_m8 grid [256, 1, 1]" in out
    assert "M=4096  qgemm_mlx4g64bf16_f16_n4096_k4096_128x128x32s2w2x4 grid [32, 32, 1]" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("host backend, [256, 256]"))
    times = dict(re.findall(r"(GEMM|GEMV) ([\d.]+) ms", line))
    assert float(times["GEMM"]) > 0 and float(times["GEMV"]) > 0


@requires("nvrtc")
def test_static_roofline_on_one_format(capsys: pytest.CaptureFixture[str]) -> None:
    """The o projection (4096 -> 4096) of one format at M = 1 and 8 for sm_90: one kernel,
    the H100 and H200 bounds beside it; with nvdisasm, a cost that grows with M."""

    rows = load("static_roofline").main(["--formats", "awq4g128", "--blocks", "o", "--m", "1", "8"])
    assert [(r.format, r.m, r.block) for r in rows] == [("awq4g128", 1, "o"), ("awq4g128", 8, "o")]
    assert {r.cost.name for r in rows} == {"qgemv_awq4g128_f16_n4096_k4096_m8"}
    out = capsys.readouterr().out
    assert "bound H200" in out and "bound H100" in out and "H200: budget 112" in out
    if have("nvdisasm"):
        one, eight = (r.cost.instr_per_512 for r in rows)
        assert one is not None and eight is not None and eight > one > 0
        assert out.count("-bound at ") == 4  # two rows, two GPUs


def test_layer_decode_on_host(capsys: pytest.CaptureFixture[str]) -> None:
    """A layer's decode step fused and as its sub-blocks, and a 1-layer model's tokens/s, at
    1/32 of Llama-3-8B's widths."""
    bench = load("layer_decode")
    argv = ["--backend", "host", "--scale", "0.03125", "--repeat", "1", "--layers", "1"]
    rows = bench.main([*argv, "--position", "40", "--max-seq", "64"])
    launches = {r.name: r.launches for r in rows}
    # One capture of the layer replays what its sub-blocks launch one by one: 7 = 1 + 3 + 1 + 2
    # (each norm computed in the projection that reads it).
    assert launches == {
        "layer": 7,
        "norm_qkv": 1,
        "attention": 3,
        "o_proj": 1,
        "norm_mlp": 2,
        # embedding, the layer, lm_head (with the final norm), the logits' adjustments (penalties,
        # bias, allowed ids), sample, the drawn and top ids' logprobs
        "model x1": 12,
    }
    assert all(r.ms > 0 for r in rows)
    assert "tokens/s" in capsys.readouterr().out


def test_sampling_on_host(capsys: pytest.CaptureFixture[str]) -> None:
    rows = load("sampling").main(["--backend", "host", "--vocab", "300", "--repeat", "1"])
    assert [(v, s) for v, s, _, _ in rows] == [
        (300, "greedy"),
        (300, "temperature"),
        (300, "top-k/p, min-p"),
    ]
    assert all(k > 0 and h > 0 for _, _, k, h in rows)
    assert capsys.readouterr().out.count("\n") == 2 + len(rows)


def test_serve_on_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qir serve` under a small load: the same requests all at once and one at a time."""
    bench = load("serve")
    mixed = bench.jobs(4, [2, 5], [2, 3], seed=0)
    assert {(len(j.prompt.split()), j.max_tokens) for j in mixed} == {
        (2, 2),
        (2, 3),
        (5, 2),
        (5, 3),
    }
    out = tmp_path / "serve.json"
    argv = ["--backend", "host", "--requests", "3", "--prompt-words", "2", "5"]
    rows = bench.main([*argv, "--output-tokens", "2", "3", "--warmup", "0", "--json", str(out)])
    assert [(r.mode, r.requests) for r in rows] == [("one at a time", 3), ("all at once", 3)]
    for r in rows:
        # 8 tokens in all (2 + 3 + 3), each request checked to return its max_tokens
        assert r.tokens_per_s * r.wall_s == pytest.approx(8)
        assert all(v > 0 for v in (*r.ttft_ms, *r.itl_ms)) and r.ttft_ms[0] <= r.ttft_ms[2]
    written = json.loads(out.read_text())
    assert written["rows"][1]["mode"] == "all at once"
    cache = written["prefix_cache"]
    assert cache["prefix_words"] == 24 and cache["cold_ttft_ms"] > 0
    assert cache["ratio"] == pytest.approx(cache["cold_ttft_ms"] / cache["repeated_prefix_ttft_ms"])
    printed = capsys.readouterr().out
    assert "batching ratio" in printed and "repeated prefix" in printed


def test_moe_on_host(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss-20b's layer shrunk to 8 experts (top 4) of 128 x 128 MXFP4: the bytes a decode
    step reads are the router's and 4 experts', from the format's facts (4-bit codes and an
    E8M0 byte per 32 weights); decode runs the expert GEMVs, a 24-token prefill the grouped
    path."""
    argv = ["--backend", "host", "--models", "gpt-oss-20b", "--experts", "8", "--scale", "0.04"]
    rows = load("moe").main([*argv, "--prefill", "24", "--repeat", "1"])
    (r,) = rows
    assert (r.shape.hidden, r.shape.inter, r.shape.experts, r.shape.k) == (128, 128, 8, 4)
    expert = 3 * 128 * 128 * (4 / 8 + 1 / 32)
    router = 8 * 128 * 2  # f16
    assert (r.bytes_ours, r.bytes_all) == (router + 4 * expert, router + 8 * expert)
    assert r.bytes_ratio == pytest.approx((router + 8 * expert) / (router + 4 * expert))
    assert all(t > 0 for t in (r.decode_ms, r.decode_all_ms, r.prefill_ms))
    assert r.prefill_per_expert_ms > 0
    assert sum(n.startswith("moe_gemv_") for n in r.decode_kernels) == 2
    assert not any(n.startswith("moe_qgemm_") for n in r.decode_kernels)
    assert sum(n.startswith("moe_qgemm_") for n in r.prefill_kernels) == 2
    out = capsys.readouterr().out
    assert "reduced from hidden 2880, inter 2880, 32 experts top 4" in out
    assert re.search(r"gpt-oss-20b\s+mxfp4\s+8\s+4\s", out)


def test_tp_scaling_on_host(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("tp")
    argv = ["--tp", "1", "2", "--hidden", "128", "--layers", "1", "--vocab", "256"]
    rows = bench.main([*argv, "--tokens", "3", "--repeat", "1"])
    assert [r[0] for r in rows] == [1, 2]
    assert all(tps > 0 for _, tps, _ in rows) and rows[0][2] == 1.0
    assert "tokens/s" in capsys.readouterr().out


def test_host_vs_llamacpp_says_when_llama_cpp_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without llama.cpp the comparison still runs qir and says that it ran alone (CI has no
    llama.cpp: it takes a 20-minute build)."""
    bench = load("host_vs_llamacpp")
    monkeypatch.setattr(bench, "llama_cpp_or_none", lambda: None)
    data = Path(__file__).resolve().parent / "data" / "mlx_affine4_g64_S"
    argv = [str(data), "--new-tokens", "3", "--repeat", "2", "--threads", "1"]
    result = bench.main(argv)
    out = capsys.readouterr().out
    assert "llama.cpp: not installed" in out
    assert set(result) == {"qir prefill", "qir decode"}
    assert all(v > 0 for v in result.values())
    with pytest.raises(SystemExit):
        bench.main([str(data), "--new-tokens", "1"])  # too few to time a decode


def test_gguf_kl_says_when_llama_cpp_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without llama.cpp there is nothing to compare: the KL report says so, before loading
    any model, and ends well (CI has no llama.cpp)."""
    bench = load("gguf_kl")
    monkeypatch.setattr(bench, "llama_cpp_or_none", lambda: None)
    assert bench.main([]) == {}
    assert "llama.cpp: not installed" in capsys.readouterr().out


def test_gguf_kl_is_llama_perplexitys_kld() -> None:
    """KL(base || test), the base's probabilities weighing the log ratio: 0 for logits equal
    up to a shift, and the two-outcome value by hand."""
    kl = load("gguf_kl").kl
    base = np.array([[0.0, 0.0], [np.log(3.0), 0.0]])
    assert kl(base, base + 5.0) == pytest.approx([0.0, 0.0], abs=1e-12)
    # p = (1/2, 1/2) against q = (3/4, 1/4); p = (3/4, 1/4) against q = (1/2, 1/2)
    swapped = base[::-1]
    want = [
        0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25),
        0.75 * np.log(1.5) + 0.25 * np.log(0.5),
    ]
    np.testing.assert_allclose(kl(base, swapped), want, rtol=1e-12)


class FakeLlama:
    """llama-cpp-python's Llama, as the KL report uses it, computing qir's reference-backend
    float32 logits of the same file: the comparison's plumbing, with a KL of zero."""

    def __init__(self, model_path: str, logits_all: bool, n_ctx: int, **_: object) -> None:
        from qir.dtypes import F32
        from qir.models import Model

        assert logits_all
        self.model = Model.load(model_path, backend="reference", act=F32)
        self.scores = np.zeros((n_ctx, self.model.vocab_size), np.float32)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return list(self.model.encode(text.decode()))

    def reset(self) -> None: ...

    def eval(self, ids: list[int]) -> None:
        self.scores[: len(ids)] = self.model.logits(ids)


def test_gguf_kl_on_a_tiny_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole report on a tiny GGUF (no chat template: the chat prompts are left out), with
    llama.cpp standing in for itself as qir's reference backend."""
    bench = load("gguf_kl")
    fake = types.SimpleNamespace(Llama=FakeLlama, __version__="fake")
    gguf = Path(__file__).resolve().parent / "data" / "gguf_llama" / "model-F16.gguf"
    out = tmp_path / "kl.json"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(bench, "llama_cpp_or_none", lambda: fake)
        summary = bench.main([str(gguf), "--backend", "reference", "--json", str(out)])
    kinds = [k for k, _ in bench.PROMPTS]
    assert summary["prompts"] == len(kinds) - kinds.count("chat")
    assert summary["mean_kl"] == pytest.approx(0.0, abs=1e-9) and summary["top1"] == 1.0
    assert summary["tokenization_differs"] == 0
    rows = json.loads(out.read_text())["rows"]
    assert summary["positions"] == sum(r["ids"] for r in rows)
    assert "chat prompts left out" in capsys.readouterr().out
