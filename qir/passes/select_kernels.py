"""Kernel selection: the last pass; names the kernel family each qlinear lowers to.

Preconditions: fusion passes done. Today every qlinear takes the GEMV family (one warp per
output row, up to 8 rows of x per launch, more via grid.y); a tensor-core GEMM family for
large M comes with the batched kernels. Fires once per qlinear it labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.graph import Graph

FAMILIES = ("gemv",)


@dataclass(frozen=True)
class SelectKernels:
    name: str = "select_kernels"

    def run(self, graph: Graph) -> int:
        fired = 0
        for name, node in graph.items():
            if node.op == "qlinear" and node.attr("kernel") is None:
                graph.set_node(name, node.with_attrs(kernel="gemv"))
                fired += 1
        return fired
