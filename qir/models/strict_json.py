"""JSON as checkpoint files are read: strictly, and the way the official safetensors library's
parser (Rust serde_json, without its float_roundtrip feature) reads it, so that a safetensors
header qir accepts is one `safetensors.safe_open` accepts and the other way round.

Beyond Python's json module this refuses:
- bytes that are not UTF-8, or that start with a byte-order mark;
- NaN, Infinity and -Infinity (not JSON);
- a number serde_json finds out of range (it errors where Python would make `inf`);
- a string holding a lone UTF-16 surrogate escape such as "\\ud800";
- nesting deeper than MAX_DEPTH (serde_json's recursion limit), without ever recursing in Python.

Numbers come back as serde_json types them: an integer literal in [-2**63, 2**64) is an int and
every other number a float, "-0" included (serde_json reads it as -0.0), so a reader that wants
a JSON integer checks `type(v) is int`.

Objects come back as dicts that refuse duplicate keys (qir's own files: a repeated key is
ambiguous), or, with `pairs=True`, as `Pairs` (the key/value list in file order) for a reader that
must apply another library's rules to repeats (safetensors' header). Such a reader validates the
values it keeps itself, so `pairs=True` leaves the nesting and surrogate rules to it: it calls
`check` on what it keeps without validating (ignored fields, names), which saves walking a large
header twice.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from qir.errors import FormatError

# serde_json's recursion limit is 128 and counts the opening bracket that reaches it.
MAX_DEPTH = 127

_U64_MAX = 2**64 - 1
_I32_MAX = 2**31 - 1
_POW10 = [float(f"1e{k}") for k in range(309)]  # serde_json's POW10 table, 1e0..1e308
_SURROGATE = re.compile("[\ud800-\udfff]")


class Pairs(list[tuple[str, Any]]):
    """A JSON object as its (key, value) pairs in file order, repeats kept."""


class _Refused(ValueError):
    pass


def _overflows(significand: int, digit: int, limit: int) -> bool:
    # serde_json's overflow!(a * 10 + b, c) test, which is not `a * 10 + b > c`.
    return significand >= limit // 10 and (significand > limit // 10 or digit > limit % 10)


def _f64_from_parts(positive: bool, significand: int, exponent: int) -> float:
    f = float(significand)
    while True:
        if abs(exponent) < len(_POW10):
            if exponent >= 0:
                f *= _POW10[exponent]
                if math.isinf(f):
                    raise _Refused("number out of range")
            else:
                f /= _POW10[-exponent]
            break
        if f == 0.0:
            break
        if exponent >= 0:
            raise _Refused("number out of range")
        f /= 1e308
        exponent += 308
    return f if positive else -f


def serde_number(literal: str) -> int | float:
    """A JSON number literal as serde_json types and range-checks it (see the module doc)."""
    positive = not literal.startswith("-")
    text = literal if positive else literal[1:]
    mantissa, _, exp_text = text.replace("E", "e").partition("e")
    int_digits, dot, frac_digits = mantissa.partition(".")
    if not dot and not exp_text:
        value = int(int_digits) if len(int_digits) <= 20 else _U64_MAX + 1
        if positive and value <= _U64_MAX:
            return value
        if not positive and 0 < value <= 2**63:
            return -value
        if value <= _U64_MAX:  # -0 and negatives below i64: serde_json's F64
            return -float(value)
    significand, exponent, full = 0, 0, False
    for c in int_digits:
        if full or _overflows(significand, ord(c) - 48, _U64_MAX):
            full = True  # digits past a u64 only scale it
            exponent += 1
        else:
            significand = significand * 10 + ord(c) - 48
    for c in frac_digits:
        if _overflows(significand, ord(c) - 48, _U64_MAX):
            break  # further fraction digits are dropped
        significand = significand * 10 + ord(c) - 48
        exponent -= 1
    if exp_text:
        exp_positive = not exp_text.startswith("-")
        exp = 0
        for c in exp_text.lstrip("+-"):
            if _overflows(exp, ord(c) - 48, _I32_MAX):
                if significand != 0 and exp_positive:
                    raise _Refused("number out of range")
                return 0.0 if positive else -0.0
            exp = exp * 10 + ord(c) - 48
        exponent = exponent + exp if exp_positive else exponent - exp
        exponent = max(-(2**31), min(_I32_MAX, exponent))  # i32 saturating arithmetic
    return _f64_from_parts(positive, significand, exponent)


def _int(literal: str) -> int | float:
    if len(literal) < 19 and literal != "-0":
        return int(literal)
    return serde_number(literal)


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"key {k!r} appears twice")
        out[k] = v
    return out


def _children(v: Any) -> list[Any]:
    """The values inside a JSON container (an object's values, an array's items)."""
    if isinstance(v, Pairs):
        return [x for _, x in v]
    return list(v.values()) if isinstance(v, dict) else v


def _depth_over(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit` (the top level is 1); level by level, never
    recursing, and looking only at containers."""
    level = [value] if isinstance(value, list | dict) else []
    for _ in range(limit):
        level = [x for v in level for x in _children(v) if isinstance(x, list | dict)]
        if not level:
            return False
    return True


def _lone_surrogate(value: Any) -> str | None:
    """A string (key or value) holding a lone surrogate, if any."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return v
        elif isinstance(v, Pairs):
            stack += [x for pair in v for x in pair]
        elif isinstance(v, dict):
            stack += [*v, *v.values()]
        elif isinstance(v, list):
            stack += v
    return None


def check(value: Any, where: str, depth: int = 1, strings: bool = True) -> None:
    """Refuses `value`, found `depth` levels down its document, if it breaks the nesting or
    (unless `strings` is false) the surrogate rule; see the module doc."""
    if _depth_over(value, MAX_DEPTH - depth + 1):
        raise FormatError(f"{where}: not JSON (nested deeper than {MAX_DEPTH} levels)")
    if strings and (lone := _lone_surrogate(value)) is not None:
        raise FormatError(f"{where}: not JSON (string {lone!r} holds a lone UTF-16 surrogate)")


def loads(raw: bytes, where: str, *, pairs: bool = False) -> Any:
    """The JSON document `raw` (read from `where`, named in errors); see the module doc."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(
            text,
            parse_int=_int,
            parse_float=serde_number,
            parse_constant=_constant,
            object_pairs_hook=Pairs if pairs else _unique,
        )
    except RecursionError:
        raise FormatError(f"{where}: not JSON (nested deeper than {MAX_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, _Refused, int() of a 4300-digit literal
        raise FormatError(f"{where}: not JSON ({e})") from None
    # Only this many brackets can nest this deep, and only a \u escape makes a surrogate (UTF-8
    # cannot encode one): most files skip the walks.
    if not pairs and (text.count("[") + text.count("{") > MAX_DEPTH or "\\u" in text):
        check(value, where, strings="\\u" in text)
    return value
