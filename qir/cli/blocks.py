"""Commands on one block of a checkpoint: run it, dump its IR and CUDA, print its launch plan
and static cost, draw it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from qir.api import compile
from qir.audit import audit
from qir.cli import tp
from qir.cli.options import (
    add_block_options,
    block_of,
    model_of,
    pipeline,
    print_ir,
    target_of,
    token_ids,
)
from qir.codegen.lower import lower
from qir.codegen.plan import Plan
from qir.draw import SUFFIXES, draw
from qir.dump import collectives_json, dump, k_parts_json, plan_json
from qir.errors import UsageError
from qir.models.blocks import Block
from qir.models.shards import tensor_parallel
from qir.runtime.backend import BACKENDS


def _read_input(path: Path, block: Block) -> np.ndarray:
    x_type = block.graph.node("x").type
    try:
        x = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
        raise UsageError(f"--input {path}: cannot read a .npy array ({e})") from None
    hidden = block.graph.node("x").type.shape[1]  # type: ignore[union-attr]
    if x.ndim != 2 or x.shape[1] != hidden:
        raise UsageError(
            f"--input {path}: shape {list(x.shape)}, expected [M, {hidden}] (hidden_size)"
        )
    if x.shape[0] < 1:
        raise UsageError(f"--input {path}: M must be at least 1")
    if x.dtype not in (np.float16, np.float32):
        raise UsageError(f"--input {path}: dtype {x.dtype}, expected float16 or float32")
    if not np.all(np.isfinite(x)):
        raise UsageError(f"--input {path}: contains NaN or Inf")
    result: np.ndarray = x.astype(x_type.dtype.np)  # type: ignore[union-attr]
    return result


def cmd_run(args: argparse.Namespace) -> int:
    if args.block == "model":
        return _run_model(args)
    if args.tp != 1:
        raise UsageError(f"--tp is for --block model, not --block {args.block}")
    if args.tokens is not None:
        raise UsageError(f"--tokens is for --block model; --block {args.block} takes --input")
    if args.input is None:
        raise UsageError(f"--block {args.block} needs --input X.npy ([M, hidden])")
    block = block_of(args)
    x = _read_input(args.input, block)
    inputs = block.inputs(x)
    c = compile(
        block.graph,
        block.weights,
        backend=args.backend,
        passes=args.passes,
        weight_quantization=args.weight_quantization,
        after_each=print_ir(args),
        target=args.arch,
    )
    out = c(inputs)
    arrays: dict[str, Any] = {k: np.asarray(v).astype(np.float32) for k, v in out.items()}
    np.savez(args.out, **arrays)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in out.items()))
    if args.audit:
        rows = audit(block.graph, block.weights, inputs, args.weight_quantization)
        if not rows:
            print(
                f"audit: no projection runs W4A4 (--weight-quantization {args.weight_quantization}, M={len(x)})"
            )
        print(f"{'node':8} {'w4a4 vs w4a16':>14} {'w4a4 vs f32':>12} {'w4a16 vs f32':>13}")
        for r in rows:
            print(
                f"{r.node:8} {r.w4a4_vs_w4a16:>14.3e} {r.w4a4_vs_f32:>12.3e} {r.w4a16_vs_f32:>13.3e}"
            )
    return 0


def _run_model(args: argparse.Namespace) -> int:
    if args.tokens is None or args.input is not None:
        raise UsageError("--block model takes --tokens (ids, or an int .npy), not --input")
    if args.audit:
        raise UsageError("--audit takes blocks with an --input, not --block model")
    tokens = token_ids(args.tokens)
    launched = tp.launch(args)
    if launched is not None:
        return launched
    logits = model_of(args, args.backend, tp.comm_of(args, args.backend)).logits(tokens)
    np.savez(args.out, logits=logits)
    print(f"wrote {args.out}: logits {list(logits.shape)}")
    return 0


def _rank_block(args: argparse.Namespace) -> Block:
    """The block, or with --tp N its part on --rank R (tensor_parallel)."""
    block = block_of(args)
    if args.tp < 1 or not 0 <= args.rank < args.tp:
        raise UsageError(f"--rank {args.rank} of --tp {args.tp} is out of range")
    return tensor_parallel(block, args.tp, args.rank) if args.tp > 1 else block


def _add_rank(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks")
    p.add_argument("--rank", type=int, default=0, help="with --tp: the rank whose part to show")


def cmd_dump(args: argparse.Namespace) -> int:
    block = _rank_block(args)
    after, records = pipeline(args, block)
    plan = lower(after, target=target_of(args))
    files = dump(block.graph, after, plan, args.out)
    for r in records:
        print(f"pass {r.name}: {r.matches} match(es), {r.seconds * 1e3:.2f} ms")
    print(
        f"wrote {len(files)} files to {args.out} ({len(plan.launches)} kernel launches, "
        f"{plan.target.arch})"
    )
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    block = block_of(args)
    if args.tp != 1:
        return _compile_tp(args, block)
    after, _ = pipeline(args, block)
    plan = lower(after, target=target_of(args))
    text = json.dumps(plan_json(plan, args.m), indent=2) + "\n"
    if args.json:
        args.json.write_text(text)
    elif not args.resources:
        sys.stdout.write(text)
    if args.resources:
        _print_resources(plan, args.m or 1)
    return 0


def _compile_tp(args: argparse.Namespace, block: Block) -> int:
    """Each rank's plan (tensor_parallel, then the pipeline) with its memory at --m (default 1)
    and its collectives' bytes per token; a line per rank on stderr; --resources: each rank's
    static cost table."""
    if isinstance(args.tp, bool) or not isinstance(args.tp, int) or args.tp < 1:
        raise UsageError(f"--tp must be a positive int, got {args.tp!r}")
    m = args.m or 1
    ranks = []
    for r in range(args.tp):
        part = tensor_parallel(block, args.tp, r)
        after, _ = pipeline(args, part)
        plan = lower(after, target=target_of(args))
        entry = plan_json(plan, m)
        coll = collectives_json(plan)
        entry["collectives"] = coll
        entry["collective_bytes_per_token"] = {
            "payload": sum(int(c["payload_bytes"]) for c in coll),  # type: ignore[call-overload]
            "sent": sum(int(c["sent_bytes"]) for c in coll),  # type: ignore[call-overload]
        }
        parts = k_parts_json(plan)
        entry["k_parts"] = parts
        ranks.append(entry)
        mem: Any = entry["memory"]
        moved: Any = entry["collective_bytes_per_token"]
        cuts = ", ".join(
            f"{p['inputs'][0]}..{p['inputs'][1]} of {p['of']} ({'/'.join(p['linears'])})"
            for p in parts
        )
        print(
            f"rank {r}/{args.tp}: weights {mem['weights_bytes']} B, KV cache "
            f"{mem['kv_cache_bytes']} B, arena {mem['arena_bytes']} B at M={m}; "
            f"{len(coll)} collectives move {moved['payload']} B per token "
            f"({moved['sent']} B sent by a ring); K parts {cuts or 'none'}",
            file=sys.stderr,
        )
        if args.resources:
            print(f"rank {r}: ", end="")
            _print_resources(plan, m)
    text = json.dumps({"tp": args.tp, "ranks": ranks}, indent=2) + "\n"
    if args.json:
        args.json.write_text(text)
    elif not args.resources:
        sys.stdout.write(text)
    return 0


def _print_resources(plan: Plan, m: int) -> None:
    """The static cost table of the launches that run at M (qir.cost.resources)."""
    from qir.cost import resources
    from qir.runtime import nvrtc
    from qir.runtime.errors import BackendUnavailable

    if not nvrtc.available():
        raise BackendUnavailable("--resources compiles with NVRTC: pip install 'qir[compile]'")
    arch = nvrtc.check_arch(plan.target.arch)
    print(f"M={m}, {arch}")
    sys.stdout.write(resources.format_table(resources.kernel_costs(plan, arch, m)))


def cmd_graph(args: argparse.Namespace) -> int:
    block = _rank_block(args)
    after, _ = pipeline(args, block)
    files, missing = draw(block.graph, after, lower(after, target=target_of(args)), args.out)
    print(f"wrote {', '.join(str(f) for f in files)}")
    if missing:
        print(f"qir: {missing}", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    run = sub.add_parser("run", help="run a block of a checkpoint on an input")
    add_block_options(run)
    run.add_argument("--input", type=Path, help="X.npy, [M, hidden] float16/float32")
    run.add_argument(
        "--tokens", help="--block model: token ids, comma-separated (3,10,17) or an int .npy"
    )
    run.add_argument(
        "--out", type=Path, required=True, help="OUT.npz (float32 y, q/k/v, or logits)"
    )
    run.add_argument("--backend", choices=BACKENDS, default="reference")
    run.add_argument(
        "--audit",
        action="store_true",
        help="per W4A4 projection: error vs its W4A16 twin and vs a float32 reference",
    )
    tp.add_tp(run)
    run.set_defaults(func=cmd_run)

    dmp = sub.add_parser("dump", help="write the IR and the generated CUDA of a block")
    add_block_options(dmp)
    dmp.add_argument("--out", type=Path, required=True, help="output directory")
    _add_rank(dmp)
    dmp.set_defaults(func=cmd_dump)

    cmp_ = sub.add_parser("compile", help="print the launch plan of a block as JSON")
    add_block_options(cmp_)
    cmp_.add_argument("--m", type=int, default=None, help="batch rows M to size the grids for")
    cmp_.add_argument("--json", type=Path, help="write the plan here instead of stdout")
    cmp_.add_argument(
        "--resources",
        action="store_true",
        help="print each kernel's static cost on --arch (registers, spills, occupancy, SASS "
        "instructions and bytes in flight per 512 B of weights, the bandwidth bound) at --m",
    )
    cmp_.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="each of N tensor-parallel ranks' plan: weight, KV and arena bytes per rank and "
        "the bytes its collectives move per token",
    )
    cmp_.set_defaults(func=cmd_compile)

    gph = sub.add_parser(
        "graph", help="draw a block before and after the passes, each kernel launch boxed"
    )
    add_block_options(gph)
    gph.add_argument("--out", type=Path, required=True, help=f"picture file: {', '.join(SUFFIXES)}")
    _add_rank(gph)
    gph.set_defaults(func=cmd_graph)
