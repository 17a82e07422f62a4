"""`qir cache info|clear|warm`: the compiled-kernel cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from qir import dtypes
from qir.cli.options import add_lowering
from qir.codegen.kernel import Kernel
from qir.codegen.lower import lower
from qir.errors import UsageError
from qir.models import load
from qir.models.blocks import BLOCKS, build
from qir.passes.manager import PassOptions, run_pipeline
from qir.runtime import cache as kernel_cache
from qir.runtime.backend import default_target
from qir.runtime.cuda import available as cuda_available
from qir.runtime.warm import HOST as HOST_TARGET
from qir.runtime.warm import warm
from qir.target import Target

# The sub-blocks `cache warm` covers by default.
PARTS = ("mlp", "qkv")


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
    """Each --arch gets the kernels lowered for it; --host those of every --arch (what `run
    --backend host --arch` runs), or of the default target."""
    targets = [Target(a) for a in args.arch] or ([] if args.host else [_local_target()])
    ck = load(args.checkpoint)
    act = dtypes.by_name(args.act_dtype) if args.act_dtype else None
    options = PassOptions(weight_quantization=args.weight_quantization)
    layers = args.layers if args.layers is not None else range(ck.num_layers)
    graphs = []
    for i, layer in enumerate(layers):
        for name in args.blocks:
            if name == "model" and i:  # every layer's kernels already
                continue
            graph, _ = run_pipeline(build(ck, name, layer, act).graph, args.passes, options=options)
            graphs.append(graph)

    def kernels(target: Target) -> list[Kernel]:
        return [la.kernel for g in graphs for la in lower(g, target=target).launches]

    plans = {t.arch: kernels(t) for t in targets}
    if args.host:
        plans[HOST_TARGET] = [k for t in targets or [default_target()] for k in kernels(t)]
    for w in warm(plans, root):
        print(
            f"{w.target}: {w.kernels} kernels, {w.compiled} compiled, "
            f"{w.kernels - w.compiled} already cached ({w.seconds:.1f} s)"
        )
    print(f"cache {root}")
    return 0


def _local_target() -> Target:
    if not cuda_available():
        raise UsageError(
            "cache warm: no GPU here to take the arch from; name the targets: "
            "--arch sm_90 [sm_80 ...] (NVRTC, no GPU needed) and/or --host"
        )
    return default_target()


def register(sub: Any) -> None:
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
    wrm.add_argument("--blocks", nargs="+", choices=BLOCKS, default=list(PARTS))
    wrm.add_argument("--layers", type=int, nargs="+", help="decoder layers (default: all)")
    wrm.add_argument("--host", action="store_true", help="the host backend's kernels too")
    add_lowering(wrm, several_archs=True)
