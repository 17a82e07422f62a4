"""A precompiled qir_host.h for the host backend's g++ builds.

Every host kernel includes qir_host.h, which pulls in the CUDA fp16/bf16/fp8 headers and half of
the C++ standard library: parsing it is about 2 s of each compile, more than most kernels' own
code. g++ reads `<header>.gch` instead of `<header>` when the `.gch` sits beside the included path
and was built with the same code-generation flags and macros, so the precompiled header lives
in its own cache namespace as a copy of the header next to its `.gch`, in a directory named by a
hash of everything it depends on. It changes no compiled code (g++ refuses a `.gch` whose flags
differ and silently parses the header instead), so kernels' cache keys do not include it, and
any failure to build or store it just means compiling without it.

Directories are built under a temp name and renamed into place: two processes may both build one,
and the loser's copy is dropped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from qir.runtime.cache import PCH, KernelCache

log = logging.getLogger("qir.runtime")


class PrecompiledHeader:
    """The header path to `-include` for one cache root: the precompiled copy when it can be
    built, else the original."""

    def __init__(
        self,
        cache: KernelCache,
        header: Path,
        parts: Sequence[Path],
        cxx: str,
        include_dirs: Callable[[], Sequence[Path]],
        fingerprint: Callable[[], str],
    ) -> None:
        self.cache, self.source, self.parts, self.cxx = cache, header, parts, cxx
        self.include_dirs, self.fingerprint = include_dirs, fingerprint
        self._built: dict[str, Path] = {}
        self._lock = threading.Lock()

    def header(self, flags: Sequence[str]) -> Path:
        """Where g++ should `-include` the header when compiling with `flags` (code-generation
        flags and -D macros: what the `.gch` must match)."""
        if self.cache.degraded:
            return self.source
        text = self.source.read_bytes()
        parts = {p.name: p.read_bytes() for p in self.parts}
        digest = hashlib.sha256(
            b"\0".join(
                [text, *parts.values(), repr(list(flags)).encode(), self.fingerprint().encode()]
            )
        ).hexdigest()[:32]
        with self._lock:  # kernels compile on several threads; build each header once
            built = self._built.get(digest)
            # Rebuilt when `qir cache clear` removed it under a running process.
            if built is None or not built.is_file():
                self._built[digest] = self._build(digest, text, parts, flags)
            return self._built[digest]

    def discard(self) -> None:
        """Forget and delete what this process built or found: a `.gch` that g++ rejected
        outright (damaged on disk) is rebuilt by the next compile."""
        with self._lock:
            for path in self._built.values():
                if path != self.source:
                    log.warning("precompiled header %s was unusable: rebuilding it", path.parent)
                    shutil.rmtree(path.parent, ignore_errors=True)
            self._built.clear()

    def _build(
        self, digest: str, text: bytes, parts: Mapping[str, bytes], flags: Sequence[str]
    ) -> Path:
        final = self.cache.root / PCH / digest
        header = final / self.source.name
        if (final / f"{self.source.name}.gch").is_file():
            return header
        includes = [f"-I{d}" for d in self.include_dirs()]
        # Given -shared, or an `-x c++` before `-x c++-header`, g++ 12 links the header into an
        # executable or library instead of precompiling it.
        codegen = [
            f
            for i, f in enumerate(flags)
            if f not in ("-shared", "-x") and (i == 0 or flags[i - 1] != "-x")
        ]
        try:
            (self.cache.root / PCH).mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=self.cache.root / PCH, prefix=f".{digest}."))
        except OSError as e:
            log.debug("no precompiled header (%s): compiling without one", e)
            return self.source
        try:
            (tmp / self.source.name).write_bytes(text)
            # The copy includes its parts from beside it, as the original does.
            for name, data in parts.items():
                (tmp / name).write_bytes(data)
            cmd = [self.cxx, *codegen, *includes, "-x", "c++-header", str(tmp / self.source.name)]
            proc = subprocess.run(
                [*cmd, "-o", str(tmp / f"{self.source.name}.gch")], capture_output=True, text=True
            )
            if proc.returncode == 0:
                # g++ silently parses the header when a .gch does not fit: make it say so.
                probe = tmp / "probe.cc"
                probe.write_text("int qir_pch_probe;\n")
                strict = [
                    "-Winvalid-pch",
                    "-Werror=invalid-pch",
                    "-include",
                    str(tmp / self.source.name),
                ]
                proc = subprocess.run(
                    [self.cxx, *flags, *includes, *strict, "-c", str(probe), "-o", os.devnull],
                    capture_output=True,
                    text=True,
                )
                probe.unlink()
            if proc.returncode != 0:
                log.debug("no precompiled header: %s", proc.stderr.strip()[-2000:])
                return self.source
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / f"{self.source.name}.gch").is_file():
                    return self.source
            return header
        except OSError as e:
            log.debug("no precompiled header (%s): compiling without one", e)
            return self.source
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
