"""Runtime errors with enough context to act on."""

from __future__ import annotations

import re

from qir.errors import QirError


class CompileError(QirError, RuntimeError):
    """A kernel failed to compile: names the kernel, gives the compiler's message and the
    generated source lines it points at (with line numbers)."""

    def __init__(
        self, kernel: str, compiler: str, message: str, source: str, filename: str = ""
    ) -> None:
        self.kernel = kernel
        self.compiler = compiler
        self.message = message
        excerpt = _excerpt(message, source, filename or f"{kernel}.cu")
        super().__init__(f"{compiler} failed to compile kernel {kernel}:\n{message}\n{excerpt}")


class BackendUnavailable(QirError, RuntimeError):
    """The requested backend cannot run on this machine."""


def _excerpt(message: str, source: str, filename: str, context: int = 2) -> str:
    lines = source.splitlines()
    wanted: set[int] = set()
    # g++: "kernel.cu:12:5: error", NVRTC: "kernel.cu(12): error". Only positions in the kernel's
    # own file: a note pointing into a header would show unrelated lines of the kernel.
    # "*": the compiler named the source itself (CuPy names it after a hash)
    name = r"[\w./-]+" if filename == "*" else re.escape(filename)
    pattern = name + r"(?::(\d+):\d+:|\((\d+)\):)"
    for m in re.finditer(pattern, message):
        n = int(m.group(1) or m.group(2))
        wanted.update(range(max(1, n - context), min(len(lines), n + context) + 1))
    if not wanted:
        return ""
    out = ["generated source:"]
    prev = 0
    for n in sorted(wanted):
        if prev and n != prev + 1:
            out.append("  ...")
        out.append(f"  {n:5d} | {lines[n - 1]}")
        prev = n
    return "\n".join(out)
