"""The Python entry points: compile a graph for a backend and run it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qir import draw
from qir.codegen.lower import lower
from qir.codegen.plan import DEFAULT_M_TILE, Plan
from qir.collectives import Comm
from qir.errors import UsageError
from qir.graph import Graph
from qir.interpret import Kept, Weights, empty_state, interpret
from qir.passes.manager import PassOptions, PassRecord, run_pipeline
from qir.runtime.backend import BACKENDS, get_backend, resolve_target
from qir.runtime.executor import CapturedBatches, CapturedBlock, CompiledBlock
from qir.target import DEFAULT, Target


@dataclass
class Compiled:
    """A block ready to run: the graph after passes, its launch plan (kernel backends), and
    the pass records."""

    source: Graph
    graph: Graph
    backend: str
    weights: Weights
    records: list[PassRecord] = field(default_factory=list)
    plan: Plan | None = None
    target: Target = DEFAULT  # what the plan's kernels are for
    comm: Comm | None = None  # this rank's end of its tensor-parallel group (qir.collectives)
    _exec: CompiledBlock | None = None
    # The reference backend's states (KV caches) by key; kernel backends keep theirs on the
    # device (CompiledBlock.state).
    _state: dict[str, Any] = field(default_factory=dict)
    # ... and its weights, dequantized at the first run (as a kernel backend uploads them once).
    _dequantized: dict[str, Kept] = field(default_factory=dict)

    def __call__(
        self, inputs: Mapping[str, Any], stream: Any = None, rows: str | None = None
    ) -> dict[str, Any]:
        """Run once. Kernel backends take numpy, CuPy or DLPack inputs and launch on `stream`
        (cuda); see qir.runtime.executor for what comes back. A block with state (KV caches)
        starts from what the previous run left in it: see `reset_state`. `rows`: "many" (rows
        of different sequences, a decode batch) or "one" (one sequence's, a prefill), where a
        kernel family depends on it (attention; default: by M, qir.codegen.lower.resolve_rows);
        the results are the same either way."""
        if self._exec is None:
            if not self._state:
                self._state = empty_state(self.graph)
            return interpret(
                self.graph, inputs, self.weights, self._state, self.comm, self._dequantized
            )
        return self._exec.run(inputs, stream, rows)

    def reset_state(self) -> None:
        """Empty the KV caches (zeros): the next run starts a new sequence. Positions decide what
        attention reads, so this is only needed to forget, not for correctness."""
        if self._exec is None:
            self._state = empty_state(self.graph)
        else:
            self._exec.reset_state()

    def copy_state_rows(self, src: int, dst: int, n: int) -> None:
        """Copy rows src..src+n of every state (KV cache) to rows dst..dst+n: a paged cache's
        page to another (prefix caching's copy of a shared partial page)."""
        if self._exec is not None:
            self._exec.copy_state_rows(src, dst, n)
            return
        if not self._state:
            self._state = empty_state(self.graph)
        for a in self._state.values():
            a[dst : dst + n] = a[src : src + n]

    def state(self) -> dict[str, Any]:
        """The states (KV caches) by key, as numpy copies."""
        if self._exec is None:
            return {k: v.copy() for k, v in (self._state or empty_state(self.graph)).items()}
        return self._exec.read_state()

    def prepare(self, m: int, rows: str | None = None) -> None:
        """Load (compiling if cold) the kernels a run with M=`m` launches, so the run itself
        does not wait for a compiler (nothing to do on the reference backend)."""
        if self._exec is not None:
            self._exec.load(m, rows)

    def capture(self, m: int, stream: Any = None, rows: str | None = None) -> CapturedBlock:
        """The block bound to fixed buffers for M=`m`, replayed by calling it (a CUDA graph on
        the cuda backend): the decode path."""
        return self._executor("capture").capture(m, stream, rows)

    def capture_batches(
        self, sizes: Sequence[int], stream: Any = None, rows: str | None = None
    ) -> CapturedBatches:
        """One capture per batch size in `sizes` (e.g. 1, 2, 4, 8, 16, 32, 64); calling the
        result with M rows replays the nearest capture that serves M, padded: decode with a
        batch that changes from step to step. See qir.runtime.executor.CapturedBatches."""
        return self._executor("capture_batches").capture_batches(sizes, stream, rows)

    def peak_bytes(self, m: int) -> int:
        """Bytes a run at M=`m` allocates besides inputs and weights (intermediates share an
        arena planned from liveness, plus the outputs)."""
        return self._executor("peak_bytes").memory_plan(m).peak_bytes

    def _executor(self, what: str) -> CompiledBlock:
        if self._exec is None:
            raise UsageError(f"{what} needs a kernel backend (host or cuda), not {self.backend}")
        return self._exec

    def draw(self, out: str | Path | None = None) -> str:
        """The graph before and after the passes side by side, each launch of the plan boxed
        and named after its kernel, as DOT text; with `out` (.dot, .svg, .png) also written
        there (without Graphviz's dot, an .svg or .png becomes a .dot beside it and a warning)."""
        text = draw.to_dot(self.source, self.graph, self._plan())
        if out is not None:
            _, missing = draw.write(text, Path(out))
            if missing:
                warnings.warn(missing, stacklevel=2)
        return text

    def _repr_svg_(self) -> str | None:
        """The picture of `draw()` where a notebook shows this block (None without Graphviz)."""
        return draw.svg(self.source, self.graph, self._plan())

    def _plan(self) -> Plan | None:
        if self.plan is not None:
            return self.plan
        try:  # the reference backend runs no kernels, but the picture shows what it would launch
            return lower(self.graph, target=self.target)
        except NotImplementedError:
            return None

    @property
    def kernel_count(self) -> int:
        """Launches in the plan, for every batch size (W4A4 nodes have a 16-bit twin)."""
        return len(self.plan.launches) if self.plan else 0

    def launches_for(self, m: int, rows: str | None = None) -> int:
        """Launches one run with M=`m` makes."""
        return sum(la.runs_for(m, rows) for la in self.plan.launches) if self.plan else 0


def compile(
    graph: Graph,
    weights: Weights,
    backend: str = "host",
    passes: str | Sequence[str] = "default",
    m_tile: int = DEFAULT_M_TILE,
    weight_quantization: str = "declared",
    after_each: Callable[[str, Graph], None] | None = None,
    gemm_from_m: int | None = None,
    target: str | Target | None = None,
    comm: Comm | None = None,
) -> Compiled:
    """Run the pass pipeline on a copy of `graph` and prepare it for `backend`.

    weight_quantization: which NVFP4 weights take 4-bit activations (`declared`: those whose
    checkpoint calibrated them, `w4a4`: all, `w4a16`: none). gemm_from_m: the batch size from
    which every f16/bf16 qlinear runs the tensor-core GEMM family instead of the GEMV (default:
    the table in qir.passes.select_kernels). target: the GPU the kernels are for ("sm_90",
    "sm_120a"; qir.target): the cuda backend's is its device's (naming another is an error),
    elsewhere this machine's GPU's, else sm_90. The host backend runs any target's kernels.
    comm: this rank's end of its tensor-parallel group, for a graph with collectives (one rank's
    part, qir.passes.tensor_parallel): qir.collectives.LocalGroup's, or MpiComm's."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if gemm_from_m is not None and (
        isinstance(gemm_from_m, bool) or not isinstance(gemm_from_m, int) or gemm_from_m < 1
    ):
        raise UsageError(f"gemm_from_m must be a positive int, got {gemm_from_m!r}")
    options = PassOptions(weight_quantization=weight_quantization, gemm_from_m=gemm_from_m)
    passed, records = run_pipeline(graph, passes, after_each=after_each, options=options)
    be = get_backend(backend) if backend != "reference" else None
    c = Compiled(
        graph, passed, backend, weights, records, target=resolve_target(target, be), comm=comm
    )
    if be is not None:
        c.plan = lower(passed, m_tile, c.target)
        c._exec = CompiledBlock(c.plan, be, weights, comm)
    return c
