"""Tensor-parallel scaling on the host backend: decode tokens/s of `qir generate --tp N` (N MPI
processes, one rank each) against --tp 1, side by side, medians.

    python benchmarks/tp.py [--tp 1 2 4] [--hidden 1024] [--layers 2] [--tokens 16] [--repeat 3]

Measured on the 2-core development machine while two other developers' tests ran on it,
--tp 1 2 4 --hidden 512 --layers 2 --tokens 8 --repeat 3: 1.6, 1.7 and 2.3 tokens/s (1.00,
1.06, 1.44): noisy, and a CPU says little about what a split buys on GPUs.

The model is a synthetic Llama in MLX 4-bit (group 64) written to a temporary directory, sized
by --hidden (intermediate 2.75x, head_dim 64, a KV head per 4 heads, --vocab 4096) so
that the weights, not the launches, dominate a step. Each row runs the CLI once per repeat (its
--stats line gives decode tokens/s; kernels compile before the clock starts); the ratio is the
median's over --tp 1's; a first run per row fills the kernel cache. On a CPU with fewer cores than N x the host runtime's workers, ranks
compete for cores: the GPU's numbers (NCCL) are what a split is for."""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from qir.dtypes import BF16
from qir.formats.mlx import MlxAffine

FMT = MlxAffine(4, 64, BF16)
STATS = re.compile(r"generated at ([0-9.]+) tokens/s")


def write_model(path: Path, hidden: int, layers: int, vocab: int = 4096) -> Path:
    """A random MLX 4-bit Llama checkpoint (config.json + model.safetensors)."""
    import json

    from safetensors.numpy import save_file

    heads = hidden // 64
    kv_heads = max(heads // 4, 1)
    inter = max((hidden * 11 // 4) // 256 * 256, 256)  # 4 ranks cut it on whole groups of 64
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}

    def linear(module: str, out: int, inp: int) -> None:
        w = rng.standard_normal((out, inp), dtype=np.float32) / np.sqrt(inp)
        tensors.update({f"{module}.{k}": v for k, v in FMT.quantize(w).items()})

    def norm(module: str) -> None:
        tensors[f"{module}.weight"] = np.ones(hidden, np.float32).astype(BF16.np)

    linear("model.embed_tokens", vocab, hidden)
    linear("lm_head", vocab, hidden)
    norm("model.norm")
    for i in range(layers):
        p = f"model.layers.{i}"
        linear(f"{p}.self_attn.q_proj", heads * 64, hidden)
        linear(f"{p}.self_attn.k_proj", kv_heads * 64, hidden)
        linear(f"{p}.self_attn.v_proj", kv_heads * 64, hidden)
        linear(f"{p}.self_attn.o_proj", hidden, heads * 64)
        linear(f"{p}.mlp.gate_proj", inter, hidden)
        linear(f"{p}.mlp.up_proj", inter, hidden)
        linear(f"{p}.mlp.down_proj", hidden, inter)
        norm(f"{p}.input_layernorm")
        norm(f"{p}.post_attention_layernorm")
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization": {"group_size": FMT.group_size, "bits": FMT.bits},
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def decode_tps(ck: Path, tp: int, tokens: int) -> float:
    cmd = [sys.executable, "-m", "qir.cli", "-q", "generate", str(ck), "--tokens", "1,2,3,4"]
    cmd += ["--max-new-tokens", str(tokens), "--greedy", "--ignore-eos", "--backend", "host"]
    cmd += ["--max-seq", "64", "--stats", "--tp", str(tp)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    found = STATS.search(p.stderr)
    if p.returncode != 0 or found is None:
        raise RuntimeError(f"--tp {tp}: exit {p.returncode}\n{p.stderr}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> list[tuple[int, float, float]]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=16, help="ids generated per run")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qir-tp-") as d:
        ck = write_model(Path(d) / "llama", args.hidden, args.layers, args.vocab)
        print(
            f"host backend, MLX 4-bit Llama hidden {args.hidden}, {args.layers} layers; decode "
            f"tokens/s, median of {args.repeat}; ratio = tp N / tp {args.tp[0]}"
        )
        print(f"{'tp':>3} {'tokens/s':>9} {'ratio':>6}")
        base = 0.0
        for n in args.tp:
            decode_tps(ck, n, 2)  # compiles its kernels into the cache: no run below waits on g++
            tps = statistics.median(decode_tps(ck, n, args.tokens) for _ in range(args.repeat))
            base = base or tps
            rows.append((n, tps, tps / base))
            print(f"{n:>3} {tps:>9.1f} {tps / base:>6.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
