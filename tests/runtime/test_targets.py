"""One target per plan (qir.target): what each implies, how lowering follows it (kernel names, the
FP4 decode, block-scaled FP4 GEMMs), the host running every target's kernels equal to the
interpreter, the cuda backend taking its device's, and `--arch` on the commands."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import qir
from qir.cli import main
from qir.codegen.kernel import Kernel
from qir.codegen.lower import lower
from qir.cost import sass
from qir.cost.resources import kernel_costs
from qir.dtypes import BF16, F16
from qir.errors import UsageError
from qir.formats.awq import Awq
from qir.formats.mlx import MlxAffine
from qir.formats.mx import Mxfp4
from qir.formats.nvfp4 import Nvfp4
from qir.passes.manager import run_pipeline
from qir.runtime import nvrtc
from qir.runtime.backend import resolve_target
from qir.runtime.cuda import CudaBackend, device_target
from qir.runtime.executor import CompiledBlock
from qir.target import DEFAULT, Target
from tests.conftest import DATA
from tests.moe_common import moe_graph
from tests.requires import requires
from tests.runtime.test_compile_gate import CHECKPOINT, mlp
from tests.runtime.test_cuda import FakeDevice, fake_cupy
from tests.runtime.test_every_format import block, close, inputs, w4a4
from tests.runtime.test_gemm_kernels import projections
from tests.runtime.test_moe_kernels import close as moe_close

W4A4 = DATA / "ct_nvfp4_w4a4_S"
needs_nvrtc = requires("nvrtc")
needs_sass = requires("nvdisasm")


def test_what_each_target_implies() -> None:
    facts = {
        a: (t.fp8_cvt, t.fp4_cvt, t.block_scaled_fp4_mma, t.reference_gpu)
        for a in ("sm_80", "sm_90", "sm_100a", "sm_120a", "sm_121a", "sm_120", "sm_89")
        for t in [Target(a)]
    }
    assert facts == {
        "sm_80": (False, False, False, "A100"),
        "sm_90": (True, False, False, "H200"),
        "sm_100a": (True, True, False, "B200"),
        "sm_120a": (True, True, True, "RTX 5090"),
        "sm_121a": (True, True, True, None),
        "sm_120": (True, False, False, "RTX 5090"),  # without its own instructions
        "sm_89": (True, False, False, None),
    }
    assert Target("sm_120a").smem_per_block == 99 * 1024
    assert Target("sm_90").smem_per_block == 227 * 1024
    assert Target("sm_120a").tag == "sm120a" and Target("sm_90") == DEFAULT
    # A device: CuPy's compute capability, with Blackwell's own instructions.
    assert [Target.of_capability(c).arch for c in ("80", "86", "90", "100", "120")] == [
        "sm_80",
        "sm_86",
        "sm_90",
        "sm_100a",
        "sm_120a",
    ]
    for bad in ("sm_75", "sm90", "compute_90", "sm_90x"):
        with pytest.raises(UsageError, match=rf"^arch '{bad}': expected sm_80 or later"):
            Target(bad)


def _plan(fmt, arch: str, act=BF16):
    return lower(run_pipeline(mlp(fmt, CHECKPOINT, act), "default")[0], target=Target(arch))


def test_lowering_follows_the_target() -> None:
    """W4A4: sm_80/sm_90 share one plan (integer sums, no target in the names); sm_100a decodes
    E2M1 with its conversion (names say sm_100a); sm_120a also runs its W4A4 GEMMs on the
    block-scaled FP4 MMA, which quantizes x itself (quantize_act then serves the GEMV only). A
    format without E2M1 codes gets the same kernels on every target."""
    fmt = Nvfp4("div", 4)
    plans = {a: _plan(fmt, a) for a in nvrtc.GATE_ARCHS}
    names = {a: [la.kernel.name for la in p.launches] for a, p in plans.items()}
    assert [p.target.arch for p in plans.values()] == list(nvrtc.GATE_ARCHS)
    assert [la.kernel for la in plans["sm_80"].launches] == [
        la.kernel for la in plans["sm_90"].launches
    ]
    assert not any("_sm" in n or "_nvf4" in n for n in names["sm_90"])
    for a in ("sm_100a", "sm_120a"):
        tag = Target(a).tag
        specialised = [la for la in plans[a].launches if not la.kernel.name.startswith("quant")]
        assert all(la.kernel.name.endswith(f"_{tag}") for la in specialised)
        assert all("#define QIR_FP4_CVT 1" in la.kernel.source for la in specialised)
        assert not any("QIR_FP4_CVT 1" in la.kernel.source for la in plans["sm_90"].launches)
    assert not any("_nvf4" in n for n in names["sm_100a"])
    native = [la for la in plans["sm_120a"].launches if "_a4dynamic_nvf4_sm120a" in la.kernel.name]
    assert [la.when for la in native] == [(9, 64), (9, 64)]
    quantize = {
        a: [la.when for la in p.launches if la.kernel.name.startswith("quant")]
        for a, p in plans.items()
    }
    assert quantize["sm_90"] == [(1, 64), (1, 64)] and quantize["sm_120a"] == [(1, 8), (1, 8)]
    awq = {a: [la.kernel for la in _plan(Awq(4, 128), a).launches] for a in nvrtc.GATE_ARCHS}
    assert all(kernels == awq["sm_90"] for kernels in awq.values())


# sm_80 and sm_90 run the kernels every other host test runs (one plan: see above).
CASES = [
    # W4A4 with the FP4 conversion (GEMV on f16 pairs, its GEMM's mma.sync on decoded codes)
    # and MXFP4's decode in k order (GEMV, both GEMM tiles).
    pytest.param("sm_100a", projections, Nvfp4("div", 4), id="sm_100a-w4a4"),
    pytest.param("sm_100a", projections, Mxfp4(), id="sm_100a-mxfp4"),
    # The block-scaled FP4 GEMMs' three epilogues (merged, gate/up pair, residual).
    pytest.param("sm_120a", block, Nvfp4("div", 4), id="sm_120a-w4a4"),
]


@pytest.mark.parametrize(("arch", "make", "fmt"), CASES)
def test_every_targets_kernels_run_on_the_host(
    arch: str, make, fmt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host emulates each target's instructions (the FP4 conversion, the block-scaled MMA):
    a target's kernels equal the interpreter at M = 1 (GEMV), 33 (the 64-row GEMM tile: W4A4)
    and 70 (the 128-row one), give the same bytes under the reversed schedule, and W4A4's GEMV
    gives sm_90's bytes (its block sums are exact either way)."""
    graph, weights = make(fmt)
    c = qir.compile(graph, weights, backend="host", target=arch)
    assert c.plan is not None and c.plan.target == Target(arch)
    projections_ = [la.kernel.name for la in c.plan.launches if la.kernel.name.startswith("qg")]
    assert all(name.endswith(Target(arch).tag) for name in projections_)
    ref = qir.compile(graph, weights, backend="reference")
    for m in (1, 33, 70):
        x = inputs(m)
        ours = c(x)
        close(ours, ref(x), fmt)
        if m == 1 and w4a4(fmt):
            hopper = qir.compile(graph, weights, backend="host", target="sm_90")
            for name, value in hopper(x).items():
                assert value.tobytes() == ours[name].tobytes(), name
        if m == 33:
            monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
            backward = c(x)
            monkeypatch.delenv("QIR_HOST_SCHEDULE")
            for name, value in ours.items():
                assert value.tobytes() == backward[name].tobytes(), name


class Blackwell(FakeDevice):
    compute_capability = "120"


def test_the_cuda_backend_takes_its_devices_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """An RTX 50xx (compute capability 12.0) plans and builds for sm_120a; a plan for another
    target is refused there, in one line."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(Device=Blackwell))
    be = CudaBackend()
    assert be.target == Target("sm_120a") and be.arch == "sm_120a"
    assert device_target() == Target("sm_120a")
    assert resolve_target(None, be) == Target("sm_120a")
    with pytest.raises(UsageError, match=r"^target sm_90: the cuda backend runs on sm_120a"):
        resolve_target("sm_90", be)
    assert resolve_target("sm_100a", None) == Target("sm_100a")  # the host runs any
    plan = _plan(Nvfp4("div", 4), "sm_90")
    with pytest.raises(UsageError, match=r"the plan is for sm_90; the cuda backend runs sm_120a"):
        CompiledBlock(plan, be, {})
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())  # compute capability "90"
    assert CudaBackend().target == device_target() == Target("sm_90")
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr("qir.runtime.cuda.available", lambda: False)
    assert device_target() is None


@needs_nvrtc
def test_the_cost_table_is_for_the_plans_target() -> None:
    plan = _plan(Nvfp4("div", 4), "sm_90")
    with pytest.raises(UsageError, match=r"the plan is for sm_90, not sm_120a"):
        kernel_costs(plan, "sm_120a", 1)


def _dumped(out: Path) -> list[Kernel]:
    headers = tuple((p.name, p.read_text()) for p in sorted(out.glob("*.cuh")))
    return [Kernel(p.stem, p.read_text(), (), (1, 1, 1), headers) for p in sorted(out.glob("*.cu"))]


@needs_nvrtc
@needs_sass
def test_dump_for_sm_120a_writes_block_scaled_fp4_gemms(tmp_path: Path) -> None:
    """`qir dump --arch sm_120a` on an NVFP4 W4A4 checkpoint: its W4A4 GEMMs' SASS has OMMA
    (the block-scaled FP4 MMA); for sm_90 no GEMM has it, and the dump is the one without
    --arch (this machine has no GPU: sm_90) byte for byte."""
    dirs = {}
    for arch in ("sm_120a", "sm_90", None):
        out = dirs[arch] = tmp_path / str(arch)
        argv = ["-q", "dump", str(W4A4), "--block", "mlp", "--out", str(out)]
        assert main([*argv, *(["--arch", arch] if arch else [])]) == 0
        plan = json.loads((out / "plan.json").read_text())
        assert plan["target"]["arch"] == (arch or "sm_90")

    def omma(arch: str) -> dict[str, bool]:
        """Whether each W4A4 GEMM's SASS (64-row tiles) holds OMMA."""
        return {
            k.name: any(i.op == "OMMA" for i in sass.disassemble(r.cubin, k.name))
            for k in _dumped(dirs[arch])
            if k.name.startswith("qgemm_") and "_a4" in k.name
            for r in [nvrtc.compile_cubin(k, arch)]
        }

    blackwell = omma("sm_120a")
    assert len(blackwell) == 2 and all(n.endswith("_nvf4_sm120a") for n in blackwell)
    assert all(blackwell.values())
    hopper = omma("sm_90")
    assert len(hopper) == 2 and not any(hopper.values())
    files = {p.name: p.read_bytes() for p in dirs["sm_90"].iterdir()}
    assert files == {p.name: p.read_bytes() for p in dirs[None].iterdir()}


def _moe_plan(fmt, arch: str, act=BF16):
    graph, _ = moe_graph(np.random.default_rng(0), 128, 64, 6, 2, fmt, act)
    return lower(run_pipeline(graph, "default")[0], target=Target(arch))


def test_expert_kernels_follow_the_target() -> None:
    """The expert GEMVs and grouped GEMMs take the plan's target as the dense kernels do: E2M1
    experts (NVFP4, MXFP4) decode through sm_100a's and sm_120a's FP4 conversion (their names
    say the target), sm_80 and sm_90 share one plan, and experts without E2M1 codes get the same
    kernels on every target."""
    for fmt in (Nvfp4("mul", 16), Mxfp4()):
        plans = {a: _plan_kernels(_moe_plan(fmt, a)) for a in nvrtc.GATE_ARCHS}
        assert plans["sm_80"] == plans["sm_90"]
        experts = {
            a: [k for k in p if k.name.startswith(("moe_gemv_", "moe_qgemm_"))]
            for a, p in plans.items()
        }
        assert len(experts["sm_90"]) == 6  # gate/up and down: a GEMV and two GEMM tiles each
        assert not any("QIR_FP4_CVT 1" in k.source for k in experts["sm_90"])
        for a in ("sm_100a", "sm_120a"):
            assert all(k.name.endswith(f"_{Target(a).tag}") for k in experts[a])
            assert all("#define QIR_FP4_CVT 1" in k.source for k in experts[a])
            others = [k for k in plans[a] if k not in experts[a]]  # route, grouping, combine
            assert others == [k for k in plans["sm_90"] if k not in experts["sm_90"]]
    mlx = {a: _plan_kernels(_moe_plan(MlxAffine(4, 64, BF16), a)) for a in nvrtc.GATE_ARCHS}
    assert all(kernels == mlx["sm_90"] for kernels in mlx.values())


def _plan_kernels(plan) -> list[Kernel]:
    return [la.kernel for la in plan.launches]


def test_sm_100a_expert_kernels_run_on_the_host() -> None:
    """NVFP4 experts with sm_100a's FP4 conversion (emulated on the host): the expert GEMVs
    (M = 1) and the grouped GEMMs (M = 40) equal the interpreter (summation order aside)."""
    graph, weights = moe_graph(np.random.default_rng(3), 128, 64, 6, 2, Nvfp4("mul", 16), F16)
    c = qir.compile(graph, weights, backend="host", target="sm_100a")
    ref = qir.compile(graph, weights, backend="reference")
    assert c.plan is not None
    specialised = [la for la in c.plan.launches if la.kernel.name.endswith("_sm100a")]
    assert {la.kernel.name.split("_")[1] for la in specialised} == {"gemv", "qgemm"}
    rng = np.random.default_rng(4)
    for m in (1, 40):
        x = {"x": rng.standard_normal((m, 128)).astype(np.float16)}
        moe_close(c(x), ref(x))


def _nvfp4_moe_checkpoint(path: Path) -> Path:
    """Layer 0's MoE MLP of the Qwen2-MoE fixture's config in ModelOpt's NVFP4 layout (W4A16),
    one module per expert as the Hub stores them, the router and the shared expert's gate left
    bf16: random weights through qir's NVFP4 quantizer (the dump does not depend on values)."""
    config = json.loads((DATA / "qwen2moe_mlx4_g64" / "config.json").read_text())
    config.pop("quantization")
    config["qkv_bias"] = False  # no attention here
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "ignore": ["lm_head", "model.embed_tokens", "*.mlp.gate", "*.mlp.shared_expert_gate"],
        "config_groups": {
            "group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}
        },
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    rng, fmt, pre = np.random.default_rng(0), Nvfp4("mul", 16), "model.layers.0.mlp"
    tensors: dict[str, np.ndarray] = {}
    for module, shape in (
        *((f"{pre}.experts.{e}.{w}_proj", (64, 128)) for e in range(6) for w in ("gate", "up")),
        *((f"{pre}.experts.{e}.down_proj", (128, 64)) for e in range(6)),
        *((f"{pre}.shared_expert.{w}_proj", (128, 128)) for w in ("gate", "up", "down")),
    ):
        bufs = fmt.quantize(rng.standard_normal(shape, dtype=np.float32))
        tensors[f"{module}.weight"] = bufs["weight"]
        tensors[f"{module}.weight_scale"] = bufs["block_scale"].view(ml_dtypes.float8_e4m3fn)
        tensors[f"{module}.weight_scale_2"] = bufs["global_scale"].reshape(())
    for module, rows in ((f"{pre}.gate", 6), (f"{pre}.shared_expert_gate", 1)):
        w = rng.standard_normal((rows, 128), dtype=np.float32)
        tensors[f"{module}.weight"] = w.astype(ml_dtypes.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@needs_nvrtc
@needs_sass
def test_dump_for_sm_100a_decodes_nvfp4_experts_by_the_fp4_conversion(tmp_path: Path) -> None:
    """`qir dump --arch sm_100a` of NVFP4 experts (Qwen2-MoE's MLP: routed experts and the
    shared expert's dense gate/up): the expert kernels' SASS converts E2M1 pairs in hardware
    (F2FP.F16.E2M1.UNPACK_B) as the dense GEMV beside them does; for sm_90 none has it."""
    checkpoint = _nvfp4_moe_checkpoint(tmp_path / "ck")
    dirs = {}
    for arch in ("sm_100a", "sm_90"):
        dirs[arch] = tmp_path / arch
        argv = ["-q", "dump", str(checkpoint), "--block", "mlp", "--out", str(dirs[arch])]
        assert main([*argv, "--arch", arch]) == 0

    def chosen(name: str) -> bool:
        """The routed experts' GEMVs and grouped GEMMs (their 64-row tile), the dense GEMV."""
        if name.startswith("moe_qgemm_"):
            return "_e6top2" in name and "_64x32x32" in name
        return name.startswith("qgemv_nvfp4") or "_e6top2_" in name

    def converts(arch: str) -> dict[str, bool]:
        """Whether each chosen kernel converts E2M1 in hardware, and every E2M1 kernel's name
        ends in the target (sm_100a) or none does (sm_90)."""
        kernels = _dumped(dirs[arch])
        e2m1 = [k.name for k in kernels if "nvfp4" in k.name]
        assert len(e2m1) == 12 and all(n.endswith("_sm100a") == (arch == "sm_100a") for n in e2m1)
        return {
            k.name: any(
                i.opcode == "F2FP.F16.E2M1.UNPACK_B" for i in sass.disassemble(r.cubin, k.name)
            )
            for k in kernels
            if chosen(k.name)
            for r in [nvrtc.compile_cubin(k, arch)]
        }

    blackwell = converts("sm_100a")
    assert sorted(n.split("_")[1] for n in blackwell) == [
        "gemv",  # routed gate/up, down
        "gemv",
        "nvfp4mul",  # the shared expert's gate/up (dense)
        "qgemm",  # routed gate/up, down
        "qgemm",
    ]
    assert all(blackwell.values())
    hopper = converts("sm_90")
    assert len(hopper) == 5 and not any(hopper.values())


def test_run_and_generate_emit_for_arch_on_the_host(tmp_path: Path) -> None:
    """--arch on the host backend selects what is emitted and the host emulates it: W4A4's
    GEMVs sum blocks exactly on both targets, so sm_120a's decode step (run at M = 1) and its
    greedy generation give sm_90's bytes."""
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float16)
    np.save(tmp_path / "x.npy", x)
    outs = {}
    for arch in ("sm_90", "sm_120a"):
        outs[arch] = tmp_path / f"{arch}.npz"
        args = ["-q", "run", str(W4A4), "--block", "mlp", "--input", str(tmp_path / "x.npy")]
        assert main([*args, "--out", str(outs[arch]), "--backend", "host", "--arch", arch]) == 0
    y90, y120 = (np.load(outs[a])["y"] for a in ("sm_90", "sm_120a"))
    assert y90.tobytes() == y120.tobytes()
    gen = {}
    for arch in ("sm_90", "sm_120a"):
        gen[arch] = tmp_path / f"g{arch}.npz"
        args = ["-q", "generate", str(W4A4), "--tokens", "3,10,17", "--max-new-tokens", "2"]
        args.append("--greedy")
        assert main([*args, "--out", str(gen[arch]), "--backend", "host", "--arch", arch]) == 0
    a, b = (np.load(gen[k]) for k in ("sm_90", "sm_120a"))
    assert a["tokens"].tolist() == b["tokens"].tolist()
    assert a["logits"].tobytes() == b["logits"].tobytes()


def test_compile_json_names_the_target_and_a_bad_arch_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["compile", str(W4A4), "--block", "qkv", "--m", "16", "--arch", "sm_120a"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["target"] == {
        "arch": "sm_120a",
        "features": ["fp8 conversion", "fp4 conversion", "block-scaled fp4 mma"],
    }
    assert any(k["name"].endswith("_nvf4_sm120a") for k in plan["kernels"])
    assert main(["compile", str(W4A4), "--block", "qkv", "--arch", "sm_75"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qir: error: arch 'sm_75': expected sm_80") and err.count("\n") == 1


@needs_nvrtc
def test_cache_warm_lowers_for_each_arch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each --arch warms the kernels lowered for it: sm_120a's q/k/v are its own (the FP4
    conversion in the GEMVs, the block-scaled FP4 GEMM), sm_90's today's."""
    monkeypatch.setenv("QIR_CACHE_DIR", str(tmp_path))
    argv = ["-q", "cache", "warm", str(W4A4), "--arch", "sm_90", "sm_120a", "--blocks", "qkv"]
    assert main(argv) == 0
    out = [line.rsplit(" (", 1)[0] for line in capsys.readouterr().out.splitlines()]
    assert out[:2] == [
        "sm_90: 4 kernels, 4 compiled, 0 already cached",
        "sm_120a: 4 kernels, 4 compiled, 0 already cached",
    ]
    blackwell = [p.name for p in (tmp_path / "cubin").glob("*.sm_120a.cubin")]
    names = sorted(n.split("-")[0] for n in blackwell)
    assert len(names) == 4 and names[-1].startswith("quantize_act_")
    assert sum(n.endswith("_nvf4_sm120a") for n in names) == 1
    assert sum(n.endswith("_sm120a") for n in names) == 3
