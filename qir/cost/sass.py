"""The SASS of a cubin (NVIDIA's nvdisasm, from the `nvidia-cuda-nvdisasm` wheel: the `sass`
extra) and a static model of what one of its regions costs per pass.

`disassemble` reads nvdisasm's JSON listing. The analyses below work on that instruction list
and know nothing about qir's kernels; qir.cost.resources tells them which kernel parameters
are weight buffers and which is M.

- Dataflow (`labels`): one pass in address order tracks which kernel parameters each register
  and predicate derives from (a parameter is read from constant bank 0 at the arch's parameter
  base plus its offset). That tells which global loads read which buffer, and which branches
  test M. The pass does not merge along control flow: a register redefined later in address
  order but reaching an earlier use through a back edge keeps its first labels (pointer
  increments redefine a register from itself, so they keep theirs).
- Loops are back edges: a BRA to an earlier instruction (the self-branch after the last
  EXIT is padding, not a loop; nor is a back branch in code no M reaches: a shuffle's
  divergence fallback returning to the code after its BRA.DIV). Two back edges to one head are
  one loop.
- A loop's trip count is solved when its back edge tests an induction register against an
  immediate, the register is stepped by one immediate add in the body and set to a constant
  before the loop (sm_80 code leaves by `@P CALL.REL.NOINC` just before a plain back branch: the
  same test, negated); anything else (a lane-dependent start, a bound in a register, an
  induction register spilled to the stack) is "unknown".
- `decide` evaluates, at a given M and block row (blockIdx.y), the branches whose guard is
  computed from M, blockIdx.y and constants alone (`mrows = min(M - m0, tile)`, `m < mrows`;
  M loaded by LDC / ULDC, or on sm_80 read straight from the constant bank as an operand),
  and `reachable` walks the code from the entry along them: code a batch size never runs (a
  kernel's M = 1 path at M = 8, or the other way round) is not counted. Nor is the target of a
  `BRA.DIV` (the collective fallback of shuffles for a diverged warp: qir's run converged).
- `region` and `cost` count the warp instructions one pass over a region issues: each
  instruction once, times the trip counts of the loops nested in the region. A forward branch
  that tests M in a way `decide` cannot evaluate skips one row of the batch; the instructions it
  jumps over count in proportion to the rows that run. Predicated-off instructions still issue,
  so they count.
- `in_flight` is the most bytes of loads of a given set of buffers that a warp has issued and
  not yet used, walking the region twice in address order (twice, so that loads issued for the
  next pass of a loop are counted where they wait).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from pathlib import Path

import numpy as np

from qir.runtime.cache import CUBIN, KernelCache, key
from qir.runtime.errors import BackendUnavailable

INSTRUCTION_BYTES = 16  # every SASS instruction since Volta
# Where kernel parameters start in constant bank 0, by SM major version (the cubin ABI).
_PARAM_BASE = {7: 0x160, 8: 0x160, 9: 0x210, 10: 0x380, 11: 0x380, 12: 0x380}
_NO_DEST = {
    "BAR", "BPT", "BRA", "BREAK", "BRX", "BSSY", "BSYNC", "CALL", "CCTL", "DEPBAR", "ERRBAR",
    "EXIT", "JMP", "JMX", "KILL", "MEMBAR", "NOP", "RED", "REDG", "RET", "ST", "STG", "STL",
    "STS", "WARPSYNC", "YIELD",
}  # fmt: skip
GLOBAL_LOADS = {"LDG", "LDGSTS"}
_REG = re.compile(r"(?<![\w.])(U?R\d+|U?P\d|PT|UPT|RZ|URZ)((?:\.\w+)*)")
_CBANK = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_ZERO = {"RZ", "URZ", "PT", "UPT"}
_MAX_TRIPS = 1 << 16


def param_base(arch: str) -> int:
    major = int(re.fullmatch(r"sm_(\d+?)(\d)[af]?", arch).group(1))  # type: ignore[union-attr]
    return _PARAM_BASE[major]


@dataclass(frozen=True)
class Instr:
    index: int
    opcode: str  # e.g. "LDG.E.128.CONSTANT"
    operands: tuple[str, ...]
    guard: str = ""  # "@P0", "@!P1" or ""

    @property
    def op(self) -> str:
        """The mnemonic without modifiers: "LDG", "FFMA", "ISETP"."""
        return self.opcode.split(".", 1)[0]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.opcode.split("."))

    @property
    def width(self) -> int:
        """Registers the destination spans (loads and wide ops write 2 or 4)."""
        if "128" in self.parts:
            return 4
        return 2 if {"64", "WIDE"} & set(self.parts) else 1

    @property
    def load_bytes(self) -> int:
        parts = set(self.parts)
        for tag, n in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
            if tag in parts:
                return n
        return 4

    def target(self) -> int | None:
        """Index of a jump's target: BRA, or CALL.REL.NOINC (a call that does not return: how
        sm_80 code leaves a loop)."""
        if not (self.op == "BRA" or self.opcode.startswith("CALL.REL.NOINC")) or not self.operands:
            return None
        addr = re.search(r"0x[0-9a-f]+", self.operands[-1])
        return int(addr.group(0), 16) // INSTRUCTION_BYTES if addr else None

    @cached_property
    def _dest_operands(self) -> int:
        """How many leading operands are written: 0, 1 or 2 (the predicate of ISETP/PLOP3 or
        of a carry-out add beside its register; the data register of SHFL beside its
        predicate)."""
        ops = self.operands
        if self.op in _NO_DEST or not ops or not _REG.match(ops[0].lstrip("-!|~")):
            return 0
        return 2 if len(ops) > 1 and (_is_pred(ops[1]) or _is_pred(ops[0])) else 1

    @cached_property
    def dests(self) -> tuple[str, ...]:
        n = self._dest_operands
        names = [*_reg_names(self.operands[0], self.width)] if n else []
        if n == 2:
            names += _reg_names(self.operands[1], 1)
        return tuple(r for r in names if r not in _ZERO)

    @cached_property
    def sources(self) -> tuple[str, ...]:
        """The operands read (after the destinations)."""
        return self.operands[self._dest_operands :]


def _is_pred(tok: str) -> bool:
    return re.fullmatch(r"!?(U?P\d|U?PT)", tok) is not None


@lru_cache(maxsize=1 << 16)  # a listing's operands repeat; the dataflow reads each many times
def _reg_names(tok: str, width: int) -> tuple[str, ...]:
    """Registers an operand names: R4 as a destination of width 4 is R4..R7; "R6.64" is R6, R7."""
    names: list[str] = []
    for m in _REG.finditer(tok):
        name, mods = m.group(1), m.group(2)
        if name in _ZERO or _is_pred(name):
            names.append(name)
            continue
        n = 2 if ".64" in mods else width
        prefix = "UR" if name.startswith("UR") else "R"
        base = int(name[len(prefix) :])
        names += [f"{prefix}{base + j}" for j in range(n)]
    return tuple(names)


@cache
def nvdisasm() -> Path | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, $CUDA_HOME/bin or PATH, else None."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for tool in sorted(Path(root).glob("cu*/bin/nvdisasm")):
                if os.access(tool, os.X_OK):
                    return tool
    except ImportError:
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env) and os.access(p := Path(os.environ[env]) / "bin/nvdisasm", os.X_OK):
            return p
    found = shutil.which("nvdisasm")
    return Path(found) if found else None


def available() -> bool:
    return nvdisasm() is not None


@lru_cache(maxsize=64)
def disassemble(cubin: bytes, function: str) -> tuple[Instr, ...]:
    """The SASS of `function` in `cubin`, in address order (instruction i at byte 16 i). The
    listing is kept in the compile cache (nvdisasm takes seconds to start)."""
    tool = nvdisasm()
    if tool is None:
        raise BackendUnavailable(
            "reading SASS needs nvdisasm: pip install 'qir[sass]' (the nvidia-cuda-nvdisasm wheel)"
        )
    stat = tool.stat()
    parts = {
        "cubin": hashlib.sha256(cubin).hexdigest(),
        "compiler": f"nvdisasm {tool} {stat.st_size} {stat.st_mtime_ns}",
    }
    entry = KernelCache.at().fetch(
        CUBIN, function, key(parts), ".sass.json", lambda: _listing(tool, cubin), "nvdisasm"
    )
    _, functions = json.loads(entry.payload)
    for fn in functions:
        if fn["function-name"] == function:
            return tuple(_instr(i, raw) for i, raw in enumerate(fn["sass-instructions"]))
    raise KeyError(f"{function} is not in the cubin")


def _listing(tool: Path, cubin: bytes) -> bytes:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-c", "-json", f.name], capture_output=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {out.stderr.decode(errors='replace').strip()}")
    return out.stdout


def _instr(index: int, raw: Mapping[str, object]) -> Instr:
    text = str(raw.get("operands", ""))
    # nvdisasm 13.2 drops the comma before some memory operands ("R4[R6.64]").
    text = re.sub(r"((?:U?R\d+|RZ)(?:\.\w+)*)\[", r"\1,[", text)
    opcode, operands = str(raw["opcode"]), _split(text)
    guard = str(raw.get("predicate", ""))
    # sm_100's uniform branch names its predicate as an operand (`BRA.U UP1, 0x2cf0`): the same
    # as a guard, and read as one.
    if opcode.startswith("BRA") and not guard and len(operands) > 1 and _is_pred(operands[0]):
        guard, operands = "@" + operands[0], operands[1:]
    return Instr(index, opcode, operands, guard)


def _split(text: str) -> tuple[str, ...]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return (*out, cur.strip()) if cur.strip() else tuple(out)


# ---------------------------------------------------------------------------------------------
# Dataflow: which kernel parameters each instruction's operands derive from


@dataclass(frozen=True)
class Flow:
    address: tuple[frozenset[str], ...]  # of the registers inside memory brackets
    guard: tuple[frozenset[str], ...]  # of the instruction's guard predicate
    writes: tuple[frozenset[str], ...]  # registers each instruction writes


def labels(
    instrs: Sequence[Instr], slots: Mapping[int, str], live: frozenset[int] | None = None
) -> Flow:
    """`slots` maps constant-bank byte offsets (4-byte words) to a label, e.g. the word(s) of
    a kernel parameter to its name. With `live` (the code reachable at some M), the pass skips
    the rest: registers another batch size's path reuses do not taint this one's."""
    state: dict[str, frozenset[str]] = {}
    address, guard, writes = [], [], []
    none: frozenset[str] = frozenset()
    for ins in instrs:
        if live is not None and ins.index not in live:
            address.append(none)
            guard.append(none)
            writes.append(frozenset(ins.dests))
            continue
        dests = ins.dests
        src_l: set[str] = set()
        addr_l: set[str] = set()
        loaded: dict[str, frozenset[str]] = {}
        for tok in ins.sources:
            for off in _CBANK.findall(tok):
                word = int(off, 16)
                if ins.op in ("LDC", "ULDC", "LDCU"):  # destination j <- constant word j
                    for j, d in enumerate(dests):
                        label = slots.get(word + 4 * j)
                        loaded[d] = frozenset({label}) if label else none
                elif word in slots:
                    src_l.add(slots[word])
            inside = set(_reg_names(tok[tok.rfind("[") + 1 :], 1)) if "[" in tok else set()
            for r in _reg_names(tok, 1):
                got = state.get(r, none)
                src_l |= got
                if r in inside:
                    addr_l |= got
        for d in dests:
            new = loaded.get(d, frozenset(src_l))
            # A guarded write may not happen: the register keeps what it had too.
            state[d] = new | state.get(d, none) if ins.guard else new
        address.append(frozenset(addr_l))
        guard.append(state.get(ins.guard.lstrip("@!"), none) if ins.guard else none)
        writes.append(frozenset(dests))
    return Flow(tuple(address), tuple(guard), tuple(writes))


# ---------------------------------------------------------------------------------------------
# Loops


@dataclass(frozen=True)
class Loop:
    head: int  # first instruction
    tail: int  # the back branch

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and self.head <= index <= self.tail

    def inside(self, other: Loop) -> bool:
        return other != self and other.head <= self.head and self.tail <= other.tail


def loops(instrs: Sequence[Instr], live: frozenset[int] | None = None) -> tuple[Loop, ...]:
    """The back edges, as loops; with `live` (the code reachable at some M), those whose back
    branch is live: a shuffle's divergence fallback returns by a branch back to the code after
    its BRA.DIV, a back edge from dead code, not a loop."""
    tails: dict[int, int] = {}
    for ins in instrs:
        t = ins.target()
        if t is not None and t < ins.index and (live is None or ins.index in live):
            tails[t] = max(tails.get(t, 0), ins.index)
    return tuple(Loop(h, t) for h, t in sorted(tails.items()))


def trip_count(instrs: Sequence[Instr], loop: Loop) -> int | None:
    """How many times the body runs, if the back edge is a counted loop (see the module
    docstring); None if that cannot be read off the instructions."""
    back = instrs[loop.tail]
    if not back.guard:
        # `@P exit; BRA head`: the loop goes on while the exit's guard is false.
        exit_ = instrs[loop.tail - 1] if loop.tail > loop.head else None
        if exit_ is None or not exit_.guard or (exit_.target() or 0) <= loop.tail:
            return None
        back = Instr(exit_.index, exit_.opcode, exit_.operands, _negate(exit_.guard))
    pred, negated = back.guard.lstrip("@!"), back.guard.startswith("@!")
    cmp_at = _last_def(instrs, pred, loop.head, loop.tail)
    if cmp_at is None or instrs[cmp_at].op != "ISETP":
        return None
    test = _compare(instrs[cmp_at])
    if test is None:
        return None
    reg, op, bound, unsigned = test
    steps = [i for i in range(loop.head, loop.tail) if reg in instrs[i].dests]
    if len(steps) != 1 or (step := _step(instrs[steps[0]], reg)) is None:
        return None
    init_at = _last_def(instrs, reg, 0, loop.head)
    value = _constant(instrs[init_at]) if init_at is not None else None
    if value is None:
        return None
    stepped_first = steps[0] < cmp_at
    for trips in range(1, _MAX_TRIPS):
        seen = value + step if stepped_first else value
        value += step
        if _holds(op, seen, bound, unsigned) == negated:
            return trips
    return None


def _negate(guard: str) -> str:
    return guard.replace("@!", "@") if guard.startswith("@!") else guard.replace("@", "@!")


def _last_def(
    instrs: Sequence[Instr], reg: str, start: int, end: int, live: frozenset[int] | None = None
) -> int | None:
    for i in range(end - 1, start - 1, -1):
        if reg in instrs[i].dests and (live is None or i in live):
            return i
    return None


_MIRROR = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _compare(ins: Instr) -> tuple[str, str, int, bool] | None:
    parts = ins.parts
    if len(ins.operands) != 5 or ins.operands[4] != "PT" or "EX" in parts:
        return None
    op = next((p for p in parts if p in _MIRROR), None)
    a, b = ins.operands[2], ins.operands[3]
    if op is None:
        return None
    if _imm(a) is not None and _imm(b) is None:
        a, b, op = b, a, _MIRROR[op]
    bound = _imm(b)
    if bound is None or re.fullmatch(r"R\d+", a) is None:
        return None
    return a, op, bound, "U32" in parts


def _holds(op: str, a: int, b: int, unsigned: bool) -> bool:
    if unsigned:
        a, b = a & 0xFFFFFFFF, b & 0xFFFFFFFF
    return {
        "LT": a < b,
        "LE": a <= b,
        "GT": a > b,
        "GE": a >= b,
        "EQ": a == b,
        "NE": a != b,
    }[op]


def _imm(tok: str) -> int | None:
    m = re.fullmatch(r"(-)?(0x[0-9a-f]+|\d+)", tok)
    if m is None:
        return None
    return -int(m.group(2), 0) if m.group(1) else int(m.group(2), 0)


def _step(ins: Instr, reg: str) -> int | None:
    if ins.op not in ("IADD3", "VIADD", "IADD") or ins.guard:
        return None
    rest = [t for t in ins.operands[1:] if t not in _ZERO and not _is_pred(t)]
    imms = [v for t in rest if (v := _imm(t)) is not None]
    regs = [t for t in rest if _imm(t) is None]
    return imms[0] if regs == [reg] and len(imms) == 1 else None


def _constant(ins: Instr) -> int | None:
    """The value an unguarded instruction gives `reg`, if it is a constant."""
    if ins.guard:
        return None
    srcs = ins.operands[1:]
    if ins.op == "CS2R" and srcs == ("SRZ",):
        return 0
    if ins.op == "MOV" and len(srcs) >= 1:
        return 0 if srcs[0] == "RZ" else _imm(srcs[0])
    if ins.opcode.startswith("IMAD.MOV") and srcs[:2] == ("RZ", "RZ"):
        return _imm(srcs[2]) if srcs[2] != "RZ" else 0
    if ins.op == "HFMA2" and srcs[:2] == ("-RZ", "RZ") and len(srcs) == 4:
        # -0 * 0 + (hi, lo): the compiler's way to set a 32-bit constant from two halves.
        hi, lo = (int(np.float16(float(s)).view(np.uint16)) for s in srcs[2:])
        return hi << 16 | lo
    return None


# ---------------------------------------------------------------------------------------------
# Branches at a given M

_MASK = 0xFFFFFFFF


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 32) if v & 0x80000000 else v


def value(
    instrs: Sequence[Instr],
    at: int,
    tok: str,
    slots: Mapping[int, str],
    env: Mapping[str, int],
    live: frozenset[int] | None = None,
    memo: dict[tuple[int, str], int | None] | None = None,
) -> int | None:
    """The 32-bit value of operand `tok` just before instruction `at` (its last definition in
    address order, in `live` code if given), if it follows from constants, M (env["M"]) and
    blockIdx.y (env["SR_CTAID.Y"]) alone; None otherwise. Predicates evaluate to 0 or 1.
    `memo` holds definitions already evaluated for these instrs, slots, env and live: without
    it a definition is evaluated once per path to it (millions of times in a long GEMV)."""
    neg, inverted = tok.startswith("-"), tok.startswith("!")
    tok = tok.lstrip("-!")
    if re.match(r"U?[RP]", tok):
        tok = tok.split(".", 1)[0]  # R74.reuse is R74
    if tok in ("RZ", "URZ"):
        return 0
    if tok in ("PT", "UPT"):
        return 1
    imm = _imm(tok)
    if imm is not None:
        return -imm if neg else imm
    if cbank := _CBANK.fullmatch(tok):
        # A parameter read as an operand (sm_80: `IMAD.MOV.U32 R7, RZ, RZ, c[0x0][0x198]`, where
        # later archs load it by LDC / ULDC first): only M's word has a value here.
        m = env.get("M") if slots.get(int(cbank.group(1), 16)) == "M" else None
        return None if m is None else -m if neg else m
    if re.fullmatch(r"U?R\d+|U?P\d", tok) is None:
        return None
    d = _last_def(instrs, tok, 0, at, live)
    if d is None:
        return None
    if memo is None:
        got = _define(instrs, d, tok, slots, env, live, memo)
    elif (d, tok) in memo:
        got = memo[d, tok]
    else:
        got = memo[d, tok] = _define(instrs, d, tok, slots, env, live, memo)
    if got is None:
        return None
    return int(not got) if inverted else -got if neg else got


_UNIFORM_TWINS = {"IADD3", "SEL", "ISETP", "SHF", "LEA", "IMAD", "MOV"}


def _define(
    instrs: Sequence[Instr],
    d: int,
    reg: str,
    slots: Mapping[int, str],
    env: Mapping[str, int],
    live: frozenset[int] | None,
    memo: dict[tuple[int, str], int | None] | None = None,
) -> int | None:
    ins = instrs[d]
    if ins.guard:
        return None
    src = ins.sources

    def v(k: int) -> int | None:
        return value(instrs, d, src[k], slots, env, live, memo) if k < len(src) else None

    op, parts = ins.op, ins.parts
    # The uniform datapath's twins (UIADD3, USEL, UISETP, S2UR, ...) compute the same.
    if op == "S2UR":
        op = "S2R"
    elif op.startswith("U") and op not in ("UMOV",) and op[1:] in _UNIFORM_TWINS:
        op = op[1:]
    elif op == "UMOV":
        op = "MOV"
    if op == "S2R":
        return env.get(src[0]) if src else None
    if op in ("LDC", "ULDC", "LDCU"):
        words = _CBANK.findall(src[0]) if src else []
        if not words:
            return None
        word = int(words[0], 16) + 4 * ins.dests.index(reg)
        return env.get("M") if slots.get(word) == "M" else None
    # Everything else computes from its operands: all of them must be known. A trailing PT /
    # !PT of a min/max selects min / max; that of an ISETP is the predicate it is ANDed with.
    # sm_100 writes predicate outputs first (`IADD3 R0, PT, PT, R1, R2, RZ`): not operands.
    if op != "PLOP3":
        while src and src[0] in ("PT", "UPT"):
            src = src[1:]
    if op == "ISETP" and len(src) == 3 and ({"AND", "OR"} & set(parts)):
        # compare, then AND / OR with a predicate: one side alone can decide it (M == 1 || x).
        cmp = next((p for p in parts if p in _MIRROR), None)
        a0, a1, q = v(0), v(1), v(2)
        c = (
            None
            if cmp is None or a0 is None or a1 is None
            else int(_holds(cmp, a0, a1, "U32" in parts))
        )
        short = 0 if "AND" in parts else 1
        if short in (c, q):
            return short
        return (
            None
            if c is None or q is None
            else int(bool(c) and bool(q) if short == 0 else bool(c) or bool(q))
        )
    mode = src[-1] if src and src[-1] in ("PT", "!PT", "UPT") else ""
    got = [v(k) for k in range(len(src) - (1 if mode else 0))]
    if any(x is None for x in got):
        return None
    a = [x for x in got if x is not None]
    if op == "PLOP3" and len(a) >= 4:
        return (a[3] >> (4 * bool(a[0]) + 2 * bool(a[1]) + bool(a[2]))) & 1
    if op == "ISETP" and len(a) == 2 and mode in ("PT", "UPT") and "AND" in parts:
        cmp = next((p for p in parts if p in _MIRROR), None)
        return None if cmp is None else int(_holds(cmp, a[0], a[1], "U32" in parts))
    if op in ("VIMNMX", "IMNMX", "VIADDMNMX") and mode in ("PT", "!PT") and len(a) >= 2:
        # sm_100 writes two predicate outputs first (`VIMNMX R0, PT, PT, R1, R2, PT`): the
        # operands are the last two (three for the add-first form) before the selector.
        add = op == "VIADDMNMX"
        if len(a) < 2 + add:
            return None
        x, y = (a[-3] + a[-2], a[-1]) if add else (a[-2], a[-1])
        if "U32" not in parts:
            x, y = _signed(x), _signed(y)
        return (min(x, y) if mode == "PT" else max(x, y)) & _MASK
    if mode:
        return None
    if op == "MOV" and a:
        return a[0] & _MASK
    if op == "SEL" and len(a) == 3:
        return a[0] if a[2] else a[1]
    if op in ("IADD3", "VIADD"):
        return sum(a) & _MASK
    if op == "IMAD" and len(a) == 3 and not {"WIDE", "HI", "X"} & set(parts):
        # IMAD.SHL's immediate is the power of two it multiplies by (x << 3 prints as 0x8).
        return (a[0] * a[1] + a[2]) & _MASK
    if op == "SHF" and len(a) >= 3:
        if parts[1:3] == ("L", "U32"):
            return (a[0] << a[1]) & _MASK
        if parts[1] == "R" and "HI" in parts:
            return (_signed(a[2]) if "S32" in parts else a[2]) >> a[1] & _MASK
        return None
    if op == "LEA" and len(a) == 3 and "HI" not in parts:
        return ((a[0] << a[2]) + a[1]) & _MASK
    return None


def decide(
    instrs: Sequence[Instr], flow: Flow, slots: Mapping[int, str], m: int, tile: int
) -> dict[int, bool]:
    """Branch -> taken, for the guarded branches that test M (flow.guard) and evaluate at batch
    size `m` in block row `tile`. A register's last definition in address order may lie on
    another M's path (sm_80 lays the tile path out before the one-row path, and reuses its
    registers): the branches are decided again from the definitions in the code the last
    decisions reach, until that code stays the same."""
    env = {"M": m, "SR_CTAID.Y": tile}
    live: frozenset[int] | None = None
    out: dict[int, bool] = {}
    for _ in range(8):
        out = {}
        memo: dict[tuple[int, str], int | None] = {}
        for i, ins in enumerate(instrs):
            if ins.target() is None or not ins.guard or "M" not in flow.guard[i]:
                continue
            if live is not None and i not in live:
                continue
            p = value(instrs, i, ins.guard.lstrip("@"), slots, env, live, memo)
            if p is not None:
                out[i] = bool(p)
        reached = reachable(instrs, out)
        if reached == live:
            break
        live = reached
    return out


def reachable(instrs: Sequence[Instr], decided: Mapping[int, bool]) -> frozenset[int]:
    """The instructions control can reach from the entry, following decided branches one way."""
    seen: set[int] = set()
    stack = [0]
    while stack:
        i = stack.pop()
        while 0 <= i < len(instrs) and i not in seen:
            seen.add(i)
            ins = instrs[i]
            if ins.op in ("BRX", "JMX"):  # an indirect jump: anywhere
                return frozenset(range(len(instrs)))
            if ins.op in ("EXIT", "RET") and not ins.guard:
                break
            t = ins.target()
            if ins.opcode.startswith("BRA.DIV"):
                # Taken only by a diverged warp (to a shuffle's collective fallback); qir's
                # shuffles run in converged warps (full masks), so control falls through.
                i += 1
                continue
            always = ins.guard in ("", "@PT", "@UPT")
            if t is not None and (always or decided.get(i) is True):
                i = t
                continue
            if t is not None and decided.get(i) is None:
                stack.append(t)
            i += 1
    return frozenset(seen)


# ---------------------------------------------------------------------------------------------
# Cost of one pass over a region


@dataclass(frozen=True)
class Region:
    """A stretch of code and how often each of its instructions runs per pass over it."""

    loop: Loop
    runs: dict[int, int]  # instruction -> times per pass (trip counts of nested loops)
    unknown_loops: tuple[Loop, ...]  # nested loops with an unknown trip count (counted once)
    rows: tuple[tuple[int, int], ...]  # (branch, target) of each M-branch: one row of the batch

    @property
    def rows_covered(self) -> int:
        return sum(self.runs[a] for a, _ in self.rows)

    def skippable(self, i: int) -> bool:
        return any(a < i < b for a, b in self.rows)


def region(
    instrs: Sequence[Instr],
    loop: Loop,
    flow: Flow,
    all_loops: Iterable[Loop],
    m: str,
    decided: Mapping[int, bool] | None = None,
) -> Region:
    """`loop` (or any span) with its nested loops' trip counts and its forward branches that
    test M (label `m`) and are not `decided`, outside each other's ranges: each jumps over the
    work of one row."""
    trips = {lp: trip_count(instrs, lp) for lp in all_loops if lp.inside(loop)}
    runs = {}
    for i in range(loop.head, loop.tail + 1):
        n = 1
        for lp, t in trips.items():
            if i in lp:
                n *= t or 1
        runs[i] = n
    rows: list[tuple[int, int]] = []
    for i in range(loop.head, loop.tail + 1):
        t = instrs[i].target()
        if t is None or t <= i or m not in flow.guard[i] or any(a < i < b for a, b in rows):
            continue
        if decided and i in decided:
            continue
        rows.append((i, min(t, loop.tail + 1)))
    unknown = tuple(lp for lp, t in trips.items() if t is None)
    return Region(loop, runs, unknown, tuple(rows))


def cost(
    instrs: Sequence[Instr],
    r: Region,
    share: float,
    outside: Loop | None = None,
    live: frozenset[int] | None = None,
) -> dict[str, float]:
    """Warp instructions one pass over `r` issues, by mnemonic, when a `share` (0 to 1) of the
    rows of the batch that its M-branches guard run; only those outside `outside`, if given,
    and only those in `live` (reachable at this M), if given."""
    mix: dict[str, float] = {}
    for i, n in r.runs.items():
        if live is not None and i not in live:
            continue
        if outside is None or i not in outside:
            mix[instrs[i].op] = mix.get(instrs[i].op, 0.0) + n * (share if r.skippable(i) else 1)
    return mix


def loaded_bytes(instrs: Sequence[Instr], r: Region, flow: Flow, buffers: set[str]) -> int:
    """Bytes one pass over `r` loads per thread from the buffers labelled `buffers`."""
    return sum(
        instrs[i].load_bytes * n
        for i, n in r.runs.items()
        if instrs[i].op in GLOBAL_LOADS and flow.address[i] & buffers
    )


def in_flight(
    instrs: Sequence[Instr], region: Loop, flow: Flow, buffers: set[str], passes: int = 2
) -> int:
    """The most bytes per thread of loads from `buffers` issued and not yet used (read or
    overwritten), over `passes` passes through `region` in address order (a loop: 2)."""
    pending: dict[str, float] = {}  # destination register -> its share of the load's bytes
    most = 0.0
    for _ in range(passes):
        for i in range(region.head, region.tail + 1):
            ins = instrs[i]
            touched = {r for tok in ins.sources for r in _reg_names(tok, 1)} | flow.writes[i]
            for r in touched & pending.keys():
                del pending[r]
            if ins.op in GLOBAL_LOADS and flow.address[i] & buffers and flow.writes[i]:
                for r in flow.writes[i]:
                    pending[r] = ins.load_bytes / len(flow.writes[i])
                most = max(most, sum(pending.values()))
    return round(most)
