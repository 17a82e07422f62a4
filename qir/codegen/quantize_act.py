"""The activation quantization kernel a `quantize_act` node lowers to (NVFP4 today)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.layer_kernels import c_float, layer_header
from qir.codegen.render import common_header, render
from qir.dtypes import DType
from qir.types import QActType

THREADS = 128
# How a rule's calibrated scale enters the kernel: none (per-row), ModelOpt's decode factor
# (multiplied), compressed-tensors' encode factor (divided).
MODES = {"input_scale": "mul", "input_global_scale": "div"}


def act_quant_mode(attrs: Mapping[str, object]) -> str:
    return next((mode for key, mode in MODES.items() if key in attrs), "dynamic")


@dataclass(frozen=True)
class QuantizeActSpec:
    qact: QActType
    mode: str  # dynamic | mul | div
    # An RMSNorm prologue: its weight's dtype and eps (see passes.norm_act_quant).
    norm: tuple[DType, float] | None = None

    @property
    def act(self) -> DType:
        return self.qact.source.dtype

    @property
    def k(self) -> int:
        k = self.qact.source.shape[1]
        assert isinstance(k, int)
        return k

    @property
    def name(self) -> str:
        norm = f"_rmsnorm_w{self.norm[0].name}" if self.norm else ""
        return f"quantize_act_{self.qact.scheme}_{self.act.name}_k{self.k}_{self.mode}{norm}"


def quantize_act_kernel(spec: QuantizeActSpec) -> Kernel:
    act_t = spec.act.c_type
    source = render(
        "quantize_act.cu.j2",
        name=spec.name,
        act_t=act_t,
        K=spec.k,
        mode=spec.mode,
        threads=THREADS,
        row_bytes=spec.qact.row_bytes,
        norm=spec.norm is not None,
        w_t=spec.norm[0].c_type if spec.norm else "",
        eps=c_float(spec.norm[1]) if spec.norm else "",
    )
    norm_w = (
        (KernelParam("nw", f"const {spec.norm[0].c_type}* __restrict__", "buffer"),)
        if spec.norm
        else ()
    )
    headers = (common_header(), layer_header()) if spec.norm else (common_header(),)
    params = (
        KernelParam("x", f"const {act_t}* __restrict__", "buffer"),
        *norm_w,
        KernelParam("xq", "uint8_t* __restrict__", "buffer"),
        *(
            ()
            if spec.mode == "dynamic"
            else (KernelParam("act_scale", "const float* __restrict__", "buffer"),)
        ),
        KernelParam("M", "int", "int"),
    )
    return Kernel(spec.name, source, params, (THREADS, 1, 1), headers)
