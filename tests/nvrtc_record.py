"""The test suite's NVRTC builds and nvdisasm listings, recorded in tests/data/nvrtc_record.zip.

NVRTC was ~80 s of the suite's CPU time on two cores (py-spy; 106 builds: the cost tables, the
targets' dumps, the cache warm-ups) and nvdisasm most of the rest of the cost tests (57
listings), the same work on every CI machine: test_resources.py and test_targets.py at -n 2
take 121 s of CPU with neither recorded, 69 s with the builds, 37 s with both. A cubin and ptxas' log are a
function of what `nvrtc.key_parts` names (the source, qir's headers, the options, the arch, the
NVRTC build and the CUDA headers' fingerprint) and nothing else, and a listing of the cubin and
the nvdisasm build, so a build or listing whose key is in the record was made by that same tool
from that same input: the session's `nvrtc._compile` and `sass._listing` (below the compile
cache) return the recorded bytes, and everything above them (the cache, ptxas' figures, the
SASS analysis, the cost tables) runs as it would. A kernel whose text changed misses and is
compiled; under another NVRTC or nvdisasm everything is. `make nvrtc-record` runs the suite
with QIR_NVRTC_RECORD=write and rewrites the record from what it made; QIR_NVRTC_RECORD=off
records nothing and reads nothing.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from qir.codegen.kernel import Kernel
from qir.cost import sass
from qir.runtime import nvrtc
from tests.ptxas_record import record_key

PATH = Path(__file__).parent / "data" / "nvrtc_record.zip"
MODE = "QIR_NVRTC_RECORD"  # "" (read the record), "off", or "write"
SHARDS = "QIR_NVRTC_RECORD_DIR"  # where "write" mode's processes put what they made


@cache
def _names(path: Path) -> frozenset[str]:
    if not path.is_file():
        return frozenset()
    with zipfile.ZipFile(path) as z:
        return frozenset(z.namelist())


def _read(name: str, path: Path | None) -> bytes | None:
    path = path or PATH
    if name not in _names(path):
        return None
    with zipfile.ZipFile(path) as z:
        return z.read(name)


def _keep(name: str, blob: bytes) -> None:
    (Path(os.environ[SHARDS]) / name).write_bytes(blob)


def _build_name(kernel: Kernel, arch: str) -> str:
    return f"{record_key(kernel, arch)}.{arch}"


def lookup(kernel: Kernel, arch: str, path: Path | None = None) -> nvrtc.CubinResult | None:
    """A recorded build, in the compile cache's payload (nvrtc._pack)."""
    blob = _read(_build_name(kernel, arch), path)
    return None if blob is None else nvrtc._unpack(blob, arch, kernel.name)


@cache
def _nvdisasm_build(tool: Path) -> str:
    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or f"{tool} {tool.stat().st_size}"


def _listing_name(tool: Path, cubin: bytes) -> str:
    h = hashlib.sha256(_nvdisasm_build(tool).encode() + b"\0" + cubin)
    return f"{h.hexdigest()[:32]}.sass.json"


def hooked(compile_: Callable[..., nvrtc.CubinResult]) -> Callable[..., nvrtc.CubinResult]:
    """`nvrtc._compile` served from the record (or, in write mode, compiling and keeping each
    build in $QIR_NVRTC_RECORD_DIR)."""
    mode = os.environ.get(MODE, "")

    def compile_recorded(kernel: Kernel, arch: str, toolkit: Any) -> nvrtc.CubinResult:
        if mode == "write":
            result = compile_(kernel, arch, toolkit)
            _keep(_build_name(kernel, arch), nvrtc._pack(result))
            return result
        return lookup(kernel, arch) or compile_(kernel, arch, toolkit)

    compile_recorded.compile = compile_  # type: ignore[attr-defined]
    return compile_recorded


def hooked_listing(listing: Callable[[Path, bytes], bytes]) -> Callable[[Path, bytes], bytes]:
    """`sass._listing` (nvdisasm's JSON of a cubin) served from the record, or kept."""
    mode = os.environ.get(MODE, "")

    def listing_recorded(tool: Path, cubin: bytes) -> bytes:
        name = _listing_name(tool, cubin)
        if mode == "write":
            out = listing(tool, cubin)
            _keep(name, out)
            return out
        recorded = _read(name, None)
        return recorded if recorded is not None else listing(tool, cubin)

    listing_recorded.listing = listing  # type: ignore[attr-defined]
    return listing_recorded


def install(mp: Any) -> None:
    """Serve the session's NVRTC builds and nvdisasm listings from the record (`mp`: a
    pytest.MonkeyPatch), unless QIR_NVRTC_RECORD=off."""
    if os.environ.get(MODE, "") != "off":
        mp.setattr(nvrtc, "_compile", hooked(nvrtc._compile))
        mp.setattr(sass, "_listing", hooked_listing(sass._listing))


def write(shards: Path, path: Path | None = None) -> int:
    """The record rewritten from a write-mode run's shards; returns the entries it holds."""
    path = path or PATH
    files = sorted(p for p in shards.iterdir() if p.is_file())
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as z:
        for f in files:
            info = zipfile.ZipInfo(f.name, date_time=(2026, 1, 1, 0, 0, 0))  # reproducible
            z.writestr(info, f.read_bytes(), zipfile.ZIP_LZMA)
    tmp.replace(path)
    return len(files)
