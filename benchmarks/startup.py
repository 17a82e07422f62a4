"""How long `import qir` and `qir --help` take beyond a bare interpreter's start: the median of
several runs of each, each a fresh process, reported as the difference from `python -c pass`.
Issue 34's bar is 0.3 s for each.

    python benchmarks/startup.py [--repeat 9] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BAR_S = 0.3
# Each timed command: a fresh interpreter run in the repository root (so `-c` imports this
# checkout's qir). `qir --help` is what the console script runs (see pyproject's scripts).
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "import qir": ["-c", "import qir"],
    "qir --help": ["-c", "import sys; from qir.cli import main; sys.exit(main())", "--help"],
}


def seconds(args: list[str]) -> float:
    """One run's wall time: a fresh `python ARGS`, from its start to its exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9, help="runs of each command (median)")
    ap.add_argument("--json", type=Path, help="write the medians and differences here")
    args = ap.parse_args(argv)
    for cmd in COMMANDS.values():  # warm the file cache and .pyc files first
        seconds(cmd)
    # interleaved rounds, so a burst of load on the machine touches every command alike
    runs: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeat):
        for name, cmd in COMMANDS.items():
            runs[name].append(seconds(cmd))
    medians = {name: statistics.median(t) for name, t in runs.items()}
    base = medians["python -c pass"]
    print(f"python -c pass  {base * 1e3:7.1f} ms (median of {args.repeat})")
    result = {"python -c pass": base}
    for name in list(COMMANDS)[1:]:
        extra = medians[name] - base
        result[name] = extra
        mark = "ok" if extra <= BAR_S else f"over the {BAR_S:g} s bar"
        print(f"{name:14}  {medians[name] * 1e3:7.1f} ms  +{extra * 1e3:6.1f} ms  {mark}")
    if args.json:
        args.json.write_text(json.dumps({"repeat": args.repeat, "seconds": result}, indent=1))
    return result


if __name__ == "__main__":
    main()
