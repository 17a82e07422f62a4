"""Pictures of what the passes did: a block's graph before and after them, side by side, each
launch of the after graph's plan a box named after its kernel.

Nodes are labelled with their value name, op (and fusion attributes), weight format and type.
The DOT is networkx's pydot export of one graph holding both sides (every node with its
attributes at the top level, so `networkx.nx_pydot.read_dot` reads it all back), plus clusters
that only name their nodes. Graphviz's `dot` turns it into SVG or PNG where it is installed.
A W4A4 node has two launches (the 16-bit twin above 64 rows): the twin's box holds a note
pointing at the nodes the first one drew.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import networkx as nx

from qir.codegen.plan import ALL_M, Launch, Plan
from qir.errors import UsageError
from qir.graph import Graph
from qir.ops import Op
from qir.types import QExperts, QWeight

SUFFIXES = (".dot", ".svg", ".png")
# networkx writes DOT through pydot: an extra, so that qir imports and runs without it
INSTALL_PYDOT = "pip install 'qir[draw]'"
INSTALL = (
    "install Graphviz: apt-get install graphviz (Debian, Ubuntu), brew install graphviz (macOS)"
)
# Attributes worth a line in a label (names of fused nodes, keys and scales are not).
SHOWN = ("prologue", "epilogue", "act_quant", "kernel", "index", "scheme")
STYLE = {
    "input": {"shape": "ellipse", "fillcolor": "#dbeafe"},
    "weight": {"shape": "cylinder", "fillcolor": "#f3f4f6"},
    "qlinear": {"shape": "box", "fillcolor": "#fde68a"},
    "quantize_act": {"shape": "hexagon", "fillcolor": "#fbcfe8"},
    "get": {"shape": "box", "fillcolor": "#ffffff"},
}
ELEMENTWISE = {"shape": "ellipse", "fillcolor": "#d1fae5"}


def _format(graph: Graph, name: str) -> str:
    """The weight format a node reads or is (its tag), or ''."""
    t = graph.node(name).type
    if isinstance(t, (QWeight, QExperts)):
        return t.format.tag()
    if graph.node(name).op in (Op.QLINEAR, Op.EXPERT_QLINEAR):
        tags = {
            w.format.tag()
            for o in graph.operands(name)
            if isinstance(w := graph.node(o).type, (QWeight, QExperts))
        }
        return ", ".join(sorted(tags))
    return ""


def _shape(t: object) -> str:
    # a weight's format is on the line above
    if isinstance(t, QExperts):
        return f"{t.count} x [{t.out_features}, {t.in_features}]"
    return f"[{t.out_features}, {t.in_features}]" if isinstance(t, QWeight) else str(t)


def label(graph: Graph, name: str) -> str:
    node = graph.node(name)
    op = " ".join([node.op, *(f"{k}={v}" for k, v in node.attrs if k in SHOWN)])
    fused = node.attr("fused")
    lines = [f"%{name}", op, f"fuses {', '.join(fused)}" if fused else ""]
    lines += [_format(graph, name), _shape(node.type)]
    # \n is Graphviz's line break inside a quoted label
    return "\\n".join(line for line in lines if line)


def _side(out: nx.DiGraph[str], graph: Graph, side: str) -> None:
    for name, node in graph.items():
        style = STYLE.get(node.op, ELEMENTWISE)
        out.add_node(f"{side}/{name}", label=label(graph, name), style="filled", **style)
        for o in graph.operands(name):
            out.add_edge(f"{side}/{o}", f"{side}/{name}")


def _when(launch: Launch) -> str:
    lo, hi = launch.when
    if (lo, hi) == ALL_M:
        return ""
    return f"M <= {hi}" if lo == 1 else f"M >= {lo}" if hi == ALL_M[1] else f"M {lo}..{hi}"


def to_dot(before: Graph, after: Graph, plan: Plan | None) -> str:
    """DOT text of `before` and `after` side by side, the launches of `plan` (a plan of `after`)
    as clusters named after their kernels."""
    try:
        import pydot
    except ImportError:
        raise UsageError(f"drawing a block needs pydot: {INSTALL_PYDOT}") from None

    g: nx.DiGraph[str] = nx.DiGraph(name=after.name)
    g.graph["graph"] = {"rankdir": "TB", "fontname": "Helvetica", "newrank": "true"}
    g.graph["node"] = {"fontname": "Helvetica", "fontsize": "10"}
    _side(g, before, "before")
    _side(g, after, "after")
    launches = plan.launches if plan else ()
    placed: set[str] = set()
    members: list[list[str]] = []
    for i, launch in enumerate(launches):
        covered = [
            f"after/{n}" for n in dict.fromkeys((*launch.nodes, *launch.outputs)) if n in after
        ]
        mine = [n for n in covered if n not in placed]
        placed.update(mine)
        if not mine:  # a twin: the nodes are in an earlier launch's box
            note = f"launch/{i}"
            g.add_node(note, label=f"same nodes\\n{_when(launch)}", shape="note")
            for n in covered:
                g.add_edge(note, n, style="dashed", arrowhead="none")
            mine = [note]
        members.append(mine)
    dot = nx.nx_pydot.to_pydot(g)
    sides: dict[str, pydot.Subgraph] = {}
    for side, graph, title in (
        ("before", before, "before passes"),
        ("after", after, f"after passes: {len(launches)} launches" if plan else "after passes"),
    ):
        cluster = pydot.Subgraph(f"cluster_{side}", label=title, fontname="Helvetica")
        for name in graph.order():
            if f"{side}/{name}" not in placed:
                cluster.add_node(pydot.Node(f"{side}/{name}"))
        sides[side] = cluster
        dot.add_subgraph(cluster)
    for i, (launch, mine) in enumerate(zip(launches, members, strict=True)):
        title = "\\n".join(x for x in (launch.kernel.name, _when(launch)) if x)
        box = pydot.Subgraph(f"cluster_launch_{i}", label=title, style="dashed", fontsize="9")
        for n in mine:
            box.add_node(pydot.Node(n))
        sides["after"].add_subgraph(box)
    text: str = dot.to_string()
    return text


def dot_available() -> bool:
    return shutil.which("dot") is not None


def render_dot(text: str, fmt: str) -> bytes:
    """Graphviz's rendering of DOT `text` as `fmt` (svg, png)."""
    exe = shutil.which("dot")
    if exe is None:
        raise UsageError(f"Graphviz's dot is not installed; {INSTALL}")
    done = subprocess.run(
        [exe, f"-T{fmt}"], input=text.encode(), capture_output=True, check=False, timeout=300
    )
    if done.returncode != 0:
        raise UsageError(f"dot -T{fmt} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def write(text: str, out: Path) -> tuple[list[Path], str | None]:
    """Write DOT `text` as `out` (.dot, .svg, .png). Returns the files written and, when `out`
    needs Graphviz and it is missing, a line saying so (the .dot beside `out` is written)."""
    suffix = out.suffix.lower()
    if suffix not in SUFFIXES:
        raise UsageError(f"--out {out}: write a {', '.join(SUFFIXES)} file")
    if suffix == ".dot":
        out.write_text(text)
        return [out], None
    if not dot_available():
        dot = out.with_suffix(".dot")
        dot.write_text(text)
        return [dot], f"wrote {dot} but not {out}: Graphviz's dot is missing; {INSTALL}"
    out.write_bytes(render_dot(text, suffix[1:]))
    return [out], None


def draw(
    before: Graph, after: Graph, plan: Plan | None, out: Path
) -> tuple[list[Path], str | None]:
    """`to_dot` written as `out` (see `write`)."""
    return write(to_dot(before, after, plan), out)


def svg(before: Graph, after: Graph, plan: Plan | None) -> str | None:
    """The picture as SVG text, or None without Graphviz or pydot."""
    if not dot_available() or importlib.util.find_spec("pydot") is None:
        return None
    return render_dot(to_dot(before, after, plan), "svg").decode()
