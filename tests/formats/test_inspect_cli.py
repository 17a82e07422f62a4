"""`qir inspect` and `qir dequant` on the FP fixtures: rows, written arrays, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from qir.cli import checkpoints as cli_checkpoints
from qir.cli import main
from tests.conftest import DATA

PROJ = {"q": "self_attn.q_proj", "down": "mlp.down_proj", "gate": "mlp.gate_proj"}


@pytest.mark.parametrize(
    ("case", "spelling", "bits", "group"),
    [
        ("ct_mxfp4a16_S", "mxfp4<>", "4", "32"),
        ("ct_fp8_dynamic_S", "fp8<granularity=channel>", "8", "-"),
        ("mlx_affine4_g64_S", "mlx_affine<bits=4,group_size=64,scale_dtype=bf16>", "4", "64"),
    ],
)
def test_inspect_rows(capsys, case, spelling, bits, group):
    assert main(["-q", "inspect", str(DATA / case)]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # not a TTY and fast: no progress lines
    lines = out.split("\n\n")[0].splitlines()
    assert lines[0].split() == [
        "module",
        "format",
        "bits",
        "group",
        "shape",
        "[out,",
        "in]",
        "bytes",
        "W4A4",
    ]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:-1]}
    assert len(rows) == 9 and lines[-1].startswith("9 linears, ")
    down = rows["model.layers.0.mlp.down_proj"]
    assert down[1:4] == [spelling, bits, group]
    assert down[4:6] == ["[256,", "512]"] and down[-1] == "no"
    assert rows["model.layers.0.self_attn.q_proj"][1] == spelling
    # Layer norms (1-D .weight) are not linears.
    assert not any("layernorm" in m or m == "model.norm" for m in rows)


def test_inspect_ct_lists_ignored_lm_head_as_dense(capsys):
    assert main(["-q", "inspect", str(DATA / "ct_mxfp4a16_S")]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]
    rows = {ln.split()[0]: ln.split() for ln in table.splitlines()[1:-1]}
    assert rows["lm_head"][1:4] == ["dense<dtype=bf16>", "16", "-"]
    assert rows["lm_head"][6] == str(256 * 256 * 2)


@pytest.mark.parametrize(
    "case",
    [
        "ct_nvfp4_w4a4_S",  # compressed-tensors NVFP4: ignore ["lm_head"]
        "modelopt_nvfp4_S",  # ModelOpt: exclude_modules ["lm_head", "model.embed_tokens"]
        "ct_nvfp4a16_S",
        "ct_w4a16_int4_S",
        "awq_gemm_g64_S",  # AutoAWQ never quantizes lm_head and does not list it
    ],
)
def test_inspect_lists_unquantized_lm_head_as_dense(capsys, case):
    assert main(["-q", "inspect", str(DATA / case)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    table = out.split("\n\n")[0].splitlines()
    rows = {ln.split()[0]: ln.split() for ln in table[1:-1]}
    dtype = "f16" if case.startswith("awq") else "bf16"
    for module in ("lm_head", "model.embed_tokens"):
        assert rows[module][1:4] == [f"dense<dtype={dtype}>", "16", "-"], module
        assert rows[module][4:7] == ["[256,", "256]", str(256 * 256 * 2)], module
    assert len(rows) == 9 and table[-1].startswith("9 linears, ")
    assert not rows["model.layers.0.self_attn.q_proj"][1].startswith("dense")


def test_inspect_progress_when_slow(capsys, monkeypatch):
    clock = iter(range(0, 1000, 2))  # every module "takes" 2 s
    monkeypatch.setattr(cli_checkpoints.time, "monotonic", lambda: float(next(clock)))
    assert main(["inspect", str(DATA / "ct_fp8_dynamic_S")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "qir: loading 1/9 modules" and err[-1] == "qir: loading 9/9 modules"


@pytest.mark.parametrize("case", ["ct_mxfp4a16_S", "ct_fp8_dynamic_S"])
@pytest.mark.parametrize("p", list(PROJ))
def test_dequant_writes_the_golden_weight(tmp_path, case, p):
    out = tmp_path / "W.npy"
    module = f"model.layers.0.{PROJ[p]}"
    assert main(["-q", "dequant", str(DATA / case), module, "-o", str(out)]) == 0
    w = np.load(out)
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, np.load(DATA / case / "golden.npz")[f"W.0.{p}"])


def test_dequant_bad_module_is_one_line_exit_2(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "qir.cli",
            "-q",
            "dequant",
            str(DATA / "ct_fp8_dynamic_S"),
            "model.layers.0.mlp.nope",
            "-o",
            str(tmp_path / "W.npy"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("qir: error: model.layers.0.mlp.nope: no such linear")
    assert not (tmp_path / "W.npy").exists()


def test_inspect_missing_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
