"""The checkpoint directory as a boundary: every file qir reads from a checkpoint (config.json,
hf_quant_config.json, the safetensors index and the shards it names) is a regular file inside
the directory, reached by a name that stays inside it.

A name (as an index spells a shard) is a relative POSIX path: not empty, no NUL or backslash, not
absolute, no empty, "." or ".." component. Where it resolves, symlinks followed, must be inside
the directory too, with one exception: the Hugging Face hub cache, whose snapshot folders
(`models--org--name/snapshots/<revision>/`) hold symlinks into the repository's own
`models--org--name/blobs/`, may resolve there.
"""

from __future__ import annotations

import stat
from pathlib import Path, PurePosixPath

from qir.errors import FormatError


def check_name(name: str, what: str) -> None:
    """Refuses a file name (from a checkpoint's own metadata) that could leave the directory;
    `what` says where the name comes from."""
    parts = name.split("/")
    if not name or "\0" in name or "\\" in name or PurePosixPath(name).is_absolute():
        raise FormatError(f"{what}: {name!r} is not a relative file name inside the checkpoint")
    bad = next((p for p in parts if p in ("", ".", "..")), None)
    if bad is not None:
        part = f"a {bad!r}" if bad else "an empty"
        raise FormatError(f"{what}: {name!r} has {part} path component")


def _bases(root: Path) -> list[Path]:
    real = root.resolve()
    bases = [real]
    if real.parent.name == "snapshots":  # the Hugging Face hub cache layout
        bases.append(real.parent.parent / "blobs")
    return bases


def find(root: Path, name: str, what: str) -> Path | None:
    """`root/name` if it is a regular file inside the checkpoint directory `root` (see the module
    doc), None if there is no such file; anything else there is refused."""
    check_name(name, what)
    path = root / name
    try:
        real = path.resolve()
        bases = _bases(root)
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise FormatError(f"{path}: cannot resolve ({e})") from None
    if not any(real.is_relative_to(base) for base in bases):
        raise FormatError(f"{path}: resolves to {real}, outside the checkpoint directory {root}")
    try:
        mode = real.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise FormatError(f"{path}: cannot stat ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise FormatError(f"{path}: not a regular file")
    return path


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror})") from None
