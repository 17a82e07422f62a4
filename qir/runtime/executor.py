"""Runs a lowered plan on a backend: weights are uploaded once, each run binds inputs,
allocates intermediates and launches the kernels in order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qir.codegen.lower import Plan
from qir.interpret import Weights, bind_inputs
from qir.runtime.backend import Backend
from qir.types import QWeight, TensorType


class CompiledBlock:
    def __init__(self, plan: Plan, backend: Backend, weights: Weights) -> None:
        self.plan = plan
        self.backend = backend
        graph = plan.graph
        self._weights: dict[str, dict[str, Any]] = {}
        for wname in graph.weights:
            node = graph.node(wname)
            w = node.type
            assert isinstance(w, QWeight)
            key = node.attr("key")
            if key not in weights:
                raise ValueError(f"weight {key!r} (%{wname}) was not given")
            bufs = weights[key]
            w.format.check_buffers(bufs, w.out_features, w.in_features, where=key)
            self._weights[wname] = {
                b: backend.to_device(np.ascontiguousarray(bufs[b]))
                for b in w.format.buffers(w.out_features, w.in_features)
            }
        self._loaded = [backend.load(launch.kernel) for launch in plan.launches]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        graph = self.plan.graph
        sizes = bind_inputs(graph, inputs)
        m = sizes.get("M", 1)
        env: dict[str, Any] = {
            n: self.backend.to_device(np.ascontiguousarray(inputs[n])) for n in graph.inputs
        }
        for launch, loaded in zip(self.plan.launches, self._loaded, strict=True):
            for out in launch.outputs:
                t = graph.node(out).type
                assert isinstance(t, TensorType)
                env[out] = self.backend.empty(t.concrete(sizes), t.dtype.np)
            args: list[Any] = []
            for a in launch.args:
                if a.kind == "value":
                    args.append(env[a.ref])
                elif a.kind == "weight":
                    args.append(self._weights[a.ref][a.buffer])
                else:
                    args.append(m)
            self.backend.launch(loaded, launch.grid(m), args)
        self.backend.synchronize()
        results = {}
        for out, v in graph.outputs:
            t = graph.node(v).type
            assert isinstance(t, TensorType)
            # CuPy has no bf16/fp8 dtypes and hands back same-width raw integers.
            results[out] = self.backend.from_device(env[v]).view(t.dtype.np)
        return results
