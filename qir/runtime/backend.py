"""Picking a backend by name, and the target a plan for it is lowered for. The interface a
backend implements is qir.runtime.backend_api's, which imports none of them; this module is the
one above the backends."""

from __future__ import annotations

from qir.errors import UsageError
from qir.runtime.backend_api import Backend, BoundLaunch, InStream
from qir.target import DEFAULT, Target

__all__ = [
    "BACKENDS",
    "Backend",
    "BoundLaunch",
    "InStream",
    "best_backend",
    "default_target",
    "get_backend",
    "resolve_target",
]

BACKENDS = ("reference", "host", "cuda")


def get_backend(name: str) -> Backend:
    """A kernel backend: 'host' (CPU) or 'cuda' (CuPy). 'reference' needs no backend."""
    # each backend is imported when picked: a run on one never loads the other's toolchain
    if name == "host":
        from qir.runtime.host import HostBackend

        return HostBackend()
    if name == "cuda":
        from qir.runtime.cuda import CudaBackend

        return CudaBackend()
    raise UsageError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def best_backend() -> str:
    from qir.runtime.cuda import available

    return "cuda" if available() else "host"


def default_target() -> Target:
    """The target when none is named: this machine's GPU, else qir.target.DEFAULT."""
    from qir.runtime.cuda import device_target

    return device_target() or DEFAULT


def resolve_target(target: str | Target | None, backend: Backend | None) -> Target:
    """The target a plan for `backend` is lowered for: a GPU backend's own (naming another is an
    error: its kernels may not run there), else `target`, else default_target()."""
    named = Target(target) if isinstance(target, str) else target
    own = backend.target if backend is not None else None
    if backend is not None and own is not None:
        if named is not None and named != own:
            raise UsageError(
                f"target {named.arch}: the {backend.name} backend runs on {own.arch} (its GPU); "
                "other targets run on --backend host"
            )
        return own
    return named or default_target()
