"""The auto-gptq fixture: `python gptq.py SRC DST` in a venv with auto-gptq 0.7.1
(transformers 4.51.3, torch 2.13.0+cpu; BUILD_CUDA_EXT=0, so its torch fallback runs).

auto-gptq's own pipeline (from_pretrained, quantize, save_quantized) with its "cuda:0" device
constant pointed at the CPU (it refuses to start without CUDA otherwise; the GPTQ maths are
plain torch). GPTQ 4-bit, group 64, symmetric, desc_act false, on 16 calibration sequences of 64 ids
(ids[i][j] = (7 i + 3 j) % 250). auto-gptq builds every quantized linear with a bias buffer and
saves it (all zeros, fp16) for each of the 7 linears of every layer. Writes DST/golden.npz keys
`W.<l>.<p>`: each QuantLinear's own torch dequantization (qlinear_cuda_old's fallback path,
`scales * (q - (qzeros + 1))`) with its fp16 scales widened to float32 first, read off its
forward on the identity in float32 (so W is the unrounded decode), transposed to [out, in];
and `bias.<l>.<p>` (float32, what the module adds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from auto_gptq import AutoGPTQForCausalLM, BaseQuantizeConfig
from auto_gptq.modeling import _base

PROJ = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def main(src: str, dst: str) -> None:
    torch.manual_seed(0)
    qc = BaseQuantizeConfig(bits=4, group_size=64, desc_act=False, sym=True)
    # auto-gptq 0.7.1 quantizes layer by layer on "cuda:0" and refuses to start without CUDA:
    # its device constant is pointed at the CPU (the GPTQ maths are device-independent torch).
    _base.CUDA_0 = torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None  # timing only (fasterquant's log line)
    available, torch.cuda.is_available = torch.cuda.is_available, lambda: True
    model = AutoGPTQForCausalLM.from_pretrained(src, qc, torch_dtype=torch.float16)
    torch.cuda.is_available = available
    examples = [
        {
            "input_ids": torch.tensor([[(7 * i + 3 * j) % 250 for j in range(64)]]),
            "attention_mask": torch.ones(1, 64, dtype=torch.long),
        }
        for i in range(16)
    ]
    model.quantize(examples, use_triton=False)
    model.save_quantized(dst, use_safetensors=True)

    loaded = AutoGPTQForCausalLM.from_quantized(
        dst, device="cpu", use_triton=False, disable_exllama=True, disable_exllamav2=True
    )
    layers = json.loads((Path(dst) / "config.json").read_text())["num_hidden_layers"]
    out: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for p, path in PROJ.items():
            mod = loaded.model.get_submodule(f"model.layers.{layer}.{path}")
            with torch.no_grad():
                bias, mod.bias = mod.bias, None
                mod.scales = mod.scales.float()  # the unrounded decode
                eye = torch.eye(mod.infeatures, dtype=torch.float32)
                w = mod(eye).T.contiguous()  # [out, in]
            out[f"W.{layer}.{p}"] = w.numpy().astype(np.float32)
            out[f"bias.{layer}.{p}"] = bias.float().numpy()
    np.savez_compressed(Path(dst) / "golden.npz", **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
