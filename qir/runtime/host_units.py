"""Several kernels in one g++ translation unit: what a host build of a block's cold kernels is.

A host build pays twice for things no kernel owns: loading the precompiled qir_host.h (a 67 MB
.gch, ~0.1 s of CPU) and code generation for the inline helpers every kernel calls (conversions,
warp sums, the MMA emulation). Four GEMV kernels built as one unit take ~60% of the CPU time of
four separate builds, and a test suite or a model load builds thousands.

A kernel's source is a prefix (everything up to its last `#include`: the headers and the macros
they read, such as QIR_FP4_CVT) and a body. Kernels whose prefixes define the same macros share a
unit: the prefix once (the union of their includes, each header guarded), then each body in a
namespace of its own, with the macros the body defines undefined after it, so one kernel's names
(QIR_K, qir_row, ...) and macros never meet another's. Kernel names stay global: the kernels and
their `qir_launch_<name>` entry points are extern "C". Arithmetic is IEEE at every inlining
decision (no fast-math, no contraction), so a kernel built in a unit computes the bytes it
computes alone (tests/runtime/test_host_units.py).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"][^>"]+[>"]', re.MULTILINE)
_DIRECTIVE = re.compile(r"^[ \t]*#.*$", re.MULTILINE)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)", re.MULTILINE)


@dataclass(frozen=True)
class Member:
    """One kernel of a unit: its name, its host source, and its own headers (name, text)."""

    name: str
    source: str
    headers: tuple[tuple[str, str], ...]


def split(source: str) -> tuple[str, str]:
    """(prefix, body): the prefix ends with the line of the last `#include` ("" if none)."""
    includes = list(_INCLUDE.finditer(source))
    if not includes:
        return "", source
    end = source.find("\n", includes[-1].end())
    end = len(source) if end < 0 else end + 1
    return source[:end], source[end:]


def unit_key(member: Member) -> Hashable | None:
    """Members with equal keys may share a unit: their prefixes' directives other than includes
    (the macros the headers read) are the same. None: a prefix that holds more than includes,
    macro definitions and line comments (code, a conditional) builds alone."""
    prefix, _ = split(member.source)
    key = []
    for line in (line.strip() for line in prefix.splitlines()):
        if not line or line.startswith("//") or _INCLUDE.match(line):
            continue
        if not _DEFINE.match(line):
            return None
        key.append(line)
    return tuple(key)


def unit_source(members: Sequence[Member]) -> str:
    """One translation unit holding every member (of one `unit_key`), each body in its own
    namespace and at its own line numbers (`#line`), so a diagnostic names the kernel's file."""
    head: list[str] = []  # the first member's directives in order, then others' includes
    parts: list[str] = []
    for i, m in enumerate(members):
        prefix, body = split(m.source)
        for line in (d.group(0).strip() for d in _DIRECTIVE.finditer(prefix)):
            if i == 0 or (_INCLUDE.match(line) and line not in head):
                head.append(line)
        first = prefix.count("\n") + 1
        undefs = "".join(f"#undef {name}\n" for name in dict.fromkeys(_DEFINE.findall(body)))
        parts.append(
            f'namespace qir_unit_{i} {{\n#line {first} "{m.name}.cu"\n{body}\n}}\n{undefs}'
        )
    return "\n".join([*head, ""]) + "".join(parts)


@dataclass
class _Group:
    key: Hashable | None
    members: list[int] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    headers: dict[str, str] = field(default_factory=dict)

    def admits(self, key: Hashable | None, m: Member) -> bool:
        """Whether `m` (of `key`) builds with this group: one key (never None), distinct names
        (the entry points are global) and no header name with two texts."""
        return (
            key is not None
            and key == self.key
            and m.name not in self.names
            and all(self.headers.get(name, text) == text for name, text in m.headers)
        )


def plan_units(members: Sequence[Member], units: int) -> list[list[int]]:
    """The members (by index) in about `units` groups that can each build as one: grouped by
    key (and header texts, and names), then each group cut into parts of near-equal source
    length, largest first so a thread pool finishes them together."""
    found: list[_Group] = []
    for i, m in enumerate(members):
        key = unit_key(m)
        group = next((g for g in found if g.admits(key, m)), None)
        if group is None:
            group = _Group(key)
            found.append(group)
        group.members.append(i)
        group.names.add(m.name)
        group.headers.update(m.headers)
    groups = [g.members for g in found]
    total = sum(len(m.source) for m in members) or 1
    out: list[list[int]] = []
    for g in groups:
        size = sum(len(members[i].source) for i in g)
        parts = max(1, min(len(g), round(units * size / total)))
        bins: list[list[int]] = [[] for _ in range(parts)]
        loads = [0] * parts
        for i in sorted(g, key=lambda i: -len(members[i].source)):
            b = loads.index(min(loads))
            bins[b].append(i)
            loads[b] += len(members[i].source)
        out += [sorted(b) for b in bins]
    return sorted(out, key=lambda b: -sum(len(members[i].source) for i in b))
