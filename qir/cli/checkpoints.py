"""Commands that read a checkpoint's weights: list its linears, decode one."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from qir.errors import FormatError
from qir.models import Checkpoint, load
from qir.models.experts import Moe, gate_act, moe_of, stack, stacked_experts
from qir.models.gguf_checkpoint import GgufCheckpoint
from qir.types import QWeight

# gpt-oss's stacked MXFP4 experts are <module>_blocks (qir.models.quant_conventions.hf_mxfp4)
_WEIGHT_SUFFIXES = (".weight", ".qweight", ".weight_packed", "_blocks")


def _natural(name: str) -> list[Any]:
    # model.layers.2 before model.layers.10
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _gguf_tensors(ck: GgufCheckpoint) -> None:
    """A GGUF model's tensors as stored (ggml type, ne, bytes; the name qir reads them by) and
    the metadata qir reads."""
    model = ck.model
    hf = {ck.gguf_store.stored(n): n for n in ck.gguf_store}
    rows = [("tensor", "type", "shape [ne]", "bytes", "read as")]
    total = 0
    for f in model.files:
        for name, t in f.tensors.items():
            total += t.nbytes
            rows.append((name, t.type.name, str(list(t.ne)), str(t.nbytes), hf.get(name, "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    shards = f" in {len(model.files)} files" if len(model.files) > 1 else ""
    print(f"{len(rows) - 1} tensors, {total} bytes{shards} (GGUF v{model.files[0].version})")
    print()
    used = {k: v for k, v in ck.config.items() if k != "architectures"}
    print(
        f"metadata ({model.value('general.architecture')}): "
        + ", ".join(f"{k} {v!r}" for k, v in used.items())
    )
    tok = [
        f"{k.removeprefix('tokenizer.ggml.')} {model.metadata[k]!r}"
        for k in TOKENIZER_KEYS
        if k in model.metadata
    ]
    tok += (
        [f"{len(model.metadata['tokenizer.ggml.tokens'])} tokens"]
        if "tokenizer.ggml.tokens" in model.metadata
        else []
    )
    tok += ["chat template"] if "tokenizer.chat_template" in model.metadata else []
    print(f"tokenizer: {', '.join(tok) or 'none'}")


TOKENIZER_KEYS = tuple(
    f"tokenizer.ggml.{k}"
    for k in ("model", "pre", "bos_token_id", "eos_token_id", "eot_token_id", "add_bos_token")
)


def cmd_inspect(args: argparse.Namespace) -> int:
    ck = load(args.checkpoint)
    if isinstance(ck, GgufCheckpoint):
        _gguf_tensors(ck)
        print()
        print("\n".join(_architecture(ck)))
        return 0
    tensors = ck.store.keys()
    modules = sorted(
        {
            name[: -len(suffix)]
            for name in tensors
            for suffix in _WEIGHT_SUFFIXES
            # 1-D .weight tensors are norms, not linears; 3-D ones stacked experts
            if name.endswith(suffix)
            and (suffix != ".weight" or len(ck.store.shape(name)) in (2, 3))
        },
        key=_natural,
    )
    tty = sys.stderr.isatty()
    start = shown = time.monotonic()
    rows, total = [], 0
    for i, module in enumerate(modules, 1):
        w, buffers, experts = _read(ck, module)
        facts = w.format.describe()
        nbytes = sum(a.nbytes for a in buffers.values())
        total += nbytes
        rows.append(
            (
                module,
                w.format.spell(),
                str(facts["bits"] or "-"),
                str(facts["group"] or "-"),
                (f"{experts} x " if experts else "") + f"[{w.out_features}, {w.in_features}]",
                str(nbytes),
                "yes" if facts["w4a4"] else "no",
            )
        )
        # Progress only where someone watches (a TTY) or the load is slow, at most 2 lines/s.
        now = time.monotonic()
        if not args.quiet and (tty or now - start > 1) and (now - shown > 0.5 or i == len(modules)):
            print(
                f"qir: loading {i}/{len(modules)} modules",
                file=sys.stderr,
                end="\r" if tty else "\n",
            )
            shown = now
    if tty and not args.quiet:
        print(file=sys.stderr)
    header = ("module", "format", "bits", "group", "shape [out, in]", "bytes", "W4A4")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    print(f"{len(rows)} linears, {total} bytes")
    print()
    print("\n".join(_architecture(ck)))
    moe = moe_of(ck)
    if moe is not None:
        shared = (
            f", and a shared expert of {moe.shared} ({moe.architecture.shared_key}) scaled by "
            f"sigmoid({moe.architecture.shared_gate})"
            if moe.shared
            else ""
        )
        print(
            f"mixture of experts: {moe.experts} experts ({moe.count_key}), "
            f"{moe.top_k} per token ({moe.rule}){shared}{_gate(ck, moe)}"
        )
    return 0


def _gate(ck: Checkpoint, moe: Moe) -> str:
    """The experts' gate/up activation where it is not silu (gpt-oss's clamped SwiGLU)."""
    act = gate_act(ck, moe)
    if not act:
        return ""
    return f", gate/up {act['act']} (swiglu_limit {act['limit']}, swiglu_alpha {act['alpha']})"


def _architecture(ck: Checkpoint) -> list[str]:
    """What the decoder layers compute (qir.models.architectures), or why qir cannot say."""
    try:
        f = ck.features
    except FormatError as e:
        return [f"architecture: not supported: {e}"]
    lines = f.describe()
    if ck.text_of:
        lines.insert(1, f"  {ck.text_of}")
    lines.insert(
        1 + bool(ck.text_of),
        f"  {ck.num_layers} layers, {ck.num_heads} heads of {ck.head_dim} "
        f"({ck.num_kv_heads} kv heads), {'tied' if ck.tie_word_embeddings else 'untied'} "
        "lm_head",
    )
    try:
        rope = ck.rope
        scaling = ", ".join(
            f"{k} {_short(v)}" for k, v in rope.items() if k not in ("head_dim", "theta")
        )
        lines.append(f"  RoPE theta {rope['theta']:g}, {scaling}")
    except FormatError as e:
        lines.append(f"  RoPE: not supported: {e}")
    return lines


def _short(v: Any) -> str:
    """An attribute for a line of `qir inspect`: longrope's factors as their first, last, count."""
    if isinstance(v, tuple):
        return f"[{v[0]:g} .. {v[-1]:g}] ({len(v)})"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _read(ck: Checkpoint, module: str) -> tuple[QWeight, dict[str, np.ndarray], int]:
    """A module's weight type and buffers, and its expert count (0: one linear; stacked experts
    are read as one weight [E, out, in])."""
    weight = f"{module}.weight"
    if weight in ck.store and len(ck.store.shape(weight)) == 3:
        qe, bufs = stack(stacked_experts(ck, module))
        return qe.expert, bufs, qe.count
    blocks = f"{module}_blocks"
    if blocks in ck.store and f"{module}.weight" not in ck.store:
        from qir.models.quant_conventions.hf_mxfp4 import stacked_experts as hub_experts

        qe, bufs = hub_experts(ck, module, ck.store.shape(blocks)[0])
        return qe.expert, bufs, qe.count
    lin = ck.linear(module)
    return lin.weight, lin.buffers, 0


def cmd_dequant(args: argparse.Namespace) -> int:
    module = args.module
    for suffix in _WEIGHT_SUFFIXES:
        module = module.removesuffix(suffix)
    weight, buffers, experts = _read(load(args.checkpoint), module)
    fmt, out, in_ = weight.format, weight.out_features, weight.in_features
    if experts:  # stacked experts: float32 [E, out, in]
        w = np.stack(
            [
                fmt.dequantize({b: a[e] for b, a in buffers.items()}, out, in_)
                for e in range(experts)
            ]
        )
    else:
        w = fmt.dequantize(buffers, out, in_)
    np.save(args.out, w)
    print(f"wrote {args.out}: float32 {list(w.shape)} from {fmt.spell()}")
    return 0


def register(sub: Any) -> None:
    ins = sub.add_parser("inspect", help="list a checkpoint's linears: format, bits, shape, bytes")
    ins.add_argument("checkpoint", type=Path, help="checkpoint directory or .gguf file")
    ins.set_defaults(func=cmd_inspect)

    deq = sub.add_parser("dequant", help="write one linear's weight as a float32 [out, in] .npy")
    deq.add_argument("checkpoint", type=Path, help="checkpoint directory or .gguf file")
    deq.add_argument("module", help="module path, e.g. model.layers.0.mlp.down_proj")
    deq.add_argument("-o", "--out", type=Path, required=True, help="output W.npy")
    deq.set_defaults(func=cmd_dequant)
