"""Rewrite tests/data/ptxas_record.json: build every compile-gate kernel for every arch with
NVRTC and record ptxas' registers and spill bytes under each kernel's key
(tests/ptxas_record.py). Kernels the record already holds are kept (their key is their text and
compiler), the others are built through the kernel cache (after `make gate`, from it).

    python scripts/ptxas_record.py [--jobs N] [--fresh]

Run it after changing a template or a lowering, with the change: the gate then builds nothing
that the record holds. A kernel that spills is reported and the record is not written."""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Row = tuple[str, str, int, int]


def _entry_rows(entry_id: str, arch: str, fresh: bool) -> tuple[dict[str, Row], list[str]]:
    from qir.runtime.nvrtc import SpillError
    from tests import ptxas_record
    from tests.runtime.test_compile_gate import _kernels

    rows: dict[str, Row] = {}
    spills: list[str] = []
    for kernel in _kernels(entry_id, arch):
        recorded = None if fresh else ptxas_record.lookup(kernel, arch)
        try:
            got = recorded or ptxas_record.build(kernel, arch)
        except SpillError as e:
            spills.append(f"{kernel.name} on {arch}: {e.spill_bytes} bytes")
            continue
        rows[ptxas_record.record_key(kernel, arch)] = (
            kernel.name,
            arch,
            got.registers,
            got.spill_bytes,
        )
    return rows, spills


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--fresh", action="store_true", help="build every kernel, even those the record holds"
    )
    args = parser.parse_args()
    from tests import ptxas_record
    from tests.runtime.test_compile_gate import gate_matrix

    todo = [(e.id, a) for e, a in gate_matrix("all")]
    rows: dict[str, Row] = {}
    spills: list[str] = []
    start = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_entry_rows, *job, args.fresh) for job in todo]
        for done, future in enumerate(as_completed(futures), 1):
            got, bad = future.result()
            rows.update(got)
            spills += bad
            print(
                f"\rptxas record: {done}/{len(todo)} entries, {len(rows)} kernels, "
                f"{time.monotonic() - start:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    print(file=sys.stderr)
    if spills:
        print("spills, record not written:\n  " + "\n  ".join(spills), file=sys.stderr)
        return 1
    ptxas_record.write(rows)
    print(f"wrote {len(rows)} kernels to {ptxas_record.PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
