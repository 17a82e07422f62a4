"""ptxas' figures for the compile gate's kernels, recorded in tests/data/ptxas_record.json.

NVRTC was two thirds of the gate's time and the gate a quarter of the suite's. What ptxas
reports is a function of what `nvrtc.key_parts` names (the source, qir's headers, the options,
the arch, the NVRTC build and the CUDA headers' fingerprint) and nothing else, so a kernel whose
key is in the record has been built by that same compiler from that same text: the gate takes
its registers and spill bytes from there and builds only the kernels whose text changed (or all
of them under another NVRTC). `make gate` builds the whole matrix without the record
(scripts/ptxas_record.py --fresh, then the gate on every arch) and rewrites the record.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from qir.codegen.kernel import Kernel
from qir.runtime import nvrtc

PATH = Path(__file__).parent / "data" / "ptxas_record.json"


@dataclass(frozen=True)
class Figures:
    registers: int
    spill_bytes: int


def record_key(kernel: Kernel, arch: str) -> str:
    """The record's key: everything a cubin depends on (qir's codegen hash is not: a codegen
    change that renders the same text builds the same cubin)."""
    h = hashlib.sha256()
    for name, value in sorted(nvrtc.key_parts(kernel, arch).items()):
        h.update(f"{name}\0{value}\0".encode())
    return h.hexdigest()[:32]


@cache
def load(path: Path = PATH) -> dict[str, Figures]:
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text())["kernels"]
    return {k: Figures(r, s) for k, (_name, _arch, r, s) in rows.items()}


def lookup(kernel: Kernel, arch: str) -> Figures | None:
    return load().get(record_key(kernel, arch))


def build(kernel: Kernel, arch: str) -> Figures:
    """NVRTC's figures (raises SpillError on a spill, like the gate always did)."""
    (result,) = nvrtc.check_no_spills(kernel, archs=(arch,))
    assert result.cubin[:4] == b"\x7fELF", kernel.name
    return Figures(result.registers, result.spill_bytes)


def write(rows: dict[str, tuple[str, str, int, int]], path: Path = PATH) -> None:
    """rows: key -> (kernel name, arch, registers, spill bytes); names and archs are there for
    whoever reads a diff of the record."""
    lines = [f"{json.dumps(k)}: {json.dumps(list(row))}" for k, row in sorted(rows.items())]
    nvrtc_build = json.dumps(nvrtc.nvrtc_version())
    body = ",\n".join(lines)
    path.write_text(f'{{"nvrtc": {nvrtc_build}, "kernels": {{\n{body}\n}}}}\n')
