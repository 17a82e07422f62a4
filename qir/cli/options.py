"""Options and helpers several command groups share: which block of which checkpoint, the
options that decide its kernels, and reading the user's inputs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qir import dtypes
from qir.errors import UsageError
from qir.graph import Graph
from qir.models import Model, load
from qir.models.blocks import BLOCKS, Block, build
from qir.models.checkpoint import MAX_SEQ_CAP
from qir.passes.manager import PASSES, PIPELINES, PassOptions, PassRecord, run_pipeline
from qir.passes.route_w4a4 import TIERS
from qir.printer import print_graph
from qir.runtime.backend import default_target
from qir.target import Target

ACT_DTYPES = ("f16", "bf16", "f32")


def block_of(args: argparse.Namespace) -> Block:
    ck = load(args.checkpoint)
    act = dtypes.by_name(args.act_dtype) if args.act_dtype else None
    return build(ck, args.block, args.layer, act, args.max_seq)


def print_ir(args: argparse.Namespace) -> Callable[[str, Graph], None] | None:
    if args.print_ir != "after-all":
        return None

    def show(pass_name: str, graph: Graph) -> None:
        print(f"// after {pass_name}\n{print_graph(graph)}", file=sys.stderr)

    return show


def pipeline(args: argparse.Namespace, block: Block) -> tuple[Graph, list[PassRecord]]:
    options = PassOptions(weight_quantization=args.weight_quantization)
    return run_pipeline(block.graph, args.passes, after_each=print_ir(args), options=options)


def token_ids(spec: str) -> np.ndarray:
    """--tokens: comma-separated ids, or a .npy file of a 1-D int array."""
    path = Path(spec)
    if spec.endswith(".npy") or path.is_file():
        try:
            ids = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
            raise UsageError(f"--tokens {spec}: cannot read a .npy array ({e})") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise UsageError(
                f"--tokens {spec}: {ids.dtype} {list(ids.shape)}, expected a 1-D int array"
            )
        result: np.ndarray = ids
        return result
    try:
        return np.array([int(t) for t in spec.split(",")], np.int64)
    except ValueError:
        raise UsageError(
            f"--tokens {spec!r}: expected comma-separated token ids (e.g. 3,10,17) or a .npy file"
        ) from None


def model_options(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Model.load's keywords from add_lowering's and add_max_seq's options."""
    return {
        "backend": backend,
        "act": dtypes.by_name(args.act_dtype) if args.act_dtype else None,
        "max_seq": args.max_seq,
        "passes": args.passes,
        "weight_quantization": args.weight_quantization,
        "target": args.arch,
    }


def model_of(args: argparse.Namespace, backend: str, comm: Any = None) -> Model:
    """The checkpoint's model; with `comm`, its rank's part (--tp)."""
    return Model.load(args.checkpoint, comm=comm, **model_options(args, backend))


def target_of(args: argparse.Namespace) -> Target:
    """--arch, else this machine's GPU's, else sm_90 (for commands that run no kernels)."""
    return Target(args.arch) if args.arch else default_target()


def add_block_options(p: argparse.ArgumentParser) -> None:
    """A checkpoint, the block and layer to build, and how to lower it."""
    p.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--block", required=True, help=f"one of {', '.join(BLOCKS)}")
    p.add_argument("--layer", type=int, default=0, help="decoder layer index (default 0)")
    add_lowering(p)
    add_max_seq(p)
    p.add_argument("--print-ir", choices=("after-all",), help="print the IR after every pass")


def add_max_seq(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-seq",
        type=int,
        help="KV cache rows of blocks with attention (default: the config's "
        f"max_position_embeddings, at most {MAX_SEQ_CAP})",
    )


ARCH_HELP = (
    "the GPU the kernels are for: sm_80, sm_90, sm_100a, sm_120a, ... (default: this machine's "
    "GPU, else sm_90); it decides the FP4 decode and the block-scaled FP4 GEMMs. --backend host "
    "runs any target's kernels (emulating their instructions), --backend cuda only its GPU's"
)


def add_lowering(p: argparse.ArgumentParser, several_archs: bool = False) -> None:
    """The options that decide which kernels a block becomes."""
    if several_archs:
        p.add_argument("--arch", nargs="+", default=[], help=f"{ARCH_HELP}; several: one plan each")
    else:
        p.add_argument("--arch", help=ARCH_HELP)
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
