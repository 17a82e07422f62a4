"""Rewrite tests/data/nvrtc_record.zip: run the test suite with every NVRTC compile and
nvdisasm listing made for real and kept (QIR_NVRTC_RECORD=write), then record exactly those
under their keys (tests/nvrtc_record.py).

    python scripts/nvrtc_record.py [pytest arguments, default: the whole suite on all cores]

Run it (`make nvrtc-record`) after changing a template, a lowering or qir's CUDA headers, with
the change: the suite then runs neither tool on what the record holds. A stale record
costs time, never a result (a changed text is a miss)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    from tests import nvrtc_record

    with tempfile.TemporaryDirectory(prefix="qir-nvrtc-record-") as shards:
        env = {**os.environ, nvrtc_record.MODE: "write", nvrtc_record.SHARDS: shards}
        args = argv or ["-q", "-n", "auto", "--dist", "worksteal"]
        run = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env)
        if run.returncode != 0:
            print("the suite failed: record not written", file=sys.stderr)
            return run.returncode
        n = nvrtc_record.write(Path(shards))
    size = nvrtc_record.PATH.stat().st_size
    print(f"wrote {n} NVRTC builds and listings to {nvrtc_record.PATH} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
