"""No import circles in qir (issue 34): no module imports, at any depth or lazily, one that
imports it back. Read from the source with `ast`, so a function-local import, an import under
`if TYPE_CHECKING:` and a registry's `importlib.import_module` all count: a circle that only a
lazy import holds open is still a circle in the design."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qir"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def children(known: dict[str, Path], package: str) -> set[str]:
    """The direct submodules of `package` (what pkgutil.iter_modules(__path__) walks)."""
    return {m for m in known if m.rpartition(".")[0] == package}


def known_prefix(known: dict[str, Path], dotted: str) -> str | None:
    """The longest module `dotted` names: `import qir.a.b` imports qir.a.b (its packages run
    too, but that is Python's doing, not an edge of the design)."""
    while dotted:
        if dotted in known:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def dynamic_targets(known: dict[str, Path], name: str, tree: ast.Module) -> set[str]:
    """What `importlib.import_module(...)` calls in a module load: a literal names its module; an
    f-string on `__name__` (a registry walking its package) loads every submodule; one on a
    literal prefix (`f"qir.cli.{group}"`) the submodules under it that the module's string
    constants name (the command table's groups); a variable any qir module those constants name
    (qir/__init__'s lazy `__getattr__` table)."""
    constants = {
        c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str)
    }
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
    ]
    out: set[str] = set()
    for call in calls:
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            target = known_prefix(known, arg.value)
            if target is not None:
                out.add(target)
        elif isinstance(arg, ast.JoinedStr) and arg.values:
            head = arg.values[0]
            if (
                isinstance(head, ast.FormattedValue)
                and isinstance(head.value, ast.Name)
                and head.value.id == "__name__"
            ):
                out |= children(known, name)
            elif isinstance(head, ast.Constant) and isinstance(head.value, str):
                under = children(known, head.value.rstrip("."))
                out |= {m for m in under if m.rpartition(".")[2] in constants}
        else:
            out |= constants & set(known)
    out.discard(name)
    return out


def imports_of(known: dict[str, Path], name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if is_package(path) else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = known_prefix(known, alias.name)
                if target is not None:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                # `from qir.x import y` imports the submodule qir.x.y where there is one
                target = known_prefix(known, f"{source}.{alias.name}")
                if target is not None:
                    out.add(target)
    out |= dynamic_targets(known, name, tree)
    out.discard(name)
    return out


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in known.items():
        graph.add_edges_from((name, target) for target in imports_of(known, name, path))
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """One shortest cycle through each module that is on a cycle, shortest first (a strongly
    connected component can hold very many simple cycles; these name every module in one)."""
    found: set[tuple[str, ...]] = set()
    for component in nx.strongly_connected_components(graph):
        if len(component) < 2:
            continue
        sub = graph.subgraph(component)
        for start in sorted(component):
            best: list[str] | None = None
            for pred in sub.predecessors(start):
                path = nx.shortest_path(sub, start, pred)
                if best is None or len(path) < len(best):
                    best = path
            assert best is not None
            turn = best.index(min(best))  # the same cycle found from another start is one
            found.add(tuple(best[turn:] + best[:turn]))
    return sorted((list(c) for c in found), key=lambda c: (len(c), c))


def spell(cycle: list[str]) -> str:
    return " -> ".join([*cycle, cycle[0]])


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(map(spell, found))


# qir/models/ in layers, each importing only its own and those before it (docs/architecture.md).
MODELS_LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "io",
        frozenset(
            {
                "strict_json",
                "checkpoint_dir",
                "safetensors_io",
                "gguf_io",
                "config_fields",
                "multimodal",
                "goldens",
                "checkpoint_view",
            }
        ),
    ),
    ("quantization conventions", frozenset({"quant_conventions"})),
    (
        "checkpoint, architectures, MoE weights",
        frozenset(
            {"architectures", "checkpoint", "experts", "gguf_config", "gguf_checkpoint", "loader"}
        ),
    ),
    ("block builders", frozenset({"blocks"})),
    ("sharding", frozenset({"shards", "shard_read"})),
    ("model", frozenset({"model"})),
)


def models_layer(module: str) -> int:
    """The index in MODELS_LAYERS of a module under qir.models (a package's submodules are in
    the package's layer); the package itself re-exports, so it sits above them all."""
    if module == "qir.models":
        return len(MODELS_LAYERS)
    top = module.removeprefix("qir.models.").split(".")[0]
    index = next((i for i, (_, names) in enumerate(MODELS_LAYERS) if top in names), None)
    assert index is not None, f"{module}: not in MODELS_LAYERS; place it in its layer"
    return index


def test_models_import_only_their_own_layer_and_those_before() -> None:
    graph = import_graph()
    upward = [
        f"{u} ({MODELS_LAYERS[models_layer(u)][0]}) imports {v} "
        f"({MODELS_LAYERS[models_layer(v)][0]})"
        for u, v in sorted(graph.edges)
        if u.startswith("qir.models")
        and v.startswith("qir.models.")
        and models_layer(v) > models_layer(u)
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # a lazy (function-local) import is an edge
        ("def f():\n    from qir.b import x\n", {"qir.b"}),
        # so is one only the type checker runs
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import qir.b\n", {"qir.b"}),
        # `from package import submodule` is an edge to the submodule, not to the package
        ("from qir.p import m\n", {"qir.p.m"}),
        ("from qir.p import name\n", {"qir.p"}),
        ("from .b import x\n", {"qir.b"}),
        ("from .p import m\n", {"qir.p.m"}),
        # a registry loading its plugins by name
        ("import importlib\nimportlib.import_module('qir.b')\n", {"qir.b"}),
        ("import importlib\nT = {'x': 'qir.b'}\nimportlib.import_module(T['x'])\n", {"qir.b"}),
        ("import importlib\nG = ['m']\nimportlib.import_module(f'qir.p.{G[0]}')\n", {"qir.p.m"}),
        ("import importlib\nG = ['n']\nimportlib.import_module(f'qir.p.{G[0]}')\n", set()),
    ],
)
def test_edges_are_read_from_every_kind_of_import(
    tmp_path: Path, source: str, expected: set[str]
) -> None:
    known = {m: tmp_path / f"{m}.py" for m in ("qir", "qir.a", "qir.b", "qir.p", "qir.p.m")}
    path = tmp_path / "a.py"
    path.write_text(source)
    assert imports_of(known, "qir.a", path) == expected


def test_a_cycle_fails_and_is_reported_shortest_first() -> None:
    graph = nx.DiGraph(
        [("a", "b"), ("b", "c"), ("c", "a"), ("x", "y"), ("y", "x"), ("c", "d"), ("d", "d")]
    )
    assert [spell(c) for c in cycles(graph)] == ["x -> y -> x", "a -> b -> c -> a"]
