"""Parser for the printer's text, so pass tests can be written as IR before/after."""

from __future__ import annotations

import json
import re

from qir.dtypes import by_name
from qir.errors import QirError
from qir.formats import parse_format
from qir.graph import AttrValue, Graph, Node
from qir.types import Dim, QActType, QExperts, QWeight, TensorType, TupleType, ValueType
from qir.verify import verify

_NAME = r"[\w.]+"
_HEADER = re.compile(rf"^graph ({_NAME}) \{{$")
_NODE = re.compile(rf"^%({_NAME}) = (\w+)((?: %{_NAME}(?:, %{_NAME})*)?)(?: \{{(.*)\}})? : (.+)$")
_OUTPUT = re.compile(rf"^output ({_NAME}) = %({_NAME})$")
_TENSOR = re.compile(r"^(\w+)\[(.*)\]$")
_QACT = re.compile(r"^qact<(\w+), (.+)>$")
_QEXPERTS = re.compile(r"^experts<(\d+), (qweight<.+)>$")
_QWEIGHT = re.compile(r"^qweight<(.+)>\[(\d+), (\d+)\](\+bias)?$")


class ParseError(QirError, ValueError):
    pass


def parse_type(text: str) -> ValueType:
    if text.startswith("(") and text.endswith(")"):
        elements = [parse_type(e) for e in re.findall(r"\w+\[[^\]]*\]", text)]
        if not elements or not all(isinstance(e, TensorType) for e in elements):
            raise ParseError(f"bad tuple type {text!r}")
        return TupleType(tuple(e for e in elements if isinstance(e, TensorType)))
    m = _QACT.match(text)
    if m:
        source = parse_type(m.group(2))
        if not isinstance(source, TensorType):
            raise ParseError(f"bad qact source type {m.group(2)!r}")
        return QActType(m.group(1), source)
    m = _QEXPERTS.match(text)
    if m:
        expert = parse_type(m.group(2))
        if not isinstance(expert, QWeight):
            raise ParseError(f"bad expert type {m.group(2)!r}")
        return QExperts(expert, int(m.group(1)))
    m = _QWEIGHT.match(text)
    if m:
        fmt, out, in_ = parse_format(m.group(1)), int(m.group(2)), int(m.group(3))
        return QWeight(fmt, out, in_, bias=m.group(4) is not None)
    m = _TENSOR.match(text)
    if not m:
        raise ParseError(f"bad type {text!r}")
    dims: list[Dim] = [int(d) if d.strip().isdigit() else d.strip() for d in m.group(2).split(",")]
    return TensorType(tuple(dims), by_name(m.group(1)))


def _parse_attrs(text: str) -> tuple[tuple[str, AttrValue], ...]:
    out: list[tuple[str, AttrValue]] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(text):
        m = re.compile(r"\s*(\w+)=").match(text, pos)
        if not m:
            raise ParseError(f"bad attributes {{{text}}}")
        value, pos = decoder.raw_decode(text, m.end())
        out.append((m.group(1), tuple(value) if isinstance(value, list) else value))
        if text.startswith(",", pos):
            pos += 1
    return tuple(sorted(out))


def parse(text: str) -> Graph:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not (head := _HEADER.match(lines[0])) or lines[-1] != "}":
        raise ParseError("expected 'graph NAME {' ... '}'")
    graph = Graph(head.group(1))
    for n, line in enumerate(lines[1:-1], start=2):
        try:
            if m := _OUTPUT.match(line):
                graph.outputs.append((m.group(1), m.group(2)))
            elif m := _NODE.match(line):
                name, op, operands, attrs, type_text = m.groups()
                ops = tuple(o.strip().lstrip("%") for o in operands.split(",") if o.strip())
                node = Node(op, parse_type(type_text), _parse_attrs(attrs or ""))
                graph.add(name, node, ops)
            else:
                raise ParseError("not a node or output")
        except (ParseError, ValueError) as e:
            raise ParseError(f"line {n}: {e}: {line}") from None
    verify(graph)
    return graph
