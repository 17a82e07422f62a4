"""The `qir` command. Bad input ends in one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from qir import dtypes
from qir.api import Compiled, compile
from qir.audit import audit
from qir.codegen.lower import Plan, lower
from qir.dump import dump, plan_json
from qir.errors import QirError, UsageError
from qir.graph import Graph
from qir.logs import LOGGER
from qir.models import load
from qir.models.blocks import BLOCKS, Block, build
from qir.passes.manager import PASSES, PIPELINES, PassOptions, PassRecord, run_pipeline
from qir.passes.route_w4a4 import TIERS
from qir.printer import print_graph
from qir.runtime import cache as kernel_cache
from qir.runtime.backend import BACKENDS, best_backend
from qir.runtime.cuda import available as cuda_available
from qir.runtime.warm import HOST as HOST_TARGET
from qir.runtime.warm import warm

EXIT_USAGE = 2
ACT_DTYPES = ("f16", "bf16", "f32")
DEMO_M = (1, 5)


def _block(args: argparse.Namespace) -> Block:
    ck = load(args.checkpoint)
    act = dtypes.by_name(args.act_dtype) if args.act_dtype else None
    return build(ck, args.block, args.layer, act)


def _read_input(path: Path, block: Block) -> np.ndarray:
    x_type = block.graph.node("x").type
    try:
        x = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
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
    return x.astype(x_type.dtype.np)  # type: ignore[union-attr]


def _print_ir(args: argparse.Namespace) -> Callable[[str, Graph], None] | None:
    if args.print_ir != "after-all":
        return None

    def show(pass_name: str, graph: Graph) -> None:
        print(f"// after {pass_name}\n{print_graph(graph)}", file=sys.stderr)

    return show


def _pipeline(args: argparse.Namespace, block: Block) -> tuple[Graph, list[PassRecord]]:
    options = PassOptions(weight_quantization=args.weight_quantization)
    return run_pipeline(block.graph, args.passes, after_each=_print_ir(args), options=options)


def cmd_run(args: argparse.Namespace) -> int:
    block = _block(args)
    x = _read_input(args.input, block)
    c = compile(
        block.graph,
        block.weights,
        backend=args.backend,
        passes=args.passes,
        weight_quantization=args.weight_quantization,
        after_each=_print_ir(args),
    )
    out = c({"x": x})
    arrays: dict[str, Any] = {k: np.asarray(v).astype(np.float32) for k, v in out.items()}
    np.savez(args.out, **arrays)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in out.items()))
    if args.audit:
        rows = audit(block.graph, block.weights, {"x": x}, args.weight_quantization)
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


def cmd_dump(args: argparse.Namespace) -> int:
    block = _block(args)
    after, records = _pipeline(args, block)
    plan = lower(after)
    files = dump(block.graph, after, plan, args.out)
    for r in records:
        print(f"pass {r.name}: {r.matches} match(es), {r.seconds * 1e3:.2f} ms")
    print(f"wrote {len(files)} files to {args.out} ({len(plan.launches)} kernel launches)")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    block = _block(args)
    after, _ = _pipeline(args, block)
    plan = lower(after)
    text = json.dumps(plan_json(plan, args.m), indent=2) + "\n"
    if args.json:
        args.json.write_text(text)
    elif not args.resources:
        sys.stdout.write(text)
    if args.resources:
        _print_resources(plan, args.arch, args.m or 1)
    return 0


def _print_resources(plan: Plan, arch: str, m: int) -> None:
    """The static cost table of the launches that run at M (qir.runtime.resources)."""
    from qir.runtime import nvrtc, resources
    from qir.runtime.errors import BackendUnavailable

    if not nvrtc.available():
        raise BackendUnavailable("--resources compiles with NVRTC: pip install 'qir[compile]'")
    nvrtc.check_arch(arch)
    print(f"M={m}, {arch}")
    sys.stdout.write(resources.format_table(resources.kernel_costs(plan, arch, m)))


def _max_rel(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    worst = 0.0
    for k, r in ref.items():
        r32 = r.astype(np.float32)
        diff = np.max(np.abs(ours[k].astype(np.float32) - r32))
        worst = max(worst, float(diff / max(float(np.max(np.abs(r32))), 1e-30)))
    return worst


def embedded_checkpoints() -> list[Path]:
    root = resources.files("qir.models") / "embedded"
    return sorted(Path(str(p)) for p in root.iterdir() if (Path(str(p)) / "config.json").is_file())


def cmd_demo(args: argparse.Namespace) -> int:
    backend = args.backend or best_backend()
    rng = np.random.default_rng(0)
    rows = []
    for path in embedded_checkpoints():
        ck = load(path)
        for name in BLOCKS:
            block = build(ck, name, 0)
            c: Compiled = compile(block.graph, block.weights, backend=backend)
            ref = compile(block.graph, block.weights, backend="reference")
            for m in DEMO_M:
                x = rng.standard_normal((m, ck.hidden_size), dtype=np.float32).astype(
                    ck.act_dtype.np
                )
                err = _max_rel(c({"x": x}), ref({"x": x}))
                rows.append((path.name, name, m, c.launches_for(m), backend, err))
    header = ("checkpoint", "block", "M", "launches", "backend", "max rel err vs reference")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)) + "  " + header[5])
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=False)) + f"  {r[5]:.2e}")
    return 0


_WEIGHT_SUFFIXES = (".weight", ".qweight", ".weight_packed")


def _natural(name: str) -> list[Any]:
    # model.layers.2 before model.layers.10
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def cmd_inspect(args: argparse.Namespace) -> int:
    ck = load(args.checkpoint)
    tensors = ck.store.keys()
    modules = sorted(
        {
            name[: -len(suffix)]
            for name in tensors
            for suffix in _WEIGHT_SUFFIXES
            # 1-D .weight tensors are norms, not linears
            if name.endswith(suffix) and (suffix != ".weight" or len(ck.store.shape(name)) == 2)
        },
        key=_natural,
    )
    tty = sys.stderr.isatty()
    start = shown = time.monotonic()
    rows, total = [], 0
    for i, module in enumerate(modules, 1):
        lin = ck.linear(module)
        w, facts = lin.weight, lin.weight.format.describe()
        nbytes = sum(a.nbytes for a in lin.buffers.values())
        total += nbytes
        rows.append(
            (
                module,
                w.format.spell(),
                str(facts["bits"] or "-"),
                str(facts["group"] or "-"),
                f"[{w.out_features}, {w.in_features}]",
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
    return 0


def cmd_dequant(args: argparse.Namespace) -> int:
    module = args.module
    for suffix in _WEIGHT_SUFFIXES:
        module = module.removesuffix(suffix)
    lin = load(args.checkpoint).linear(module)
    w = lin.weight.format.dequantize(lin.buffers, lin.weight.out_features, lin.weight.in_features)
    np.save(args.out, w)
    print(f"wrote {args.out}: float32 {list(w.shape)} from {lin.weight.format.spell()}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    root = kernel_cache.default_root()
    if args.action == "clear":
        print(f"removed {kernel_cache.clear(root)} entries from {root}")
        return 0
    if args.action == "warm":
        return _cache_warm(args, root)
    print(f"cache {root} (set QIR_CACHE_DIR to move it)")
    for ns in kernel_cache.info(root):
        print(f"  {ns.name:6} {ns.entries:5d} entries {ns.bytes / 2**20:9.2f} MiB")
    # A cache warmed elsewhere is only hit where these agree: compare them on both machines.
    print("keys here depend on")
    for what, value in _key_facts():
        print(f"  {what:8} {value}")
    return 0


def _key_facts() -> list[tuple[str, str]]:
    from qir.runtime import host, nvrtc
    from qir.runtime.toolkit import cuda_include_dirs, toolkit_fingerprint

    include = cuda_include_dirs()
    facts = [("codegen", kernel_cache.codegen_hash()[:16])]
    facts.append(
        ("headers", f"{toolkit_fingerprint()[:16]} ({include[0]})" if include else "none found")
    )
    try:
        facts.append(("g++", host.compiler_version().splitlines()[0]))
    except OSError:
        facts.append(("g++", "not found"))
    facts.append(
        ("nvrtc", nvrtc.nvrtc_version() if nvrtc.available() else "no cuda-core 1.x (qir[compile])")
    )
    return facts


def _cache_warm(args: argparse.Namespace, root: Path) -> int:
    targets = [*args.arch, *([HOST_TARGET] if args.host else [])] or [_local_arch()]
    ck = load(args.checkpoint)
    act = dtypes.by_name(args.act_dtype) if args.act_dtype else None
    options = PassOptions(weight_quantization=args.weight_quantization)
    layers = args.layers if args.layers is not None else range(ck.num_layers)
    kernels = []
    for layer in layers:
        for name in args.blocks:
            graph, _ = run_pipeline(build(ck, name, layer, act).graph, args.passes, options=options)
            kernels += [launch.kernel for launch in lower(graph).launches]
    for w in warm(kernels, targets, root):
        print(
            f"{w.target}: {w.kernels} kernels, {w.compiled} compiled, "
            f"{w.kernels - w.compiled} already cached ({w.seconds:.1f} s)"
        )
    print(f"cache {root}")
    return 0


def _local_arch() -> str:
    if not cuda_available():
        raise UsageError(
            "cache warm: no GPU here to take the arch from; name the targets: "
            "--arch sm_90 [sm_80 ...] (NVRTC, no GPU needed) and/or --host"
        )
    import cupy

    return f"sm_{cupy.cuda.Device().compute_capability}"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--block", required=True, help=f"one of {', '.join(BLOCKS)}")
    p.add_argument("--layer", type=int, default=0, help="decoder layer index (default 0)")
    _lowering(p)
    p.add_argument("--print-ir", choices=("after-all",), help="print the IR after every pass")


def _lowering(p: argparse.ArgumentParser) -> None:
    """The options that decide which kernels a block becomes."""
    p.add_argument(
        "--act-dtype", choices=ACT_DTYPES, help="activation dtype (default: the checkpoint's)"
    )
    p.add_argument(
        "--passes",
        default="default",
        help=f"pipeline ({', '.join(PIPELINES)}) or comma-separated passes ({', '.join(PASSES)})",
    )
    p.add_argument(
        "--weight-quantization",
        default="declared",
        choices=TIERS,
        help="NVFP4 weights taking 4-bit activations: declared by the checkpoint (default), "
        "all, or none",
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qir", description="Compile and run quantized LLM blocks.")
    ap.add_argument("-q", "--quiet", action="store_true", help="no compile progress lines")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a block of a checkpoint on an input")
    _common(run)
    run.add_argument("--input", type=Path, required=True, help="X.npy, [M, hidden] float16/float32")
    run.add_argument("--out", type=Path, required=True, help="OUT.npz (float32 y, or q/k/v)")
    run.add_argument("--backend", choices=BACKENDS, default="reference")
    run.add_argument(
        "--audit",
        action="store_true",
        help="per W4A4 projection: error vs its W4A16 twin and vs a float32 reference",
    )
    run.set_defaults(func=cmd_run)

    dmp = sub.add_parser("dump", help="write the IR and the generated CUDA of a block")
    _common(dmp)
    dmp.add_argument("--out", type=Path, required=True, help="output directory")
    dmp.set_defaults(func=cmd_dump)

    cmp_ = sub.add_parser("compile", help="print the launch plan of a block as JSON")
    _common(cmp_)
    cmp_.add_argument("--m", type=int, default=None, help="batch rows M to size the grids for")
    cmp_.add_argument("--json", type=Path, help="write the plan here instead of stdout")
    cmp_.add_argument(
        "--resources",
        action="store_true",
        help="print each kernel's static cost on --arch (registers, spills, occupancy, SASS "
        "instructions and bytes in flight per 512 B of weights, the bandwidth bound) at --m",
    )
    cmp_.add_argument("--arch", default="sm_90", help="arch for --resources (default sm_90)")
    cmp_.set_defaults(func=cmd_compile)

    demo = sub.add_parser(
        "demo", help="run the embedded checkpoints and check against the reference"
    )
    demo.add_argument(
        "--backend", choices=BACKENDS, help="default: cuda if a GPU is present, else host"
    )
    demo.set_defaults(func=cmd_demo)

    ins = sub.add_parser("inspect", help="list a checkpoint's linears: format, bits, shape, bytes")
    ins.add_argument("checkpoint", type=Path, help="checkpoint directory")
    ins.set_defaults(func=cmd_inspect)

    deq = sub.add_parser("dequant", help="write one linear's weight as a float32 [out, in] .npy")
    deq.add_argument("checkpoint", type=Path, help="checkpoint directory")
    deq.add_argument("module", help="module path, e.g. model.layers.0.mlp.down_proj")
    deq.add_argument("-o", "--out", type=Path, required=True, help="output W.npy")
    deq.set_defaults(func=cmd_dequant)

    cch = sub.add_parser("cache", help="show, clear or fill the compiled-kernel cache")
    cch.set_defaults(func=cmd_cache)
    actions = cch.add_subparsers(dest="action", required=True)
    actions.add_parser("info", help="where the cache is, entries and size")
    actions.add_parser("clear", help="delete qir's entries")
    wrm = actions.add_parser(
        "warm",
        help="compile a checkpoint's kernels ahead of time (for --arch no GPU is needed: warm "
        "a deployment image's cache while building it)",
    )
    wrm.add_argument("checkpoint", type=Path, help="checkpoint directory")
    wrm.add_argument("--blocks", nargs="+", choices=BLOCKS, default=list(BLOCKS))
    wrm.add_argument("--layers", type=int, nargs="+", help="decoder layers (default: all)")
    wrm.add_argument(
        "--arch",
        nargs="+",
        default=[],
        help="NVRTC targets, e.g. sm_90 sm_80 (default: this GPU's)",
    )
    wrm.add_argument("--host", action="store_true", help="the host backend's kernels too")
    _lowering(wrm)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logger = logging.getLogger(LOGGER)
    level = logger.level
    if args.quiet:  # else $QIR_LOG's level, info by default (see qir.logs)
        logger.setLevel(logging.WARNING)
    try:
        code: int = args.func(args)
        return code
    except (QirError, FileNotFoundError, NotADirectoryError) as e:
        first = str(e).strip().splitlines()
        print(f"qir: error: {first[0] if first else type(e).__name__}", file=sys.stderr)
        if len(first) > 1:
            # compile errors carry the compiler output and source excerpt on further lines
            print("\n".join(first[1:]), file=sys.stderr)
        return EXIT_USAGE
    finally:
        logger.setLevel(level)  # main() may be called in a process that goes on


if __name__ == "__main__":
    sys.exit(main())
