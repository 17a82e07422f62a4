"""What the mixture-of-experts tests share: random stacked experts and an MoE MLP graph."""

from __future__ import annotations

import numpy as np

from qir.builder import Builder
from qir.dtypes import F16, DType
from qir.formats.base import WeightFormat
from qir.formats.dense import Dense
from qir.graph import Graph
from qir.types import QExperts, QWeight
from tests.conftest import random_weight

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
) -> tuple[Graph, Weights]:
    """y = x + moe(x): a dense router (in the activation type), `rule` choosing k of `experts`,
    gate/up with silu(g) * u, down combined with the router's weights and the residual x.
    Outputs y, the logits and the ids."""
    b = Builder("moe")
    weights: Weights = {}
    x = b.input("x", ("M", hidden), act)
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
    y = b.expert_qlinear(h, ws["down"], ids, rw, x, name="y")
    b.output("y", y)
    b.output("logits", logits)
    b.output("ids", ids)
    return b.graph, weights


def inputs(
    rng: np.random.Generator, m: int, hidden: int, act: DType = F16
) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((m, hidden), dtype=np.float32).astype(act.np)}
