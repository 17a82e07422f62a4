"""The compile cache every backend shares: in-process (kernel spec -> loaded module) and on disk.

Disk layout: `<root>/<namespace>/<kernel>-<key>.<ext>`, root = `$QIR_CACHE_DIR`, else
`$XDG_CACHE_HOME/qir`, else `~/.cache/qir` (never inside the package, which may be read-only).
The key hashes everything an artifact depends on (`key`). An entry is the payload followed by a
trailer (magic, payload length, sha256 of the payload); a missing trailer or a wrong checksum (a
truncated write, a full disk, a hand edit) reads as a miss, and the entry is compiled and
rewritten. The trailer sits at the end, not the start, so a host shared object is dlopen-able
straight from its entry: ELF loaders map what the program headers name and never look past it.

Writes go to a temp file in the entry's directory, then `os.replace`: readers see the old entry
or the new one, never half of one. A per-entry `flock` keeps N processes from compiling one kernel
N times; the kernel drops the lock when its holder exits or is killed, so a crashed compile leaves
no stale lock, and a holder that hangs past `lock_timeout` is ignored (we compile anyway, and the
atomic rename makes two writers safe). A root we cannot write (read-only, full, not a directory)
degrades to a process-private temp directory, with one warning.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, TypeVar

log = logging.getLogger("qir.runtime")

# Bump when the layout of any payload (not the trailer) changes: old entries become misses.
PAYLOAD_VERSION = 1
HOST = "host"  # g++ shared objects (or sanitizer executables)
CUBIN = "cubin"  # NVRTC cubins with ptxas' register / spill counts
PCH = "host-pch"  # qir_host.h precompiled by g++ (host_pch.py): one directory per flag set
NAMESPACES = (HOST, CUBIN, PCH)

_MAGIC = b"QIRCACHE"
_TRAILER = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)
_CODEGEN = Path(__file__).parent.parent / "codegen"

T = TypeVar("T")


def default_root() -> Path:
    env = os.environ.get("QIR_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return ((Path(xdg) if xdg else Path.home() / ".cache") / "qir").expanduser().absolute()


@cache
def codegen_hash() -> str:
    """sha256 over qir/codegen (Python sources and templates): a codegen change that renders the
    same source still changes the key, as in Triton's cache (its own sources are in the key)."""
    h = hashlib.sha256()
    for p in sorted(_CODEGEN.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(p.relative_to(_CODEGEN).as_posix().encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def key(parts: Mapping[str, str]) -> str:
    """The disk key of an artifact built from `parts` (source, options, arch, compiler version,
    ...), qir's codegen hash and the payload version."""
    h = hashlib.sha256()
    full = {**parts, "codegen": codegen_hash(), "payload": str(PAYLOAD_VERSION)}
    for name in sorted(full):
        h.update(f"{name}\0{full[name]}\0".encode())
    return h.hexdigest()


def read_entry(path: Path) -> bytes | None:
    """The payload of a disk entry, or None when it is missing, truncated or corrupt."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _TRAILER.size:
        return None
    magic, length, digest = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    payload = data[: -_TRAILER.size]
    if magic != _MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def _write_atomic(path: Path, payload: bytes, executable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.write(_TRAILER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest()))
        # mkstemp makes 0600 files; a cache shared by a team needs them readable.
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Artifact:
    path: Path  # the entry (payload + trailer); under the fallback directory when degraded
    payload: bytes


class KernelCache:
    """One cache root. `at` hands out one instance per root per process, so every backend of a
    process shares the in-process level."""

    _instances: ClassVar[dict[Path, KernelCache]] = {}
    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, root: Path, lock_timeout: float = 300.0) -> None:
        self.root = Path(root)
        self.lock_timeout = lock_timeout
        self.compiles = 0  # compiles done by this process (tests and benchmarks read it)
        self._memory: dict[Hashable, Any] = {}
        # One lock per spec being loaded: a block's kernels compile on several threads at
        # once (see loading.load_kernels), and two threads asking for one spec compile it once.
        self._pending: dict[Hashable, threading.Lock] = {}
        self._mutex = threading.RLock()
        self._fallback: Path | None = None

    @classmethod
    def at(cls, root: Path | None = None) -> KernelCache:
        path = Path(root if root is not None else default_root()).expanduser().absolute()
        with cls._instances_lock:
            if path not in cls._instances:
                cls._instances[path] = cls(path)
            return cls._instances[path]

    @property
    def degraded(self) -> bool:
        return self._fallback is not None

    def loaded(self, spec: Hashable, load: Callable[[], T]) -> T:
        """The in-process level: `load()` once per `spec` (a frozen Kernel plus whatever picks
        the module: backend, device, mode). Hits cost one dict lookup, no hashing of sources."""
        try:
            hit: T = self._memory[spec]
            return hit
        except KeyError:
            pass
        with self._mutex:
            lock = self._pending.setdefault(spec, threading.Lock())
        with lock:
            if spec not in self._memory:
                self._memory[spec] = load()
                # Only a success retires the lock: after a failure, a retry and a newcomer
                # still queue on the same one.
                with self._mutex:
                    self._pending.pop(spec, None)
            value: T = self._memory[spec]
            return value

    def holds(self, spec: Hashable) -> bool:
        """Whether the in-process level has `spec` (nothing is loaded)."""
        return spec in self._memory

    def forget(self) -> None:
        """Drop the in-process level (the disk level stays): the next load reads the disk."""
        with self._mutex:
            self._memory.clear()

    def fetch(
        self,
        namespace: str,
        name: str,
        key: str,
        ext: str,
        build: Callable[[], bytes],
        what: str,
        executable: bool = False,
        counted: bool = True,
    ) -> Artifact:
        """The disk level: the entry for `key`, built by `build()` on a miss. `what` names the
        compiler in the log lines ("host g++", "nvrtc sm_90"); `counted`: the build is a
        kernel's (`compiles`, which the compile summaries report)."""
        path = self._path(namespace, name, key, ext)
        payload = read_entry(path)
        if payload is not None:
            return Artifact(path, payload)
        with self._lock(path):
            # Another process may have compiled it while we waited for the lock.
            payload = read_entry(path)
            if payload is not None:
                return Artifact(path, payload)
            if self._fallback is not None:
                payload = read_entry(self._fallback / namespace / path.name)
                if payload is not None:
                    return Artifact(self._fallback / namespace / path.name, payload)
            return self._build(namespace, path, name, build, what, executable, counted)

    def _build(
        self,
        namespace: str,
        path: Path,
        name: str,
        build: Callable[[], bytes],
        what: str,
        executable: bool,
        counted: bool,
    ) -> Artifact:
        """`build()` stored at `path`, whose lock the caller holds."""
        # Debug: a block's batch of compiles is one info line (loading.load_kernels).
        # Uncounted builds (the host's runtime library) say "building": not a kernel.
        verb = ("compiling", "compiled") if counted else ("building", "built")
        log.debug("%s %s (%s) ...", verb[0], name, what)
        t0 = time.perf_counter()
        payload = build()
        with self._mutex:  # builds run on several threads
            self.compiles += counted
        log.debug("%s %s (%s) in %.2f s", verb[1], name, what, time.perf_counter() - t0)
        return Artifact(self._store(namespace, path, payload, executable), payload)

    @contextmanager
    def claim(
        self, namespace: str, entries: Sequence[tuple[str, str, str]]
    ) -> Iterator[list[Artifact | None]]:
        """The disk entries (name, key, ext) locked together, for a build that makes several at
        once (a host unit): yields each one's sound entry, or None where it is the caller's to
        build (`build_claimed`) while the claim lasts (`fetch` of a claimed entry would wait on its
        own lock). Two processes or threads that want overlapping entries (the ranks of a
        tensor-parallel model on one machine, whose shards often share shapes) so build each
        once; the locks are taken in path order, so claims never wait on each other in a
        cycle."""
        paths = sorted({self._path(namespace, *e) for e in entries})
        with ExitStack() as held:
            for path in paths:
                held.enter_context(self._lock(path))
            yield [self.peek(namespace, *e) for e in entries]

    def build_claimed(
        self,
        namespace: str,
        entry: tuple[str, str, str],
        build: Callable[[], bytes],
        what: str,
        executable: bool = False,
    ) -> Artifact:
        """A claimed entry (name, key, ext; see `claim`) built by `build()` and stored, as
        `fetch` builds a missing one."""
        path = self._path(namespace, *entry)
        return self._build(namespace, path, entry[0], build, what, executable, True)

    def peek(self, namespace: str, name: str, key: str, ext: str) -> Artifact | None:
        """The disk entry for `key` if there is a sound one (here or in the fallback directory),
        without waiting for a lock or building anything."""
        path = self._path(namespace, name, key, ext)
        fallback = [] if self._fallback is None else [self._fallback / namespace / path.name]
        for entry in (path, *fallback):
            payload = read_entry(entry)
            if payload is not None:
                return Artifact(entry, payload)
        return None

    def _path(self, namespace: str, name: str, key: str, ext: str) -> Path:
        return self.root / namespace / f"{name}-{key[:32]}{ext}"

    def _store(self, namespace: str, path: Path, payload: bytes, executable: bool) -> Path:
        if self._fallback is None:
            try:
                _write_atomic(path, payload, executable)
                return path
            except OSError as e:
                self._degrade(e)
        assert self._fallback is not None
        private = self._fallback / namespace / path.name
        _write_atomic(private, payload, executable)
        return private

    def _degrade(self, err: OSError) -> None:
        with self._mutex:
            if self._fallback is not None:
                return
            self._fallback = Path(tempfile.mkdtemp(prefix="qir-cache-"))
            atexit.register(shutil.rmtree, self._fallback, ignore_errors=True)
        reason = err.strerror or errno.errorcode.get(err.errno or 0, str(err))
        log.warning(
            "cache directory %s is not writable (%s): compiled kernels are kept for this "
            "process only",
            self.root,
            reason,
        )

    @contextmanager
    def _lock(self, path: Path) -> Iterator[None]:
        fd = -1
        if self._fallback is None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                self._degrade(e)  # nobody else can write here either: nothing to lock
        try:
            if fd >= 0:
                self._acquire(fd, path)
            yield
        finally:
            if fd >= 0:
                os.close(fd)  # releases the flock

    def _acquire(self, fd: int, path: Path) -> None:
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning(
                        "%s: locked by another process for over %.0f s; compiling anyway",
                        path.name,
                        self.lock_timeout,
                    )
                    return
                time.sleep(0.02)
            except OSError as e:  # a filesystem without flock: the atomic rename still holds
                log.warning("%s: cannot lock (%s); compiling without a lock", path.name, e)
                return


@dataclass(frozen=True)
class NamespaceInfo:
    name: str
    entries: int
    bytes: int


def info(root: Path | None = None) -> list[NamespaceInfo]:
    """Entries and bytes per namespace under `root` (default: the configured root)."""
    base = Path(root) if root is not None else default_root()
    out = []
    for ns in NAMESPACES:
        files = [p for p in (base / ns).rglob("*") if p.is_file()] if (base / ns).is_dir() else []
        # Not entries: temp files, locks, and the header copies beside precompiled headers.
        entries = [
            p for p in files if not p.name.startswith(".") and p.suffix not in (".lock", ".h")
        ]
        out.append(NamespaceInfo(ns, len(entries), sum(p.stat().st_size for p in files)))
    return out


def clear(root: Path | None = None) -> int:
    """Delete qir's namespaces under `root` (nothing else: the root may be shared); returns how
    many entries were removed."""
    base = Path(root) if root is not None else default_root()
    removed = sum(ns.entries for ns in info(base))
    for ns in NAMESPACES:
        shutil.rmtree(base / ns, ignore_errors=True)
    return removed
