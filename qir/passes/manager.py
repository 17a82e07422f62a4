"""Runs a named pipeline of passes on a copy of a graph, verifying after each pass, counting
matches and timing each pass."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qir.errors import UsageError
from qir.graph import Graph
from qir.passes.base import Pass
from qir.passes.dce import DCE
from qir.passes.fold_head_norm import FOLD_HEAD_NORM
from qir.passes.fold_rope import FOLD_ROPE
from qir.passes.merge_parallel import MERGE_PARALLEL
from qir.passes.norm_act_quant import NORM_ACT_QUANT
from qir.passes.norm_prologue import NORM_PROLOGUE
from qir.passes.norm_residual import NORM_RESIDUAL
from qir.passes.norm_residual_prologue import NORM_RESIDUAL_PROLOGUE
from qir.passes.residual_epilogue import RESIDUAL_EPILOGUE
from qir.passes.route_w4a4 import TIERS, RouteW4A4
from qir.passes.select_kernels import SelectKernels
from qir.passes.share_act_quant import SHARE_ACT_QUANT
from qir.passes.silu_epilogue import SILU_EPILOGUE
from qir.passes.silu_prologue import SILU_PROLOGUE
from qir.passes.softcap_epilogue import SOFTCAP_EPILOGUE
from qir.verify import verify


@dataclass(frozen=True)
class PassOptions:
    """Knobs of parameterised passes (the CLI's --weight-quantization, ...)."""

    weight_quantization: str = "declared"
    # select_kernels: the first M of the GEMM family for every node (None: its table).
    gemm_from_m: int | None = None


PASSES: dict[str, Callable[[PassOptions], Pass]] = {
    "merge_parallel": lambda o: MERGE_PARALLEL,
    "silu_epilogue": lambda o: SILU_EPILOGUE,
    "silu_prologue": lambda o: SILU_PROLOGUE,
    "residual_epilogue": lambda o: RESIDUAL_EPILOGUE,
    "norm_residual": lambda o: NORM_RESIDUAL,
    "softcap_epilogue": lambda o: SOFTCAP_EPILOGUE,
    "route_w4a4": lambda o: RouteW4A4(o.weight_quantization),
    "share_act_quant": lambda o: SHARE_ACT_QUANT,
    "norm_act_quant": lambda o: NORM_ACT_QUANT,
    "norm_prologue": lambda o: NORM_PROLOGUE,
    "norm_residual_prologue": lambda o: NORM_RESIDUAL_PROLOGUE,
    "fold_rope": lambda o: FOLD_ROPE,
    "fold_head_norm": lambda o: FOLD_HEAD_NORM,
    "dce": lambda o: DCE(),
    "select_kernels": lambda o: SelectKernels(o.gemm_from_m),
}
PIPELINES: dict[str, tuple[str, ...]] = {
    "default": (
        # first, so nothing dead is merged into a multi-output node
        "dce",
        "merge_parallel",
        "silu_epilogue",
        "silu_prologue",
        "residual_epilogue",
        "norm_residual",
        "softcap_epilogue",
        "fold_rope",
        "fold_head_norm",
        "route_w4a4",
        "share_act_quant",
        "norm_act_quant",
        "norm_prologue",
        "norm_residual_prologue",
        "dce",
        "select_kernels",
    ),
    # Unfused and 16-bit: one kernel per op, the baseline every fusion is compared against.
    "none": (),
}


@dataclass(frozen=True)
class PassRecord:
    name: str
    matches: int
    seconds: float


def resolve(pipeline: str | Sequence[str], options: PassOptions | None = None) -> tuple[Pass, ...]:
    """'default', 'none', a comma-separated list, or a sequence of pass names."""
    if isinstance(pipeline, str):
        if pipeline in PIPELINES:
            names = PIPELINES[pipeline]
        else:
            names = tuple(p.strip() for p in pipeline.split(",") if p.strip())
    else:
        names = tuple(pipeline)
    unknown = [n for n in names if n not in PASSES]
    if (options or PassOptions()).weight_quantization not in TIERS:
        raise UsageError(
            f"unknown --weight-quantization {(options or PassOptions()).weight_quantization!r}; "
            f"choose one of {', '.join(TIERS)}"
        )
    if unknown:
        raise UsageError(
            f"unknown pass {', '.join(unknown)}; passes: {', '.join(PASSES)}; "
            f"pipelines: {', '.join(PIPELINES)}"
        )
    options = options or PassOptions()
    return tuple(PASSES[n](options) for n in names)


def run_pipeline(
    graph: Graph,
    pipeline: str | Sequence[str] = "default",
    after_each: Callable[[str, Graph], None] | None = None,
    options: PassOptions | None = None,
) -> tuple[Graph, list[PassRecord]]:
    """Returns the rewritten copy and one record per pass; the caller's graph is untouched."""
    passes = resolve(pipeline, options)
    g = graph.copy()
    verify(g)
    records = []
    for p in passes:
        start = time.perf_counter()
        matches = p.run(g)
        verify(g)
        records.append(PassRecord(p.name, matches, time.perf_counter() - start))
        if after_each:
            after_each(p.name, g)
    return g, records
