"""Build a virtualenv that holds only the Python packages of the lent GPU machine's image, so that
what a lease runs is tried here first (`make image-check`: the GPU tests collect and
scripts/gpu_check.sh --dry-run runs every stage in it).

    .venv/bin/python scripts/device_image.py .venv-image

The packages are the ones installed in the environment that runs this script (make's .venv, with
qir[test]): each distribution named in scripts/device_image.txt, and the few below that stand in
for what the image has in another form, is linked into DEST's site-packages. Everything else
(openai, fastapi, pydantic, uvicorn, pydot, mlx, the mpich wheel, ruff, ...) is left out, even
where a newer version of an image package here requires it (typer requires pydantic here, not
there): a requirement the image does not meet would hide an import that fails there. qir itself is not installed: gpu_check.sh runs it from the
checkout (PYTHONPATH=.), as on the device. Linking takes well under a second and needs no
package index.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import sysconfig
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The image has the CUDA toolkit outside pip: nvcc with its headers (CCCL included) and
# nvdisasm. Here their wheels stand in for them (the host backend compiles against the headers).
TOOLKIT = ("nvidia-cuda-cccl", "nvidia-cuda-nvdisasm")
# huggingface_hub 2.x (here, for transformers >= 5.24) fetches through httpx2; the image's 1.x
# uses httpx, which it has. transformers imports it even for a local tokenizer.
SKEW = ("httpx2", "httpcore2", "truststore")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = HERE / "device_image.txt") -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonical(line) for line in lines if line}


def installed(site: Path) -> dict[str, md.Distribution]:
    """The distributions installed in `site`, by canonical name."""
    return {
        canonical(d.metadata["Name"]): d
        for d in md.distributions(path=[str(site)])
        if d.metadata["Name"]
    }


def owners(dists: dict[str, md.Distribution]) -> dict[tuple[str, ...], set[str]]:
    """Every path (and each folder above it) in site-packages -> the distributions with files
    there. Folders shared by several (nvidia/, cuda/) are where included and left-out ones meet."""
    own: dict[tuple[str, ...], set[str]] = {}
    for name, d in dists.items():
        for f in d.files or ():
            parts = Path(f).parts
            if ".." in parts:  # scripts in bin/: run modules with python -m instead
                continue
            for i in range(1, len(parts) + 1):
                own.setdefault(parts[:i], set()).add(name)
    return own


def link(site: Path, dest: Path, keep: set[str], own: dict[tuple[str, ...], set[str]]) -> int:
    """Symlink into `dest` the largest paths whose files all belong to `keep`; a folder that is
    partly kept is made and entered. Returns the number of links."""
    children: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
    for path in own:
        children.setdefault(path[:-1], []).append(path)
    count = 0
    work = list(children.get((), []))
    while work:
        path = work.pop()
        who = own[path]
        if not who & keep:
            continue
        target = dest.joinpath(*path)
        if who <= keep:
            if (site.joinpath(*path)).exists():
                target.symlink_to(site.joinpath(*path))
                count += 1
        else:
            target.mkdir()
            work.extend(children.get(path, []))
    return count


def build(dest: Path) -> list[str]:
    """Make the virtualenv at `dest` (replacing one there); returns 'name version' per package."""
    site = Path(sysconfig.get_paths()["purelib"])
    dists = installed(site)
    keep = (image_packages() | set(TOOLKIT) | set(SKEW)) & set(dists)
    venv.EnvBuilder(clear=True, symlinks=True, with_pip=False).create(dest)
    cfg = sysconfig.get_paths(vars={"base": str(dest), "platbase": str(dest)})
    link(site, Path(cfg["purelib"]), keep, owners(dists))
    listing = sorted(f"{dists[n].metadata['Name']} {dists[n].version}" for n in keep)
    (dest / "image-packages.txt").write_text("\n".join(listing) + "\n")
    return listing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="the virtualenv to (re)create, e.g. .venv-image")
    args = ap.parse_args(argv)
    if sys.prefix == sys.base_prefix:
        ap.error("run this with the python of the virtualenv that holds qir[test] (.venv)")
    listing = build(args.dest)
    left = sorted(
        set(installed(Path(sysconfig.get_paths()["purelib"])))
        - {canonical(line.split()[0]) for line in listing}
    )
    print(f"{args.dest}: {len(listing)} packages of the device image; left out: {', '.join(left)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
