"""The mixture-of-experts fixtures (tests/data/mixtral_*, qwen3moe_*, qwen2moe_*): tiny random models of a
family, quantized by the real tools, with goldens from transformers' own modelling code in
float32 on the tool-decoded weights. Steps (each in the venv named; each case's ORACLE.md records
the exact commands):

  source FAMILY OUT     (transformers 5.24 + torch) the source model, bf16, and OUT_fp16 for AutoAWQ
  awq SRC_FP16 DST      (autoawq 0.2.9 + transformers 4.51.3) AutoAWQ GEMM int4 g64, per expert
  decode-mlx CASE       (mlx 0.32.4 + mlx-lm 0.32.2) CASE/golden.npz: mx.dequantize of each linear
  decode-awq CASE       (autoawq 0.2.9) CASE/golden.npz: awq's dequantize_gemm of each linear
  goldens CASE          (transformers 5.24 + torch) CASE/golden_model.npz and golden.npz's inputs
                        and layer outputs, from the decoded weights of golden.npz

golden.npz: `W.<l>.<q|k|v|o>`, `W.<l>.router`, `W.<l>.experts.<e>.<name>` (the family's names:
w1/w3/w2, gate_proj/up_proj/down_proj), `W.<l>.<gate|up|down>` of a dense MLP layer,
`W.<l>.shared.<name>` / `W.<l>.shared_gate` of a shared expert and its gate (float32 [out, in],
as the tool decodes them; only the family's `keep_layers` where it names them),
`W.embed_tokens` / `W.lm_head` where the tool quantized them; `x.M1/M5/M40` (float16 [M,
hidden], the shared fixtures' inputs); per MoE layer `moe.<l>.M<m>` (float32: the sparse MoE
block alone on x, no norm, no residual; with a shared expert, `shared.<l>.M<m>` its gated part),
`router.<l>.M<m>` (its router logits), `route_ids.<l>.M<m>` / `route_weights.<l>.M<m>` (torch's
softmax, topk and renormalisation); the shared fixtures' layer-0 block keys `q/k/v/o.0.M<m>`
(x W^T), `mlp.0.M<m>` (x + layer 0's MLP, dense or MoE) and `mlpd.0.M<m>` (the MLP alone).
golden_model.npz: the shared fixtures' keys (tokens, embed, hidden.<l>, logits, layer.<l>.M<m>,
greedy, step_logits).
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, VOCAB = 256, 2, 256
COMMON = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Per family: its config beyond COMMON, where its router and experts are, the layers with
# experts (the others a dense MLP), mlx-lm's stacked module.
FAMILIES = {
    "mixtral": {
        "config": {
            "intermediate_size": 128,
            "num_local_experts": 6,
            "num_experts_per_tok": 2,
            "sliding_window": None,
        },
        "experts": "num_local_experts",
        "router": "block_sparse_moe.gate",
        "expert": "block_sparse_moe.experts.{e}.{w}",
        "names": ("w1", "w3", "w2"),
        "stacked": "block_sparse_moe.switch_mlp",
        "moe_layers": (0, 1),
    },
    "qwen3_moe": {
        "config": {
            "intermediate_size": 256,  # layer 0's dense MLP (mlp_only_layers)
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "use_sliding_window": False,
        },
        "experts": "num_experts",
        "router": "mlp.gate",
        "expert": "mlp.experts.{e}.{w}",
        "names": ("gate_proj", "up_proj", "down_proj"),
        "stacked": "mlp.switch_mlp",
        "moe_layers": (1,),
    },
    # Qwen2-MoE: a shared expert (a dense MLP of shared_expert_intermediate_size) beside the
    # routed ones, scaled by sigmoid(shared_expert_gate(x)); q/k/v biases. Smaller than the
    # others (hidden 128) to stay under 1 MB with its goldens; every layer routes (mlx-lm's
    # qwen2_moe has no dense layers).
    "qwen2_moe": {
        "config": {
            "hidden_size": 128,
            "head_dim": 32,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
        },
        "experts": "num_experts",
        "router": "mlp.gate",
        "expert": "mlp.experts.{e}.{w}",
        "names": ("gate_proj", "up_proj", "down_proj"),
        "stacked": "mlp.switch_mlp",
        "moe_layers": (0, 1),
        "shared": "mlp.shared_expert",
        "shared_gate": "mlp.shared_expert_gate",
        # golden.npz keeps only these layers' decoded MoE weights (its size)
        "keep_layers": (0,),
    },
}
DENSE = {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
PROMPT, STEPS, MS = 12, 8, (1, 5, 40)
PROJ = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
}


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An ordinary .npz (plain np.load reads it) whose members are LZMA-compressed."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_LZMA) as z:
        for key, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(a), allow_pickle=False)
            z.writestr(f"{key}.npy", buf.getvalue())


def family_of(case: Path) -> tuple[dict, dict]:
    """The case's family row and its config.json."""
    config = json.loads((case / "config.json").read_text())
    return FAMILIES[config["model_type"]], config


def modules(fam: dict, config: dict) -> dict[str, str]:
    """golden key -> HF module path of every linear of every layer."""
    out = {}
    for layer in range(LAYERS):
        pre = f"model.layers.{layer}"
        out.update({f"W.{layer}.{p}": f"{pre}.{m}" for p, m in PROJ.items()})
        if layer not in fam["moe_layers"]:
            out.update({f"W.{layer}.{p}": f"{pre}.{m}" for p, m in DENSE.items()})
            continue
        out[f"W.{layer}.router"] = f"{pre}.{fam['router']}"
        if "shared" in fam:
            for w in fam["names"]:
                out[f"W.{layer}.shared.{w}"] = f"{pre}.{fam['shared']}.{w}"
            out[f"W.{layer}.shared_gate"] = f"{pre}.{fam['shared_gate']}"
        for e in range(config[fam["experts"]]):
            for w in fam["names"]:
                out[f"W.{layer}.experts.{e}.{w}"] = f"{pre}.{fam['expert'].format(e=e, w=w)}"
    return out


def source(family: str, out: str) -> None:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]["config"]})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # the router: logits of std ~2, decisive
                p.copy_(torch.randn_like(p) * 2.0 * p.shape[-1] ** -0.5)
            elif p.ndim >= 2:  # linears and stacked experts [E, out, in]: std in^-1/2
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            elif name.endswith(".bias"):  # Qwen2-MoE's q/k/v biases: large enough to matter
                p.copy_(0.5 * torch.randn_like(p))
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0"
    )
    for dtype, where in ((torch.bfloat16, out), (torch.float16, f"{out}_fp16")):
        model.to(dtype).save_pretrained(where, safe_serialization=True)
        fast.save_pretrained(where)
        if family in ("qwen3_moe", "qwen2_moe"):  # the keys the Hub's configs (and mlx-lm) use
            path = Path(where) / "config.json"
            config = json.loads(path.read_text())
            if "num_local_experts" in config:
                config["num_experts"] = config.pop("num_local_experts")
            config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
            path.write_text(json.dumps(config, indent=2))


def awq(src: str, dst: str) -> None:
    from awq import AutoAWQForCausalLM

    class Tok:  # AutoAWQ only calls encode on a text calibration set; ours are ids
        def encode(self, text: str) -> list[int]:
            raise AssertionError("calibration data is token ids")

    calib = [[(7 * i + 3 * j) % 250 for j in range(64)] for i in range(16)]
    model = AutoAWQForCausalLM.from_pretrained(src, device_map="cpu")
    model.quantize(
        Tok(),
        quant_config={"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"},
        calib_data=calib,
        max_calib_samples=16,
        max_calib_seq_len=64,
        n_parallel_calib_samples=4,
    )
    model.save_quantized(dst)


def decode_mlx(case: str) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(case))
    flat = dict(model.named_modules())
    golden: dict[str, np.ndarray] = {}

    def dequant(mod: object) -> np.ndarray:
        scales = mod.scales.astype(mx.float32)  # exact; mx.dequantize rounds to the scales' dtype
        biases = None if getattr(mod, "biases", None) is None else mod.biases.astype(mx.float32)
        w = mx.dequantize(
            mod.weight,
            scales,
            biases,
            group_size=mod.group_size,
            bits=mod.bits,
            mode=mod.mode,
            dtype=mx.float32,
        )
        return np.array(w)

    fam, config = family_of(Path(case))
    stacked = dict(zip(fam["names"], ("gate_proj", "up_proj", "down_proj"), strict=True))
    for key, module in modules(fam, config).items():
        if ".experts." not in key:
            if hasattr(flat[module], "scales"):  # else left unquantized: `goldens` reads it
                golden[key] = dequant(flat[module])
            continue
        layer, e, w = key.split(".")[1], int(key.split(".")[3]), key.split(".")[4]
        name = f"model.layers.{layer}.{fam['stacked']}.{stacked[w]}"
        golden[key] = dequant(flat[name])[e]  # one expert of the stacked module
    golden["W.embed_tokens"] = dequant(flat["model.embed_tokens"])
    golden["W.lm_head"] = dequant(flat["lm_head"])
    save_npz(Path(case) / "golden.npz", golden)


def decode_awq(case: str) -> None:
    import torch
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    stored: dict[str, torch.Tensor] = {}
    for f in sorted(Path(case).glob("*.safetensors")):
        stored.update(load_file(str(f)))
    golden = {}
    for key, module in modules(*family_of(Path(case))).items():
        if f"{module}.qweight" not in stored:
            continue  # left unquantized (the router): read from the checkpoint by `goldens`
        w = dequantize_gemm(
            stored[f"{module}.qweight"],
            stored[f"{module}.qzeros"],
            stored[f"{module}.scales"].float(),
            4,
            64,
        )
        golden[key] = w.float().T.contiguous().numpy()
    save_npz(Path(case) / "golden.npz", golden)


def goldens(case_dir: str) -> None:
    """float32 transformers forward of the decoded weights: a dense float32 checkpoint in the Hub
    layout is written to a scratch folder and loaded by from_pretrained (transformers' own
    conversion stacks the experts), eager attention."""
    import tempfile

    import torch
    from safetensors.numpy import save_file
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    case = Path(case_dir)
    golden = dict(np.load(case / "golden.npz"))
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(case.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    dense: dict[str, np.ndarray] = {}
    fam, _ = family_of(case)
    for key, module in modules(*family_of(case)).items():
        dense[f"{module}.weight"] = (
            golden[key] if key in golden else stored[f"{module}.weight"].float().numpy()
        )
    for name in ("model.embed_tokens", "lm_head"):
        key = f"W.{name.split('.')[-1]}"
        dense[f"{name}.weight"] = (
            golden[key] if key in golden else stored[f"{name}.weight"].float().numpy()
        )
    for name, t in stored.items():
        if name.endswith(("norm.weight", ".bias")):  # norms, Qwen2-MoE's q/k/v biases
            dense[name] = t.float().numpy()
    config = json.loads((case / "config.json").read_text())
    for k in ("quantization_config", "quantization"):
        config.pop(k, None)
    config["dtype"] = "float32"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file(
            {k: np.ascontiguousarray(v, np.float32) for k, v in dense.items()},
            f"{tmp}/model.safetensors",
        )
        model = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    rng = np.random.default_rng(1234)
    for m in MS:
        shape = (m, config["hidden_size"])
        golden[f"x.M{m}"] = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for layer in range(LAYERS):
            mlp = model.model.layers[layer].mlp
            for m in MS:
                x = torch.from_numpy(golden[f"x.M{m}"].astype(np.float32))
                y = mlp(x[None])[0].numpy()
                if layer in fam["moe_layers"]:
                    logits, scores, ids = mlp.gate(x)  # torch's own softmax, topk, renorm
                    golden[f"router.{layer}.M{m}"] = logits.numpy()
                    golden[f"route_ids.{layer}.M{m}"] = ids.numpy().astype(np.int64)
                    golden[f"route_weights.{layer}.M{m}"] = scores.numpy()
                    golden[f"moe.{layer}.M{m}"] = y
                    if "shared" in fam:  # sigmoid(shared_expert_gate(x)) * shared_expert(x)
                        gate = torch.sigmoid(mlp.shared_expert_gate(x))
                        golden[f"shared.{layer}.M{m}"] = (gate * mlp.shared_expert(x)).numpy()
                if layer == 0:  # the shared fixtures' block keys: mlp is x + layer 0's MLP
                    golden[f"mlpd.0.M{m}"] = y
                    golden[f"mlp.0.M{m}"] = x.numpy() + y
                    for p, module in PROJ.items():  # x W^T (+ b where the family has one)
                        golden[f"{p}.0.M{m}"] = model.get_submodule(f"model.layers.0.{module}")(
                            x
                        ).numpy()
                out[f"layer.{layer}.M{m}"] = layer_alone(model, layer, golden[f"x.M{m}"])
        tokens = torch.tensor([[(7 * j + 3) % VOCAB for j in range(PROMPT)]])
        captured: list[torch.Tensor] = []
        hooks = [
            mod.register_forward_hook(
                lambda m, a, o: captured.append(o[0] if isinstance(o, tuple) else o)
            )
            for mod in (model.model.embed_tokens, *model.model.layers)
        ]
        res = model(tokens, use_cache=False)
        for h in hooks:
            h.remove()
        out["tokens"] = tokens[0].numpy().astype(np.int64)
        out["embed"] = captured[0][0].numpy()
        for layer in range(LAYERS):  # the residual stream after each layer, before the final norm
            out[f"hidden.{layer}"] = captured[layer + 1][0].numpy()
        out["logits"] = res.logits[0].numpy()
        gen = model.generate(
            tokens,
            max_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        out["greedy"] = gen.sequences[0, PROMPT:].numpy().astype(np.int64)
        out["step_logits"] = torch.stack(gen.logits)[:, 0].numpy()
    keep = fam.get("keep_layers")
    if keep is not None:  # only the MoE block's weights of those layers (router, experts, shared)
        golden = {
            k: v
            for k, v in golden.items()
            if not k.startswith("W.")
            or (k.split(".")[1] in map(str, keep) and k.split(".")[2] not in PROJ)
        }
    save_npz(case / "golden.npz", golden)
    save_npz(case / "golden_model.npz", out)


def layer_alone(model, layer: int, x: np.ndarray) -> np.ndarray:
    """Layer `layer` on x at positions 0..m-1 of an empty cache (its input replaced by x)."""
    import torch

    layers = model.model.layers
    captured = []
    xt = torch.from_numpy(x.astype(np.float32))[None]

    def pre(module, args, kwargs):
        if args:
            return (xt, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": xt}

    hooks = [
        layers[layer].register_forward_pre_hook(pre, with_kwargs=True),
        layers[layer].register_forward_hook(
            lambda mod, a, o: captured.append(o[0] if isinstance(o, tuple) else o)
        ),
    ]
    model(inputs_embeds=xt, use_cache=False)
    for h in hooks:
        h.remove()
    return captured[0][0].numpy()


if __name__ == "__main__":
    step, *args = sys.argv[1:]
    {
        "source": source,
        "awq": awq,
        "decode-mlx": decode_mlx,
        "decode-awq": decode_awq,
        "goldens": goldens,
    }[step](*args)
