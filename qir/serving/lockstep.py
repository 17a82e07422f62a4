"""Serving on tensor-parallel ranks: rank 0 runs the engine (HTTP, scheduler, sampling rows);
every run, capture and replay of its model is first broadcast to the other ranks, which repeat
it (`follow`), so every rank launches the same kernels and collectives in the same order. The
broadcast carries the step's small inputs (ids, positions, block tables, sampling rows), not
activations. A follower waits for the next step as long as the server idles; a rank that dies
ends the job (mpiexec), a collective that waits past its timeout aborts it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Leader:
    """Rank 0's Compiled: what it runs, the followers run too."""

    lockstep = True  # the followers take every input from it (Model broadcasts no seed then)

    def __init__(self, compiled: Any, comm: Any) -> None:
        self.compiled = compiled
        self.comm = comm

    def __getattr__(self, name: str) -> Any:  # backend, graph, plan, prepare, ...
        return getattr(self.compiled, name)

    def __call__(
        self, inputs: Mapping[str, Any], stream: Any = None, rows: str | None = None
    ) -> dict[str, Any]:
        self.comm.bcast(("run", dict(inputs), rows))
        result: dict[str, Any] = self.compiled(inputs, stream, rows)
        return result

    def capture(self, m: int, stream: Any = None, rows: str | None = None) -> Any:
        self.comm.bcast(("capture", m, rows))
        return _Replay(self, m, rows, self.compiled.capture(m, stream, rows))

    def copy_state_rows(self, src: int, dst: int, n: int) -> None:
        self.comm.bcast(("copy", src, dst, n))
        self.compiled.copy_state_rows(src, dst, n)

    def stop(self) -> None:
        """Ends the followers' loops."""
        self.comm.bcast(("stop",))


class _Replay:
    def __init__(self, leader: Leader, m: int, rows: str | None, captured: Any) -> None:
        self.leader, self.key, self.captured = leader, (m, rows), captured

    def __call__(self, inputs: Mapping[str, Any] | None = None, stream: Any = None) -> Any:
        self.leader.comm.bcast(("replay", self.key, dict(inputs or {})))
        return self.captured(inputs, stream)


def follow(compiled: Any, comm: Any) -> int:
    """Repeat rank 0's steps on this rank's part until it stops; returns the steps run."""
    captures: dict[tuple[int, str | None], Any] = {}
    steps = 0
    while True:
        msg = comm.bcast(None)
        if msg[0] == "stop":
            return steps
        if msg[0] == "run":
            compiled(msg[1], None, msg[2])
        elif msg[0] == "copy":
            compiled.copy_state_rows(*msg[1:])
        elif msg[0] == "capture":
            captures[(msg[1], msg[2])] = compiled.capture(msg[1], None, msg[2])
        else:
            captures[msg[1]](msg[2])
        steps += 1
