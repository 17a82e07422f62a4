"""Where the CUDA headers and compilers are, with no GPU needed."""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import cache
from pathlib import Path


@cache
def cuda_include_dirs() -> tuple[Path, ...]:
    """Include directories that hold cuda_fp16.h & co: $CUDA_HOME, the nvcc on PATH, then the
    nvidia-cuda-runtime / nvidia-cuda-cccl wheels. Empty if none is found."""
    candidates: list[Path] = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in sorted(Path(root).glob("cu*/include")):
                candidates.append(sub)
    except ImportError:
        pass
    for inc in candidates:
        if (inc / "cuda_fp16.h").is_file():
            extra = [inc / "cccl"] if (inc / "cccl").is_dir() else []
            return (inc, *extra)
    return ()


@cache
def toolkit_fingerprint() -> str:
    """sha256 of the CUDA headers kernels include (the low-precision types), for cache keys: a
    toolkit upgrade changes it, a toolkit at another path does not."""
    h = hashlib.sha256()
    for inc in cuda_include_dirs():
        for name in sorted(p.name for p in inc.glob("cuda_[bf]*.h*")):
            h.update(name.encode() + b"\0" + (inc / name).read_bytes() + b"\0")
    return h.hexdigest()
