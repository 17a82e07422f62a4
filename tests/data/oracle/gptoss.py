"""The gpt-oss fixture (tests/data/gptoss_mxfp4): a tiny random GptOssForCausalLM saved in the
Hub's MXFP4 layout, with goldens from transformers' own modelling code. Steps (venv: transformers
5.24 + torch 2.13 CPU; ORACLE.md records the exact commands):

  source CASE     the model: random weights (norms, biases, sinks, routers big enough to move
                  the logits), the experts encoded to MXFP4 by the small numpy encoder below (the
                  layout docs/formats.md describes: E2M1 pairs low nibble first, E8M0 scales bias
                  127, one per 32 inputs; gate and up rows interleaved as the Hub stores them),
                  everything else bf16; config.json with `quantization_config: mxfp4`.
  goldens CASE    transformers loads CASE with `Mxfp4Config(dequantize=True)` on CPU, float32,
                  eager attention: golden.npz holds its decoded experts and the MoE block's keys,
                  golden_model.npz the shared whole-model keys (tests/data/README.md).

golden.npz: `W.0.gate_up` [E, 2*I, H] / `W.0.down` [E, H, I] (layer 0's; float32, transformers'
dequantized parameters transposed back to [out, in], rows in the checkpoint's interleaved
order), `x.M1/M5/M40` (float16 [M, H]), per layer `router.<l>.M<m>`, `route_ids.<l>.M<m>`,
`route_weights.<l>.M<m>` (torch's topk then softmax over the k), `moe.<l>.M<m>` (the MoE block
alone on x); the shared fixtures' layer-0 block keys `q/k/v.0.M<m>` (with their biases),
`mlp.0.M<m>` (x + the MoE block). golden_model.npz's
`layer.<l>.M<m>` is the whole layer on x at positions 0..m-1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from moe_fixtures import layer_alone, save_npz

HIDDEN, LAYERS, VOCAB, EXPERTS, INTER = 128, 3, 256, 4, 64
CONFIG = {
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
QUANT = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
PROMPT, STEPS, MS = 20, 8, (1, 5, 40)


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., out, in] float32 -> (blocks u8 [..., out, in/32, 16], scales u8 [..., out, in/32]):
    the OCP reference's choice of exponent (floor(log2 amax) - 2, elements saturated to +-6),
    E2M1 codes by round to nearest even, element 2k in the low nibble of byte k."""
    import ml_dtypes

    *lead, out, k = w.shape
    g = w.reshape(*lead, out, k // 32, 32).astype(np.float32)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 2.0**-126))) - 2, -127)
    e = np.clip(e, -127, 127)
    codes = np.clip(g / np.exp2(e)[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)


def source(case_dir: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    case = Path(case_dir)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gpt_oss", **CONFIG)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("router.weight"):  # logits of std ~2: decisive choices
                p.copy_(torch.randn_like(p) * 2.0 * p.shape[-1] ** -0.5)
            elif name.endswith("sinks"):  # logits of the order of q.k's: they move the softmax
                p.copy_(1.0 + torch.randn_like(p))
            elif name.endswith("experts.gate_up_proj"):  # [E, in, out]: a few gates past the
                p.copy_(torch.randn_like(p) * 3.0 * p.shape[-2] ** -0.5)  # swiglu limit
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.randn_like(p) * p.shape[-2] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers holds [E, in, out]; the Hub stores [E, out, in/32, 16] (+ scales)
            blocks, scales = encode_mxfp4(p.transpose(1, 2).contiguous().numpy())
            tensors[f"{name}_blocks"] = torch.from_numpy(blocks)
            tensors[f"{name}_scales"] = torch.from_numpy(scales)
        else:
            tensors[name] = p.to(torch.bfloat16).contiguous()
    case.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(case / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(case)
    config = json.loads((case / "config.json").read_text())
    config["quantization_config"] = QUANT
    config["dtype"] = "bfloat16"
    (case / "config.json").write_text(json.dumps(config, indent=2))


def goldens(case_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    case = Path(case_dir)
    model = AutoModelForCausalLM.from_pretrained(
        case,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    ).eval()
    golden: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(1234)
    for m in MS:
        golden[f"x.M{m}"] = rng.standard_normal((m, HIDDEN), dtype=np.float32).astype(np.float16)
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for layer in range(LAYERS):
            mlp = model.model.layers[layer].mlp
            if layer == 0:  # one layer's decode (the fixture stays under 1 MB)
                golden["W.0.gate_up"] = mlp.experts.gate_up_proj.transpose(1, 2).numpy()
                golden["W.0.down"] = mlp.experts.down_proj.transpose(1, 2).numpy()
            for m in MS:
                x = torch.from_numpy(golden[f"x.M{m}"].astype(np.float32))
                logits, scores, ids = mlp.router(x)
                golden[f"router.{layer}.M{m}"] = logits.numpy()
                golden[f"route_ids.{layer}.M{m}"] = ids.numpy().astype(np.int64)
                golden[f"route_weights.{layer}.M{m}"] = scores.numpy()
                golden[f"moe.{layer}.M{m}"] = mlp(x[None])[0][0].numpy()
                if layer == 0:  # the shared fixtures' block keys: q/k/v with their biases
                    golden[f"mlp.0.M{m}"] = x.numpy() + golden[f"moe.0.M{m}"]
                    attn = model.model.layers[0].self_attn
                    for p in "qkv":
                        golden[f"{p}.0.M{m}"] = getattr(attn, f"{p}_proj")(x).numpy()
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
        for layer in range(LAYERS):
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
    save_npz(case / "golden.npz", golden)
    save_npz(case / "golden_model.npz", out)


if __name__ == "__main__":
    step, *args = sys.argv[1:]
    {"source": source, "goldens": goldens}[step](*args)
