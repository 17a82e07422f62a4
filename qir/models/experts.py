"""Mixture-of-experts layers of a checkpoint: which decoder layers route to experts, by which
rule (k of E), and where the router and the experts are stored; the block builder's MoE MLP.

A row of MOE_ARCHITECTURES says where an architecture keeps them: the router (a linear [E, hidden]) and
each expert's gate/up/down linears as the Hub stores them (one module per expert, in any format
qir reads), or stacked as mlx-lm's convert writes them (`switch_mlp.{gate,up,down}_proj`, every
tensor with a leading expert dim). Either way the experts become one stacked weight per
projection (qir.types.QExperts), each expert read by the checkpoint's own quantization convention, so every
format that reads a linear reads experts.

The MoE MLP: logits = router(x); ids, weights = route(logits) by the architecture's rule; h = act(x
G_e^T) * (x U_e^T) per chosen expert (silu; gpt-oss's clamped SwiGLU, with expert biases); y =
residual + sum_j weights_j * (h_j D_e^T).

A shared expert (Qwen2-MoE: `mlp.shared_expert`, a dense MLP of shared_expert_intermediate_size
beside the routed ones, scaled by sigmoid(shared_expert_gate x)) adds s = sigmoid(x g^T) *
(silu(x G_s^T) * (x U_s^T)) D_s^T: it is built from the same ops, as one expert always chosen
whose router is the shared gate. Its gate/up pair is a plain qlinear pair (merged, silu(g) * u
as their epilogue); its gate's one logit goes through route's sigmoid_topk (k = 1 of 1: ids all
0, weights the sigmoid); its down projection is an expert_qlinear of that one expert whose
combine adds the residual, r' = residual + w * (h D_s^T); and the routed down's combine adds r'
in place of the residual.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from qir.errors import FormatError
from qir.models.quant_conventions.hf_mxfp4 import stacked_experts as hub_stacked_experts
from qir.types import QExperts

if TYPE_CHECKING:
    from qir.models.checkpoint import Checkpoint
    from qir.models.checkpoint_view import Linear

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class MoeArchitecture:
    """Where one MoE architecture keeps its experts (paths below model.layers.<i>)."""

    count_keys: tuple[str, ...]  # config.json's number of experts (the first present)
    router: str
    expert: str  # one expert's linear: {e} the expert, {w} its name in `names`
    names: tuple[str, str, str]  # gate, up, down as the Hub names them
    stacked: str  # mlx-lm's stacked experts: {w} is gate_proj, up_proj or down_proj
    # qir.moe.RULES; with `norm_key` the config chooses: renormalised when it is true
    rule: str
    intermediate_key: str = "intermediate_size"
    norm_key: str = ""
    # Qwen-MoE: layers with experts are those not in mlp_only_layers whose index + 1 is a
    # multiple of decoder_sparse_step (the others a dense MLP); else every layer.
    sparse_step: bool = False
    # A shared expert beside the routed ones (Qwen2-MoE): its MLP's module (gate_proj, up_proj,
    # down_proj below it), its sigmoid gate (a linear [1, hidden]) and its size's config key.
    shared: str = ""
    shared_gate: str = ""
    shared_key: str = "shared_expert_intermediate_size"
    # gpt-oss: the Hub's stacked MXFP4 experts (qir.models.quant_conventions.hf_mxfp4), gate and up
    # interleaved by rows in one module ({w}: gate_up_proj, down_proj), each with a bias; and
    # its clamped SwiGLU (qir.moe.swiglu_gate / swiglu_up) with config.json's swiglu_limit and
    # swiglu_alpha.
    hub_mxfp4: str = ""
    act: str = "silu"


MOE_ARCHITECTURES: dict[str, MoeArchitecture] = {
    "mixtral": MoeArchitecture(
        ("num_local_experts",),
        "block_sparse_moe.gate",
        "block_sparse_moe.experts.{e}.{w}",
        ("w1", "w3", "w2"),
        "block_sparse_moe.switch_mlp.{w}",
        # softmax over all experts, top k, renormalised (transformers' MixtralTopKRouter)
        "softmax_topk_norm",
    ),
    # transformers' Qwen3MoeTopKRouter: softmax over all, top k, renormalised if norm_topk_prob
    # (its default false); mlx-lm keeps the router at 8 bits.
    "qwen3_moe": MoeArchitecture(
        ("num_experts", "num_local_experts"),  # the Hub's key; transformers 5 writes the other
        "mlp.gate",
        "mlp.experts.{e}.{w}",
        ("gate_proj", "up_proj", "down_proj"),
        "mlp.switch_mlp.{w}",
        "softmax_topk",
        intermediate_key="moe_intermediate_size",
        norm_key="norm_topk_prob",
        sparse_step=True,
    ),
    # transformers' Qwen2MoeSparseMoeBlock: Qwen3-MoE's routing (norm_topk_prob default false)
    # plus the shared expert; mlx-lm's convert stacks the routed experts as switch_mlp and
    # keeps the shared ones' names.
    "qwen2_moe": MoeArchitecture(
        ("num_experts", "num_local_experts"),
        "mlp.gate",
        "mlp.experts.{e}.{w}",
        ("gate_proj", "up_proj", "down_proj"),
        "mlp.switch_mlp.{w}",
        "softmax_topk",
        intermediate_key="moe_intermediate_size",
        norm_key="norm_topk_prob",
        sparse_step=True,
        shared="mlp.shared_expert",
        shared_gate="mlp.shared_expert_gate",
    ),
    # transformers' GptOssTopKRouter: top k of the logits (a linear with bias), softmax over
    # the k
    "gpt_oss": MoeArchitecture(
        ("num_local_experts",),
        "mlp.router",
        "mlp.experts.{e}.{w}",
        ("gate_proj", "up_proj", "down_proj"),
        "mlp.experts.{w}",
        "topk_softmax",
        hub_mxfp4="mlp.experts.{w}",
        act="swiglu_clamp",
    ),
}
# transformers' GptOssConfig defaults for a config without them
SWIGLU_DEFAULTS = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


@dataclass(frozen=True)
class Moe:
    """A checkpoint's experts: E, k, the rule, their intermediate size and where they are."""

    architecture: MoeArchitecture
    experts: int
    top_k: int
    intermediate: int
    rule: str
    count_key: str  # the config field `experts` came from
    shared: int = 0  # the shared expert's intermediate size (0: none)


def moe_of(ck: Checkpoint) -> Moe | None:
    """The checkpoint's MoE layers, or None for a dense model; refuses, naming the field, a
    top-k above the experts."""
    fam = MOE_ARCHITECTURES.get(str(ck.config.get("model_type")))
    if fam is None:
        return None
    where = f"{ck.path}/config.json"
    count_key = next((k for k in fam.count_keys if ck.field(k) is not None), fam.count_keys[0])
    experts, top_k = ck.field(count_key), ck.field("num_experts_per_tok")
    if experts is None or top_k is None:
        missing = count_key if experts is None else "num_experts_per_tok"
        raise FormatError(f"{where}: lacks {missing} (a mixture-of-experts layer needs it)")
    if top_k > experts:
        raise FormatError(
            f"{where}: num_experts_per_tok {top_k} is above {count_key} {experts} (each "
            "token chooses among the experts)"
        )
    intermediate = ck.field(fam.intermediate_key)
    if intermediate is None:
        raise FormatError(f"{where}: lacks {fam.intermediate_key} (the experts' size)")
    rule = "softmax_topk_norm" if fam.norm_key and ck.field(fam.norm_key) else fam.rule
    shared = ck.field(fam.shared_key) if fam.shared else 0
    if shared is None:
        raise FormatError(f"{where}: lacks {fam.shared_key} (the shared expert's size)")
    return Moe(fam, experts, top_k, intermediate, rule, count_key, shared)


def is_moe_layer(ck: Checkpoint, layer: int) -> bool:
    """Whether decoder layer `layer` routes to experts (see MoeArchitecture.sparse_step)."""
    moe = moe_of(ck)
    if moe is None:
        return False
    if not moe.architecture.sparse_step:
        return True
    dense = ck.field("mlp_only_layers") or []
    return layer not in dense and (layer + 1) % ck.field("decoder_sparse_step") == 0


class _ExpertSlice:
    """A checkpoint's tensors with those of one stacked module read at one expert: `prefix.*`
    tensors [E, ...] appear as their slice [e, ...] (views, no copy)."""

    def __init__(self, store: Any, prefix: str, expert: int) -> None:
        self._store, self._prefix, self._e = store, prefix, expert

    def _sliced(self, name: str) -> bool:
        return name.startswith(self._prefix)

    def __contains__(self, name: object) -> bool:
        return name in self._store

    def dtype(self, name: str) -> np.dtype:
        result: np.dtype = np.dtype(self._store.dtype(name))
        return result

    def get(self, name: str) -> np.ndarray:
        a = self._store.get(name)
        result: np.ndarray = a if not self._sliced(name) else a[self._e]
        return result


def _stacked_linear(ck: Checkpoint, module: str, expert: int) -> Linear:
    """Expert `expert` of a stacked module, read by the checkpoint's own quantization convention."""
    view = copy.copy(ck)
    view.store = _ExpertSlice(ck.store, f"{module}.", expert)  # type: ignore[assignment]
    return ck.convention.linear(view, module)


def stacked_experts(ck: Checkpoint, module: str, count: int | None = None) -> list[Linear]:
    """Each expert of a stacked module (mlx-lm's switch_mlp): every `module.*` tensor holds
    `count` experts first (default: as many as its weight)."""
    tensors = [k for k in ck.store if k.startswith(f"{module}.")]
    if not tensors:
        raise FormatError(f"{module}.weight: missing (stacked experts)")
    count = ck.store.shape(f"{module}.weight")[0] if count is None else count
    for t in tensors:
        if ck.store.shape(t)[:1] != (count,):
            raise FormatError(
                f"{t}: shape {list(ck.store.shape(t))}, expected {count} experts first "
                "(stacked experts)"
            )
    return [_stacked_linear(ck, module, e) for e in range(count)]


def stack(experts: list[Linear]) -> tuple[QExperts, dict[str, np.ndarray]]:
    """One stacked weight of linears of one format and shape (checked by the caller)."""
    bufs = {b: np.stack([lin.buffers[b] for lin in experts]) for b in experts[0].buffers}
    return QExperts(experts[0].weight, len(experts)), bufs


def read_experts(
    ck: Checkpoint, moe: Moe, layer: int, proj: str
) -> tuple[str, QExperts, dict[str, np.ndarray]]:
    """The stacked experts of one projection ("gate", "up" or "down") of `layer`: their weight
    key, type and buffers [E, ...]. Every expert must have the first one's format and shape, and
    the shape config.json implies."""
    fam = moe.architecture
    base = f"model.layers.{layer}"
    if fam.hub_mxfp4:
        return _hub_mxfp4(ck, moe, layer, proj)
    name = fam.names[PROJECTIONS.index(proj)]
    stacked = f"{base}.{fam.stacked.format(w=f'{proj}_proj')}"
    if any(k.startswith(f"{stacked}.") for k in ck.store):
        key, experts = stacked, stacked_experts(ck, stacked, moe.experts)
    else:
        key = f"{base}.{fam.expert.format(e='*', w=name)}"
        experts = [
            ck.linear(f"{base}.{fam.expert.format(e=e, w=name)}") for e in range(moe.experts)
        ]
    hidden = ck.hidden_size
    want = (hidden, moe.intermediate) if proj == "down" else (moe.intermediate, hidden)
    first = experts[0].weight
    for lin in experts:
        w = lin.weight
        if (w.out_features, w.in_features) != want:
            raise FormatError(
                f"{lin.module}.weight: holds a {[w.out_features, w.in_features]} expert, but "
                f"config.json implies {list(want)} (hidden_size, {fam.intermediate_key})"
            )
        if w != first:
            raise FormatError(
                f"{lin.module}: {w.format.spell()} differs from {experts[0].module}'s "
                f"{first.format.spell()} (one projection's experts share one format)"
            )
    return (key, *stack(experts))


def _hub_mxfp4(
    ck: Checkpoint, moe: Moe, layer: int, proj: str
) -> tuple[str, QExperts, dict[str, np.ndarray]]:
    """gpt-oss's stacked MXFP4 experts: gate rows 0::2 and up rows 1::2 of gate_up_proj (as
    transformers' GptOssExperts splits them), down_proj whole."""
    fused = "down_proj" if proj == "down" else "gate_up_proj"
    key = f"model.layers.{layer}.{moe.architecture.hub_mxfp4.format(w=fused)}"
    rows = slice(None) if proj == "down" else slice(PROJECTIONS.index(proj), None, 2)
    qe, bufs = hub_stacked_experts(ck, key, moe.experts, rows)
    hidden = ck.hidden_size
    want = (hidden, moe.intermediate) if proj == "down" else (moe.intermediate, hidden)
    got = (qe.out_features, qe.in_features)
    if got != want:
        rows_of = "" if proj == "down" else f" ({proj} rows of the interleaved gate/up)"
        raise FormatError(
            f"{key}_blocks: holds {list(got)} experts{rows_of}, but config.json implies "
            f"{list(want)} (hidden_size, {moe.architecture.intermediate_key})"
        )
    return f"{key}.{proj}" if proj != "down" else key, qe, bufs


def gate_act(ck: Checkpoint, moe: Moe) -> dict[str, Any]:
    """The expert gate/up pair's act attributes (qir.moe.GATE_ACTS)."""
    if moe.architecture.act != "swiglu_clamp":
        return {}
    limit, alpha = (
        float(ck.field(k) if ck.field(k) is not None else d) for k, d in SWIGLU_DEFAULTS.items()
    )
    return {"act": "swiglu_clamp", "limit": limit, "alpha": alpha}


def router(ck: Checkpoint, moe: Moe, layer: int) -> Linear:
    """The layer's router [E, hidden], checked against the expert count."""
    lin = ck.linear(f"model.layers.{layer}.{moe.architecture.router}")
    got = (lin.weight.out_features, lin.weight.in_features)
    if got != (moe.experts, ck.hidden_size):
        raise FormatError(
            f"{lin.module}.weight: holds a {list(got)} router, but config.json implies "
            f"[{moe.experts}, {ck.hidden_size}] ({moe.count_key}, hidden_size)"
        )
    return lin
