"""Checkpoints whose groups do not divide by the tensor-parallel ranks, made from the fixtures:
the MLP trimmed to its first features (gate/up rows and down's inputs, cut in the checkpoint's
own layout by the family's reader, as a rank would read them), GPTQ given desc_act's scattered
g_idx, compressed-tensors int re-quantized per channel. A split test compares one with itself
unsplit; their numbers are not the fixtures' goldens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from qir.models import load
from qir.models.safetensors_io import DTYPES, SafetensorsFile
from qir.models.shard_read import ShardReader
from tests.conftest import DATA

MLP = ("gate_proj", "up_proj", "down_proj")


def _rewrite(path: Path, edit: dict[str, np.ndarray]) -> None:
    """Replace the tensors named in `edit` in whichever safetensors file of `path` holds them,
    keeping each file's metadata and tensor order (float8 included, which safetensors.numpy
    cannot write)."""
    names = {dt: name for name, (_, dt) in DTYPES.items() if dt is not None}
    for file in sorted(path.glob("*.safetensors")):
        f = SafetensorsFile(file)
        stored = f.keys()
        if not any(k in edit for k in stored):
            continue
        tensors = {k: np.ascontiguousarray(edit.get(k, f.get(k))) for k in stored}
        header: dict[str, object] = {"__metadata__": f.metadata} if f.metadata else {}
        offset = 0
        for k, a in tensors.items():
            header[k] = {
                "dtype": names[a.dtype],
                "shape": list(a.shape),
                "data_offsets": [offset, offset + a.nbytes],
            }
            offset += a.nbytes
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        blob = b"".join(a.tobytes() for a in tensors.values())
        del f
        file.write_bytes(len(head).to_bytes(8, "little") + head + blob)


def _edit_config(path: Path, **changes: object) -> dict:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config


def trimmed(out: Path, fixture: str, features: int) -> Path:
    """`fixture` with every layer's MLP cut to its first `features` intermediate features."""
    shutil.copytree(DATA / fixture, out)
    ck = load(out)
    whole = ck.config["intermediate_size"]
    reader = ShardReader(ck.store, ck.convention.axes(ck.config), ck.convention.parts, ck.config)
    edit: dict[str, np.ndarray] = {}
    for layer in range(ck.config["num_hidden_layers"]):
        for proj in MLP:
            module = f"model.layers.{layer}.mlp.{proj}"
            cut = ("in" if proj == "down_proj" else "out", 0, features, whole)
            edit.update({k: np.array(v) for k, v in reader.part_tensors(module, cut).items()})
    del ck, reader  # the files are mapped
    _rewrite(out, edit)
    _edit_config(out, intermediate_size=features)
    return out


def desc_act(path: Path, seed: int = 0) -> Path:
    """A GPTQ checkpoint at `path` given desc_act's g_idx on its row-parallel linears (o_proj,
    down_proj): input i in group rank(i) // g of a random order of the inputs, as GPTQ's act-order
    numbers them, so any range of inputs uses nearly every group. The codes are unchanged: only
    which scale each input takes."""
    rng = np.random.default_rng(seed)
    g = json.loads((path / "config.json").read_text())["quantization_config"]["group_size"]
    edit = {}
    for file in path.glob("*.safetensors"):
        for key, g_idx in load_file(str(file)).items():
            if key.endswith(".g_idx") and ("o_proj" in key or "down_proj" in key):
                edit[key] = (np.argsort(rng.permutation(len(g_idx))) // g).astype(np.int32)
    _rewrite(path, edit)
    return path


def ct_int_per_channel(out: Path, fixture: str = "ct_w4a16_int4_S") -> Path:
    """A compressed-tensors int checkpoint re-quantized by compressed-tensors' rule with one
    scale per row (strategy "channel", as its W8A16 scheme writes), from its own decoded
    weights."""
    from qir.formats.ct_int import CtInt

    shutil.copytree(DATA / fixture, out)
    ck = load(out)
    edit = {}
    for name in ck.store:
        if not name.endswith(".weight_packed"):
            continue
        module = name.removesuffix(".weight_packed")
        lin = ck.linear(module)
        t = lin.weight
        fmt = t.format
        assert isinstance(fmt, CtInt)
        w = fmt.dequantize(lin.buffers, t.out_features, t.in_features)
        bufs = CtInt(fmt.bits, t.in_features, fmt.scale_dtype).quantize(w)
        edit[name] = bufs["weight"].view(np.int32)
        edit[f"{module}.weight_scale"] = bufs["scales"]
    del ck
    _rewrite(out, edit)
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"].update(strategy="channel", group_size=None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def gptq_per_row(out: Path, fixture: str = "autogptq_g64_llama") -> Path:
    """A GPTQ checkpoint re-quantized by GPTQ's rule with one group per row (group_size -1), from
    its own decoded weights, in auto-gptq's layout (its g_idx all zeros)."""
    from qir.formats.bitstream import pack_codes
    from qir.formats.gptq import Gptq

    shutil.copytree(DATA / fixture, out)
    ck = load(out)
    edit = {}
    for name in ck.store:
        if not name.endswith(".qweight"):
            continue
        module = name.removesuffix(".qweight")
        lin = ck.linear(module)
        t, fmt = lin.weight, lin.weight.format
        assert isinstance(fmt, Gptq)
        w = fmt.dequantize(lin.buffers, t.out_features, t.in_features)
        per_row = Gptq(fmt.bits, t.in_features, fmt.checkpoint_format, 0, fmt.scale_dtype)
        bufs = per_row.quantize(w)
        edit[name] = np.ascontiguousarray(bufs["weight"].T).view(np.int32)
        zeros = pack_codes(np.ascontiguousarray(bufs["zeros"].T).astype(np.uint32), fmt.bits)
        edit[f"{module}.qzeros"] = zeros.view(np.int32)
        edit[f"{module}.scales"] = np.ascontiguousarray(bufs["scales"].T)
        edit[f"{module}.g_idx"] = np.zeros(t.in_features, np.int32)
    del ck
    _rewrite(out, edit)
    file = next(out.glob("gptq_model-*.safetensors")).stem
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(group_size=-1, model_file_base_name=file)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "quantize_config.json").unlink()
    return out


def uneven_heads(out: Path, kv_heads: int) -> Path:
    """A synthetic MLX Llama (tests/models/synthetic_llama.py) in groups of 64 whose 10 heads of
    32 end on a group only in pairs: o_proj's 320 inputs and down_proj's 704 are 5 and 11
    groups, so no rank count from 2 up splits either evenly."""
    from tests.models.synthetic_llama import write_llama

    return write_llama(
        out,
        hidden_size=320,
        num_attention_heads=10,
        num_key_value_heads=kv_heads,
        head_dim=32,
        intermediate_size=704,
        quantization={"group_size": 64, "bits": 4},
    )


# name -> how to make it under a directory: the uneven checkpoints the split tests share
UNEVEN = {
    # 5 groups of 64 (the AWQ case, 11 groups of 128, in small): 3 + 2 on 2 ranks,
    # 2 + 1 + 1 + 1 on 4
    "awq_gemm@320": lambda d: trimmed(d, "awq_gemm_g64_S", 320),
    "awq_gemv@320": lambda d: trimmed(d, "awq_gemv_g64_S", 320),
    "gptq@320": lambda d: trimmed(d, "autogptq_g64_llama", 320),
    "gptq_desc_act@320": lambda d: desc_act(trimmed(d, "autogptq_g64_llama", 320)),
    "mlx@320": lambda d: trimmed(d, "mlx_affine4_g64_S", 320),
    # 21 NVFP4 blocks of 16; 11 MX blocks of 32
    "nvfp4_w4a4@336": lambda d: trimmed(d, "ct_nvfp4_w4a4_S", 336),
    "mxfp4@352": lambda d: trimmed(d, "ct_mxfp4a16_S", 352),
    # 3 groups of 128: 2 + 1 on 2 ranks
    "ct_int4@384": lambda d: trimmed(d, "ct_w4a16_int4_S", 384),
    "ct_int4_channel": lambda d: ct_int_per_channel(d),
    "gptq_per_row": lambda d: gptq_per_row(d),
    # 5 KV heads, each 2 query heads of 32 (one group of 64): 3 + 2 KV heads on 2 ranks,
    # 2 + 1 + 1 + 1 on 4; one KV head: its 10 heads 4 + 2 + 2 + 2 on 4 ranks that replicate it
    "heads10_kv5": lambda d: uneven_heads(d, 5),
    "heads10_kv1": lambda d: uneven_heads(d, 1),
}


def uneven(tmp: Path, name: str) -> Path:
    """The checkpoint UNEVEN names, made under `tmp` (or a fixture of tests/data as it is)."""
    if name not in UNEVEN:
        return DATA / name
    return UNEVEN[name](tmp / name.replace("@", "_"))
