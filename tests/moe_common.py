"""What the mixture-of-experts tests share: random stacked experts, an MoE MLP graph, and a
Qwen2-MoE checkpoint that two ranks can split."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qir.builder import Builder
from qir.dtypes import BF16, F16, DType
from qir.formats.base import WeightFormat
from qir.formats.dense import Dense
from qir.formats.mlx import MlxAffine
from qir.graph import Graph
from qir.types import QExperts, QWeight, TensorType
from tests.conftest import DATA, random_weight

Weights = dict[str, dict[str, np.ndarray]]


def random_experts(
    rng: np.random.Generator, count: int, out_f: int, in_f: int, fmt: WeightFormat
) -> tuple[QExperts, dict[str, np.ndarray]]:
    """`count` random experts of one format and shape, stacked (each buffer [count, ...])."""
    per = [random_weight(rng, out_f, in_f, fmt) for _ in range(count)]
    qw = per[0][0]
    stacked = {n: np.stack([bufs[n] for _, bufs in per]) for n in per[0][1]}
    return QExperts(qw, count), stacked


def moe_graph(
    rng: np.random.Generator,
    hidden: int,
    inter: int,
    experts: int,
    k: int,
    fmt: WeightFormat,
    act: DType = F16,
    rule: str = "softmax_topk_norm",
    router_scale: float = 1.0,
    norm: bool = False,
) -> tuple[Graph, Weights]:
    """y = x + moe(x): a dense router (in the activation type), `rule` choosing k of `experts`,
    gate/up with silu(g) * u, down combined with the router's weights and the residual x.
    `norm`: the router and gate/up read rms_norm(x, w) (a decoder layer's post-attention norm,
    w a bf16 vector), the residual is still x. Outputs y, the logits and the ids."""
    b = Builder("moe")
    weights: Weights = {}
    r = x = b.input("x", ("M", hidden), act)
    if norm:
        weights["norm"] = {"weight": (1 + rng.standard_normal(hidden) / 8).astype(BF16.np)}
        x = b.rms_norm(x, b.param("norm", TensorType((hidden,), BF16), name="w_norm"), 1e-5)
    router_fmt = Dense(act)
    w = rng.standard_normal((experts, hidden), dtype=np.float32) * router_scale / hidden**0.5
    weights["router"] = router_fmt.quantize(w)
    router = b.weight("router", QWeight(router_fmt, experts, hidden), name="w_router")
    logits = b.qlinear(x, router, name="logits")
    ids, rw = b.route(logits, k, rule, name="route")
    ws = {}
    for name, (o, i) in {
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }.items():
        qe, bufs = random_experts(rng, experts, o, i, fmt)
        weights[name] = bufs
        ws[name] = b.weight(name, qe, name=f"w_{name}")
    h = b.expert_qlinear(x, (ws["gate"], ws["up"]), ids, name="h")
    y = b.expert_qlinear(h, ws["down"], ids, rw, r, name="y")
    b.output("y", y)
    b.output("logits", logits)
    b.output("ids", ids)
    return b.graph, weights


def inputs(
    rng: np.random.Generator, m: int, hidden: int, act: DType = F16
) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((m, hidden), dtype=np.float32).astype(act.np)}


def qwen2moe_g32(out: Path) -> Path:
    """qwen2moe_mlx4_g64 (mlx-lm's, with its shared expert) whose routed down_proj experts are
    re-quantized by MLX's affine rule in groups of 32 (a per-module entry in config.json, as
    mlx-lm writes mixed ones), so 2 ranks can cut their 64 inputs: the other linears, the
    shared expert's included, stay as mlx-lm wrote them. A split test compares it with itself
    unsplit; its numbers are not the fixture's goldens."""
    src = DATA / "qwen2moe_mlx4_g64"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "generation_config.json", out)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    g64, g32 = MlxAffine(4, 64, BF16), MlxAffine(4, 32, F16)
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        module = f"model.layers.{layer}.mlp.switch_mlp.down_proj"
        stacked = {b: tensors[f"{module}.{b}"] for b in ("weight", "scales", "biases")}
        experts = [
            g32.quantize(g64.dequantize({b: v[e] for b, v in stacked.items()}, hidden, inter))
            for e in range(config["num_experts"])
        ]
        for b in stacked:
            tensors[f"{module}.{b}"] = np.stack([x[b] for x in experts])
        for key in ("quantization", "quantization_config"):
            config[key][module] = {"group_size": 32, "bits": 4}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=4))
    return out


def copy_fixture(tmp_path: Path, fixture: str) -> Path:
    """A copy of tests/data/`fixture` to break."""
    dst = tmp_path / fixture
    shutil.copytree(DATA / fixture, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def refused(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `qir run` prints refusing the checkpoint at `path` (exit 2)."""
    from qir.cli import main

    argv = ["-q", "run", str(path), "--block", "model", "--tokens", "3,10"]
    assert main([*argv, "--out", str(path / "y.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err
