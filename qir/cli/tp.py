"""`--tp N` for the commands that run a model: the command runs again under `mpiexec -n N`, one
process per rank, each building its rank's part (qir.passes.tensor_parallel) with an MPI
communicator (qir.runtime.collectives.MpiComm); rank 0 prints and writes, the others are quiet.
A rank that waits past --tp-timeout seconds in a collective (a peer died or hangs) exits with a
message, and mpiexec ends the rest."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from qir.collectives import DEFAULT_TIMEOUT
from qir.errors import UsageError
from qir.logs import LOGGER

# Set in the ranks' environment by the launching process: how many ranks it launched.
RANKS_ENV = "QIR_TP_RANKS"
# Set to "1" where the launching process's stdin is a terminal (mpiexec pipes it to rank 0).
TTY_ENV = "QIR_TP_TTY"
INSTALL = "pip install 'qir[tp]' (mpi4py and the mpich wheel)"


def add_tp(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor parallel")
    g.add_argument(
        "--tp", type=int, default=1, metavar="N", help="split the model across N ranks (MPI)"
    )
    g.add_argument(
        "--tp-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds a rank waits for the others in a collective (default {DEFAULT_TIMEOUT:g})",
    )


def _in_mpi_job() -> bool:
    """Whether this process is a rank: launched by `launch`, or by the user's own mpiexec."""
    return any(os.environ.get(v) for v in (RANKS_ENV, "PMI_RANK", "OMPI_COMM_WORLD_RANK"))


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise UsageError(f"--tp needs mpiexec: {INSTALL}")
    return found


def launch(args: argparse.Namespace) -> int | None:
    """In the process a user started with --tp N > 1: this command under mpiexec with N ranks,
    its exit status returned. None where there is nothing to launch (--tp 1, or in a rank)."""
    n = args.tp
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"--tp must be a positive int, got {n!r}")
    if not args.tp_timeout > 0:
        raise UsageError(f"--tp-timeout must be positive, got {args.tp_timeout}")
    if n == 1 or _in_mpi_job():
        return None
    try:
        import mpi4py  # noqa: F401  (the ranks need it; say so before launching them)
    except ImportError:
        raise UsageError(f"--tp {n} needs mpi4py: {INSTALL}") from None
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", "qir.cli", *sys.argv[1:]]
    tty = "1" if sys.stdin is not None and sys.stdin.isatty() else "0"
    job = subprocess.Popen(cmd, env={**os.environ, RANKS_ENV: str(n), TTY_ENV: tty})

    def forward(signum: int, frame: Any) -> None:  # Ctrl-C / SIGTERM reach the ranks
        job.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return job.wait()
            except InterruptedError:
                continue
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def comm_of(args: argparse.Namespace, backend: str) -> Any:
    """This rank's communicator under a --tp launch (ranks other than 0 then print nothing),
    else None: MPI on host buffers, or on the cuda backend NCCL on the rank's GPU (untested on
    a device)."""
    if args.tp == 1 or not _in_mpi_job():
        return None
    from qir.runtime.collectives import MpiComm, device_comm

    comm = MpiComm(timeout=args.tp_timeout)
    if comm.size != args.tp:
        raise UsageError(f"--tp {args.tp}, but mpiexec started {comm.size} ranks")
    if comm.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's life)
        logging.getLogger(LOGGER).setLevel(logging.WARNING)
    return device_comm(comm) if backend == "cuda" else comm


def error_prefix() -> str:
    """ "rank r: " in a rank of a --tp launch (each rank reports its own errors), else ""."""
    if not os.environ.get(RANKS_ENV):
        return ""
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    return f"rank {rank}: " if rank is not None else ""
