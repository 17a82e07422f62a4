"""llama.cpp's side of the GGUF fixtures: `python gguf_llamacpp.py DIR [FAMILY ...]` with
llama-cpp-python 0.3.36 (built from its sdist on this CPU; it vendors llama.cpp and ggml).

For each DIR/<family>/model-F16.gguf (gguf_source.py):
1. `llama_model_quantize` (llama.cpp's own quantizer, its default parameters, no imatrix)
   writes model-Q8_0.gguf (ftype 7), model-Q4_0.gguf (2) and model-Q4_K_M.gguf (15), mixing
   types per tensor by llama.cpp's rules (Q4_K_M puts attn_v / ffn_down on Q6_K in "more bits"
   layers, output in Q6_K);
2. llama.cpp's own logits of every file for the prompt `(7 * j + 3) % vocab`, j < 12, one
   prefill with logits for every position (`Llama(..., logits_all=True)`, CPU, 1 thread): saved
   as DIR/<family>/llamacpp.npz, key `<ftype>.logits` (float32 [12, vocab]).
llama.cpp computes with its activations quantized to 8 bits in the quantized matmuls (and f16
in places): it is the second reference, compared by top-1 agreement and mean KL, not 1e-3.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import llama_cpp
import numpy as np

FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}
PROMPT_LEN = 12


def quantize(src: Path, dst: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {dst}: rc {rc}")


def logits(path: Path) -> np.ndarray:
    llm = llama_cpp.Llama(
        model_path=str(path), logits_all=True, n_ctx=64, n_threads=1, verbose=False, seed=0
    )
    vocab = llm.n_vocab()
    ids = [(7 * j + 3) % vocab for j in range(PROMPT_LEN)]
    llm.eval(ids)
    out = np.array(llm.scores[:PROMPT_LEN], np.float32)
    llm.close()
    return out


def run(family_dir: Path) -> None:
    f16 = family_dir / "model-F16.gguf"
    files = {"F16": f16}
    for name, ftype in FTYPES.items():
        files[name] = family_dir / f"model-{name}.gguf"
        quantize(f16, files[name], ftype)
    np.savez(family_dir / "llamacpp.npz", **{f"{k}.logits": logits(p) for k, p in files.items()})


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for family in sys.argv[2:] or sorted(p.name for p in root.iterdir() if p.is_dir()):
        run(root / family)
        print(family, "done")
