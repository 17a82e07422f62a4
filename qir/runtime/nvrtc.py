"""Compile-only NVRTC through cuda.core: cubin for any arch, with ptxas' register and spill counts.

Needs neither a GPU nor the driver, so CI can check every kernel for every target arch.
"""

from __future__ import annotations

import io
import json
import re
import struct
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from qir.codegen.kernel import Kernel
from qir.errors import QirError, UsageError
from qir.runtime.cache import CUBIN, KernelCache, key
from qir.runtime.errors import BackendUnavailable, CompileError
from qir.runtime.toolkit import cuda_include_dirs, toolkit_fingerprint

# NVRTC ships no C library headers, yet kernels include <stdint.h> so that g++ (host backend) and
# NVRTC read the same source. The widths match glibc on LP64 (int64_t is long, not long long) so
# overloads resolve the same way on both backends.
_STDINT_SHIM = """\
#pragma once
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef long intptr_t;
typedef unsigned long uintptr_t;
static_assert(sizeof(int64_t) == 8 && sizeof(intptr_t) == sizeof(void*), "expected LP64");
#define INT8_MIN (-128)
#define INT8_MAX 127
#define UINT8_MAX 255
#define INT16_MIN (-32768)
#define INT16_MAX 32767
#define UINT16_MAX 65535
#define INT32_MIN (-2147483647 - 1)
#define INT32_MAX 2147483647
#define UINT32_MAX 4294967295U
#define INT64_MIN (-9223372036854775807L - 1)
#define INT64_MAX 9223372036854775807L
#define UINT64_MAX 18446744073709551615UL
"""

# The archs every kernel must build for without spilling (Ampere, Hopper, datacenter and
# consumer Blackwell); the "a" variants are the ones that enable each arch's own instructions.
GATE_ARCHS = ("sm_80", "sm_90", "sm_100a", "sm_120a")

_FUNCTION = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


@dataclass(frozen=True)
class PtxasReport:
    """What ptxas -v says about one function: nvcc -Xptxas -v prints the same lines."""

    registers: int = 0  # per thread (entry functions only)
    stack_bytes: int = 0  # local memory per thread: spills and arrays indexed at run time
    spill_stores: int = 0  # bytes per thread
    spill_loads: int = 0
    smem_bytes: int = 0  # static shared memory per block
    barriers: int = 0


def ptxas_reports(log: str) -> dict[str, PtxasReport]:
    """Every function ptxas -v reports on, by name, from its log (lines of each function follow
    its 'Compiling entry function' / 'Function properties for' line)."""
    fields: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in log.splitlines():
        if (m := _FUNCTION.search(line)) is not None:
            current = fields.setdefault(m.group(1), {})
        elif current is not None and (m := _FRAME.search(line)) is not None:
            current["stack_bytes"], current["spill_stores"], current["spill_loads"] = (
                int(g) for g in m.groups()
            )
        elif current is not None and (m := _USED.search(line)) is not None:
            current["registers"] = int(m.group(1))
            current["barriers"] = int(m.group(2) or 0)
            current["smem_bytes"] = int(m.group(3) or 0)
    return {name: PtxasReport(**f) for name, f in fields.items()}


@dataclass(frozen=True)
class CubinResult:
    cubin: bytes
    arch: str
    kernel: str  # the entry function
    log: str  # ptxas -v output and any compiler warnings

    @property
    def report(self) -> PtxasReport:
        """ptxas' figures for the entry function."""
        return ptxas_reports(self.log).get(self.kernel, PtxasReport())

    @property
    def registers(self) -> int:
        return self.report.registers

    @property
    def spill_bytes(self) -> int:
        """Spill stores + loads of every function in the module: a device function ptxas did
        not inline spills as part of the kernel that calls it."""
        return sum(r.spill_stores + r.spill_loads for r in ptxas_reports(self.log).values())


class SpillError(QirError, RuntimeError):
    """A kernel spills registers to local memory on some arch: almost always a codegen bug (tile
    too large for the register file) and a large slowdown, so it fails the build."""

    def __init__(self, kernel: str, arch: str, spill_bytes: int, log: str) -> None:
        self.kernel = kernel
        self.arch = arch
        self.spill_bytes = spill_bytes
        super().__init__(
            f"kernel {kernel} spills {spill_bytes} bytes (stores + loads) on {arch}:\n{log}"
        )


@contextmanager
def kernel_include_dir(kernel: Kernel) -> Iterator[Path]:
    """A temporary directory holding `kernel.headers` and the <stdint.h> shim, to put first on
    NVRTC's include path (cuda.core does not expose NVRTC's in-memory headers)."""
    with tempfile.TemporaryDirectory(prefix=f"qir-{kernel.name}-") as tmp:
        root = Path(tmp)
        (root / "stdint.h").write_text(_STDINT_SHIM)
        for name, text in kernel.headers:
            path = (root / name).resolve()
            if not path.is_relative_to(root.resolve()):
                raise ValueError(f"kernel {kernel.name}: header name {name!r} leaves its directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        yield root


# Everything but the include path, which holds a temporary directory (its content is keyed).
_OPTIONS = {"std": "c++17", "ptxas_options": "-v"}
_PAYLOAD_HEAD = struct.Struct("<I")  # length of the JSON metadata that precedes the cubin


def key_parts(kernel: Kernel, arch: str) -> dict[str, str]:
    """What a cubin depends on, besides qir's codegen (see cache.key)."""
    return {
        "source": kernel.source,
        "headers": repr(kernel.headers) + _STDINT_SHIM,
        "options": repr(sorted(_OPTIONS.items())),
        "arch": arch,
        "compiler": f"nvrtc {nvrtc_version()}",
        "toolkit": toolkit_fingerprint(),
    }


def compile_cubin(
    kernel: Kernel, arch: str = "sm_90", cache: KernelCache | None = None
) -> CubinResult:
    """Compile `kernel` to a cubin for `arch` (e.g. "sm_80", "sm_90a") with NVRTC, through the
    compile cache (default: the one at $QIR_CACHE_DIR). The cuda backend loads these same
    entries, so a machine without a GPU can warm a GPU machine's cache."""
    store = cache if cache is not None else KernelCache.at()
    return store.loaded((CUBIN, arch, kernel), lambda: _cached_cubin(store, kernel, arch))


def _cached_cubin(store: KernelCache, kernel: Kernel, arch: str) -> CubinResult:
    toolkit = _toolchain()
    entry = store.fetch(
        CUBIN,
        kernel.name,
        key(key_parts(kernel, arch)),
        f".{arch}.cubin",
        lambda: _pack(_compile(kernel, arch, toolkit)),
        what=f"nvrtc {arch}",
    )
    return _unpack(entry.payload, arch, kernel.name)


def _pack(result: CubinResult) -> bytes:
    meta = {"log": result.log}  # every figure is read back from ptxas' own log
    head = json.dumps(meta).encode()
    return _PAYLOAD_HEAD.pack(len(head)) + head + result.cubin


def _unpack(payload: bytes, arch: str, kernel: str) -> CubinResult:
    (n,) = _PAYLOAD_HEAD.unpack_from(payload)
    meta = json.loads(payload[_PAYLOAD_HEAD.size : _PAYLOAD_HEAD.size + n])
    return CubinResult(payload[_PAYLOAD_HEAD.size + n :], arch, kernel, meta["log"])


def available() -> bool:
    """Whether the cuda.core API this module compiles with is importable: a cuda-core older than
    1.0 installs `cuda.core` but keeps Program in `cuda.core.experimental`."""
    try:
        from cuda.core import Program, ProgramOptions  # noqa: F401
    except ImportError:
        return False
    return True


def _nvrtc_error() -> type[Exception]:
    """cuda.core's exception for NVRTC failures. cuda.core 1.2.2 exports none publicly; if the
    private one moves, any exception from compile() is taken as a compile error."""
    try:
        from cuda.core._utils.cuda_utils import NVRTCError
    except ImportError:
        return Exception
    result: type[Exception] = NVRTCError
    return result


def _toolchain() -> tuple[Path, ...]:
    if not available():
        raise BackendUnavailable(
            "compiling with NVRTC needs cuda-core 1.x: pip install 'qir[compile]'"
        )
    toolkit = cuda_include_dirs()
    if not toolkit:
        raise BackendUnavailable(
            "CUDA headers (cuda_fp16.h) not found: pip install 'qir[compile]' or set CUDA_HOME"
        )
    return toolkit


def _compile(kernel: Kernel, arch: str, toolkit: tuple[Path, ...]) -> CubinResult:
    from cuda.core import Program, ProgramOptions

    with kernel_include_dir(kernel) as inc:
        options = ProgramOptions(
            name=f"{kernel.name}.cu",  # NVRTC prefixes diagnostics with this
            arch=arch,
            include_path=[str(inc), *map(str, toolkit)],
            **_OPTIONS,
        )
        log = io.StringIO()
        try:
            code = Program(kernel.source, "c++", options=options).compile("cubin", logs=log)
        except _nvrtc_error() as e:
            # The program log only reaches us inside the exception text, after this marker.
            message = str(e).partition("compilation log:")[2] or str(e)
            raise CompileError(kernel.name, "nvrtc", message.strip("\x00\n "), kernel.source) from e
    # Printing the ObjectCode would load it as a module, which needs the driver; .code is the blob.
    cubin = bytes(code.code)
    return CubinResult(cubin, arch, kernel.name, log.getvalue().strip("\x00\n "))


def check_no_spills(kernel: Kernel, archs: Sequence[str] = GATE_ARCHS) -> tuple[CubinResult, ...]:
    """Compile `kernel` for each arch; raise SpillError on the first that spills. NVRTC runs the
    same ptxas as nvcc with the same options (only -arch, the include path, -std and -v), so
    these are the figures `nvcc -cubin -Xptxas -v` prints for the dumped .cu
    (tests/runtime/test_nvrtc.py compares them)."""
    results = []
    for arch in archs:
        result = compile_cubin(kernel, arch)
        if result.spill_bytes > 0:
            raise SpillError(kernel.name, arch, result.spill_bytes, result.log)
        results.append(result)
    return tuple(results)


@cache
def supported_archs() -> tuple[str, ...]:
    """The real architectures this NVRTC compiles for, e.g. ("sm_75", ..., "sm_120")."""
    _toolchain()
    from cuda.bindings import nvrtc

    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return tuple(f"sm_{a}" for a in archs)


def check_arch(arch: str) -> str:
    """`arch` if NVRTC builds cubins for it, else a UsageError listing the archs it can. The
    arch-specific ("sm_90a") and family ("sm_100f") variants exist for some archs only, so the
    answer comes from NVRTC itself: an empty program compiled for `arch`."""
    if re.fullmatch(r"sm_\d+[af]?", arch) is None or not _accepts(arch):
        raise UsageError(
            f"arch {arch!r}: NVRTC {nvrtc_version()} compiles for {', '.join(supported_archs())}"
            " (and, for some, their a or f variants, e.g. sm_90a)"
        )
    return arch


@cache
def _accepts(arch: str) -> bool:
    _toolchain()
    from cuda.bindings import nvrtc

    with _empty_program() as prog:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [f"-arch={arch}".encode()])
        return bool(err == nvrtc.nvrtcResult.NVRTC_SUCCESS)


@contextmanager
def _empty_program() -> Iterator[object]:
    """An empty NVRTC program, for probing NVRTC itself. Through cuda.bindings, not cuda.core:
    cuda.core's PTX path asks the driver whether it can load the result."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(b"", b"probe.cu", 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        yield prog
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@cache
def nvrtc_version() -> str:
    """The NVRTC build, e.g. "13.0.88 CL-36424714": patch releases change codegen, so cache keys
    need more than nvrtcVersion()'s major.minor. Read from the banner NVRTC writes into PTX."""
    from cuda.bindings import nvrtc

    with _empty_program() as prog:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"-arch=compute_80"])
        _check(err, "nvrtcCompileProgram")
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = b" " * size
        (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
        _check(err, "nvrtcGetPTX")
    banner = ptx.decode(errors="replace")
    release = re.search(r"release [\d.]+, V([\d.]+)", banner)
    build = re.search(r"Build ID: (\S+)", banner)
    if release is None:
        err, major, minor = nvrtc.nvrtcVersion()
        _check(err, "nvrtcVersion")
        return f"{major}.{minor}"
    return f"{release.group(1)} {build.group(1)}" if build else release.group(1)


def _check(err: object, call: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{call} failed: {err}")
