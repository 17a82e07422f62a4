"""How long opening a checkpoint's safetensors files takes: qir's strict reader (every header
rule checked) beside the official library's `safe_open`, on the headers of a synthetic
Llama-3-70B-shaped AWQ checkpoint (80 layers, 7 linears of qweight/qzeros/scales plus 2 norms
each: 1843 tensors), in one file and in shards. The files are sparse: only the headers are real.

    python benchmarks/checkpoint_open.py [--layers 80] [--shards 9] [--repeat 20]

Times are medians of --repeat opens; the ratio is qir / official, so > 1 means qir is slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from qir.models.safetensors_io import SafetensorsFile, TensorStore

HIDDEN, INTER, KV = 8192, 28672, 1024
LINEARS = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}


def tensors(layers: int) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of an AWQ 4-bit g128 checkpoint, in file order."""
    out = [("model.embed_tokens.weight", "F16", [128256, HIDDEN])]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", "F16", [HIDDEN])]
        out += [(f"{p}.post_attention_layernorm.weight", "F16", [HIDDEN])]
        for name, (o, k) in LINEARS.items():
            out += [(f"{p}.{name}.qweight", "I32", [k, o // 8])]
            out += [(f"{p}.{name}.qzeros", "I32", [k // 128, o // 8])]
            out += [(f"{p}.{name}.scales", "F16", [k // 128, o])]
    return [
        *out,
        ("model.norm.weight", "F16", [HIDDEN]),
        ("lm_head.weight", "F16", [128256, HIDDEN]),
    ]


def write_sparse(path: Path, entries: list[tuple[str, str, list[int]]]) -> None:
    size = {"F16": 2, "I32": 4}
    header, offset = {}, 0
    for name, dtype, shape in entries:
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def official(paths: list[Path]) -> None:
    for p in paths:
        with safe_open(str(p), framework="numpy") as f:
            f.keys()


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--shards", type=int, default=9)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    entries = tensors(args.layers)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        single, sharded = Path(tmp) / "single", Path(tmp) / "sharded"
        single.mkdir()
        sharded.mkdir()
        write_sparse(single / "model.safetensors", entries)
        names = [f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors" for i in range(args.shards)]
        per = -(-len(entries) // args.shards)
        weight_map = {}
        for i, name in enumerate(names):
            part = entries[i * per : (i + 1) * per]
            write_sparse(sharded / name, part)
            weight_map |= {t[0]: name for t in part}
        index = {"metadata": {}, "weight_map": weight_map}
        (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
        shard_paths = [sharded / n for n in names]
        print(f"{len(entries)} tensors, {args.layers} layers; median of {args.repeat}; ms")
        print(f"{'':32} {'qir':>8} {'official':>9} {'ratio':>6}")
        cases = {
            "one file": (
                lambda: SafetensorsFile(single / "model.safetensors"),
                lambda: official([single / "model.safetensors"]),
            ),
            f"{args.shards} shards + index (TensorStore)": (
                lambda: TensorStore(sharded),
                lambda: official(shard_paths),
            ),
        }
        for what, (ours, theirs) in cases.items():
            q, o = median_ms(ours, args.repeat), median_ms(theirs, args.repeat)
            rows[what] = (q, o)
            print(f"{what:32} {q:>8.2f} {o:>9.2f} {q / o:>6.2f}")
    return rows


if __name__ == "__main__":
    main()
