"""Goldens from transformers' own modelling code in float32: `python goldens.py CASE` in a venv
with transformers 5.24.0 and torch 2.13.0+cpu.

CASE/golden.npz must hold the tool-decoded weights (`W.<l>.<p>` float32 [out, in] for the seven
linears of every layer, `bias.<l>.<p>` where the tool adds one; `W.embed_tokens` / `W.lm_head`
where the tool quantized those); every other tensor (norms, q/k norms, embeddings, lm_head,
biases the tool left as tensors) is read from the checkpoint and widened to float32. The model
is `AutoModelForCausalLM.from_config(config.json)` with eager attention and those weights
loaded strictly. Adds to golden.npz the inputs `x.M1/M5/M40` and layer 0's block outputs, and
writes golden_model.npz (keys as tests/data/README.md describes).
"""

from __future__ import annotations

import glob
import io
import json
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

PROJ = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
PROMPT, STEPS, MS = 12, 8, (1, 5, 40)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An ordinary .npz (plain np.load reads it) whose members are LZMA-compressed."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_LZMA) as z:
        for key, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(a), allow_pickle=False)
            z.writestr(f"{key}.npy", buf.getvalue())


def checkpoint_tensors(case: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(case / "*.safetensors"))):
        out.update(load_file(f))
    return out


def build(case: Path, golden: dict[str, np.ndarray]) -> torch.nn.Module:
    raw = json.loads((case / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(case)
    for key in ("quantization_config", "quantization"):
        if hasattr(cfg, key):
            delattr(cfg, key)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    ).eval()
    stored = checkpoint_tensors(case)
    state = {}
    fused = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
    for name in model.state_dict():
        parts = name.split(".")
        if name.startswith("model.layers.") and ".".join(parts[3:-1]) in fused:
            layer, kind = int(parts[2]), "W" if parts[-1] == "weight" else "bias"
            pieces = [golden[f"{kind}.{layer}.{s}"] for s in fused[".".join(parts[3:-1])]]
            state[name] = torch.from_numpy(np.concatenate(pieces))  # the tool's rows, stacked
            continue
        if name.startswith("model.layers.") and parts[-1] in ("weight", "bias"):
            layer, module = int(parts[2]), ".".join(parts[3:-1])
            short = {v: k for k, v in PROJ.items()}.get(module)
            if short is not None:
                key = f"{'W' if parts[-1] == 'weight' else 'bias'}.{layer}.{short}"
                if key in golden:
                    state[name] = torch.from_numpy(golden[key])
                    continue
        module = name.removesuffix(".weight")
        if f"W.{module.split('.')[-1]}" in golden and name.endswith(".weight"):
            state[name] = torch.from_numpy(golden[f"W.{module.split('.')[-1]}"])
        elif name == "lm_head.weight" and raw.get("tie_word_embeddings"):
            continue  # tied: loads with embed_tokens
        else:
            state[name] = stored[name].float()
    model.load_state_dict(state, strict=not raw.get("tie_word_embeddings"))
    return model


def inputs(hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {
        f"x.M{m}": rng.standard_normal((m, hidden), dtype=np.float32).astype(np.float16) for m in MS
    }


def layer_alone(model: torch.nn.Module, layer: int, x: np.ndarray) -> np.ndarray:
    """Layer `layer` on x at positions 0..m-1 of an empty cache: the model runs from x, and the
    layer's input is replaced by x (earlier layers' outputs are discarded)."""
    layers = model.model.layers
    captured: list[torch.Tensor] = []
    xt = torch.from_numpy(x.astype(np.float32))[None]

    def pre(module, args, kwargs):
        if args:
            return (xt, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": xt}

    def post(module, args, kwargs, out):
        captured.append(out[0] if isinstance(out, tuple) else out)

    hooks = [
        layers[layer].register_forward_pre_hook(pre, with_kwargs=True),
        layers[layer].register_forward_hook(post, with_kwargs=True),
    ]
    with torch.no_grad():
        model(inputs_embeds=xt, use_cache=False)
    for h in hooks:
        h.remove()
    return captured[0][0].numpy()


def block_goldens(
    golden: dict[str, np.ndarray], xs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    out = {}

    def lin(x: np.ndarray, p: str) -> np.ndarray:
        y = x @ golden[f"W.0.{p}"].T
        return y + golden[f"bias.0.{p}"] if f"bias.0.{p}" in golden else y

    for key, x16 in xs.items():
        m = key.removeprefix("x.")
        x = x16.astype(np.float32)
        for p in ("q", "k", "v", "o"):
            if golden[f"W.0.{p}"].shape[1] == x.shape[1]:  # o only where q is hidden wide
                out[f"{p}.0.{m}"] = lin(x, p).astype(np.float32)
        g, u = lin(x, "gate"), lin(x, "up")
        d = lin((g / (1 + np.exp(-g))) * u, "down").astype(np.float32)
        out[f"mlpd.0.{m}"] = d
        out[f"mlp.0.{m}"] = (x + d).astype(np.float32)
    return out


def main(case_dir: str) -> None:
    case = Path(case_dir)
    golden = dict(np.load(case / "golden.npz"))
    biases = {k.replace("bias.", "", 1): v for k, v in golden.items() if k.startswith("bias.")}
    stored = checkpoint_tensors(case)
    raw = json.loads((case / "config.json").read_text())
    # Biases the tool kept as plain tensors: the block goldens add them too.
    for layer in range(raw["num_hidden_layers"]):
        for p, path in PROJ.items():
            name = f"model.layers.{layer}.{path}.bias"
            if f"{layer}.{p}" not in biases and name in stored:
                golden[f"bias.{layer}.{p}"] = stored[name].float().numpy()
    torch.manual_seed(0)
    model = build(case, golden)
    xs = inputs(raw["hidden_size"])
    golden.update(xs)
    golden.update(block_goldens(golden, xs))
    # The fixture keeps layer 0's decoded weights (qir's decode of every layer is checked
    # against the tool's when the fixture is made: ORACLE.md).
    save_npz(
        case / "golden.npz",
        {k: v for k, v in golden.items() if not k.startswith(("W.", "bias.")) or ".0." in k},
    )

    vocab, layers = raw["vocab_size"], raw["num_hidden_layers"]
    tokens = (7 * np.arange(PROMPT) + 3) % vocab
    out: dict[str, np.ndarray] = {"tokens": tokens.astype(np.int64)}
    ids = torch.from_numpy(tokens)[None]
    hidden: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(
            lambda m, a, o: hidden.append(o[0] if isinstance(o, tuple) else o)
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        res = model(ids, use_cache=False)
        out["embed"] = model.model.embed_tokens(ids)[0].numpy()
    for h in hooks:
        h.remove()
    for layer in range(layers):
        out[f"hidden.{layer}"] = hidden[layer][0].numpy()
    out["logits"] = res.logits[0].numpy()
    for layer in sorted({0, layers - 1}):
        for m in MS:
            out[f"layer.{layer}.M{m}"] = layer_alone(model, layer, xs[f"x.M{m}"])
    out.update(greedy(model, ids))
    save_npz(case / "golden_model.npz", out)
    top2 = np.sort(out["step_logits"], axis=-1)[:, -2:]
    print(
        "greedy", out["greedy"].tolist(), "min top-2 margin", float((top2[:, 1] - top2[:, 0]).min())
    )


def greedy(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Greedy with the KV cache: the prompt once, then one token per step (no EOS stop): the
    ids chosen and each step's logits."""
    steps, chosen = [], []
    with torch.no_grad():
        res = model(ids, use_cache=True)
        cache, logits = res.past_key_values, res.logits[0, -1]
        for step in range(STEPS):
            token = int(torch.argmax(logits))
            steps.append(logits.numpy().copy())
            chosen.append(token)
            if step + 1 < STEPS:
                res = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, logits = res.past_key_values, res.logits[0, -1]
    return {"greedy": np.array(chosen, np.int64), "step_logits": np.stack(steps).astype(np.float32)}


if __name__ == "__main__":
    main(sys.argv[1])
