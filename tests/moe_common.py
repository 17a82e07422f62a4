"""What the mixture-of-experts tests share: random stacked experts, an MoE MLP graph, and a
Qwen2-MoE checkpoint that two ranks can split."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
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
    with_weights: bool = True,
) -> tuple[Graph, Weights]:
    """y = x + moe(x): a dense router (in the activation type), `rule` choosing k of `experts`,
    gate/up with silu(g) * u, down combined with the router's weights and the residual x.
    `norm`: the router and gate/up read rms_norm(x, w) (a decoder layer's post-attention norm,
    w a bf16 vector), the residual is still x. Outputs y, the logits and the ids. Without
    `with_weights` the experts get no weights (the graph alone is what lowering reads;
    quantizing 3 x 8 random experts at a checkpoint's shapes takes seconds)."""
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
        if with_weights:
            qe, weights[name] = random_experts(rng, experts, o, i, fmt)
        else:
            qe = QExperts(QWeight(fmt, o, i), experts)
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


def mixtral_nvfp4(out: Path) -> Path:
    """mixtral_awq_gemm_g64's weights re-quantized as ModelOpt writes NVFP4 W4A4 (weight,
    weight_scale E4M3, weight_scale_2 and input_scale float32 scalars; the router excluded, as
    ModelOpt's configs leave it): every expert calibrated for its own input amax, gate (w1) and
    up (w3) for the same one with one global scale, as ModelOpt shares them across a fused pair.
    Its numbers are the interpreter's, not transformers'."""
    from qir.formats.nvfp4 import Nvfp4
    from qir.models import load
    from tests.models.test_nvfp4_families import _save

    src = DATA / "mixtral_awq_gemm_g64"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out)
    ck = load(src)
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items()}
    modules = sorted({k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")})
    dense = {m: ck.linear(m) for m in modules}
    floats = {
        m: lin.weight.format.dequantize(
            lin.buffers, lin.weight.out_features, lin.weight.in_features
        )
        for m, lin in dense.items()
    }
    fmt = Nvfp4("mul", 4)
    for m in modules:
        for suffix in ("qweight", "qzeros", "scales"):
            tensors.pop(f"{m}.{suffix}")
        expert = m.split(".experts.")[1].split(".")[0] if ".experts." in m else None
        # one amax per expert (its w1 and w3 alike), about what the fixture's inputs reach
        # (x up to 4-5, h up to 7-8 on its golden tokens), 5 for the attention inputs
        e = -1 if expert is None else int(expert)
        amax = 5.0 if e < 0 else (6.0 + e if m.endswith("w2") else 4.0 + 0.5 * e)
        pair = [p for p in (m[:-2] + "w1", m[:-2] + "w3") if m.endswith(("w1", "w3"))]
        g = max(float(np.abs(floats[p]).max()) for p in pair) if pair else None
        bufs = fmt.quantize(floats[m], global_amax=g, input_amax=amax)
        tensors[f"{m}.weight"] = bufs["weight"]
        tensors[f"{m}.weight_scale"] = bufs["block_scale"].view(ml_dtypes.float8_e4m3fn)
        tensors[f"{m}.weight_scale_2"] = bufs["global_scale"].reshape(())
        tensors[f"{m}.input_scale"] = bufs["input_scale"].reshape(())
    _save(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    quant = json.loads((DATA / "modelopt_nvfp4_S" / "config.json").read_text())[
        "quantization_config"
    ]
    quant["ignore"] = [*quant["ignore"], "model.layers.*.block_sparse_moe.gate"]
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=4))
    hf = json.loads((DATA / "modelopt_nvfp4_S" / "hf_quant_config.json").read_text())
    hf["quantization"]["exclude_modules"] = quant["ignore"]
    (out / "hf_quant_config.json").write_text(json.dumps(hf, indent=4))
    return out
