"""`qir graph` and Compiled.draw: the block before and after the passes, one box per launch of
the plan `qir compile` prints, as DOT that networkx reads back, and as SVG/PNG through
Graphviz's dot where it is installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

import qir
from qir import draw
from qir.cli import main
from qir.models import load
from qir.models.blocks import build
from qir.passes.manager import run_pipeline
from qir.types import QWeight
from tests.conftest import DATA
from tests.requires import import_or_skip, requires

pydot = import_or_skip("pydot", "pydot")
NEEDS_DOT = requires("dot")
# W4A4: quantize_act launches and 16-bit twins (two launches of one node)
CKPT = DATA / "ct_nvfp4_w4a4_S"


def clusters(dot: pydot.Dot) -> list[pydot.Subgraph]:
    """Every subgraph named cluster_launch_*, depth first in file order."""
    found = []
    work = list(reversed(dot.get_subgraph_list()))
    while work:
        sub = work.pop()
        if sub.get_name().strip('"').startswith("cluster_launch_"):
            found.append(sub)
        work.extend(reversed(sub.get_subgraph_list()))
    return found


@pytest.mark.parametrize("block", ["mlp", "qkv"])
def test_dot_reads_back_with_one_cluster_per_launch_of_the_plan(tmp_path: Path, block: str):
    args = [str(CKPT), "--block", block, "--layer", "0"]
    assert main(["compile", *args, "--json", str(tmp_path / "plan.json")]) == 0
    kernels = [k["name"] for k in json.loads((tmp_path / "plan.json").read_text())["kernels"]]
    assert main(["graph", *args, "--out", str(tmp_path / "g.dot")]) == 0

    g = nx.nx_pydot.read_dot(tmp_path / "g.dot")
    b = build(load(CKPT), block, 0)
    after, _ = run_pipeline(b.graph)
    for side, graph in (("before", b.graph), ("after", after)):
        drawn = {n.split("/", 1)[1] for n in g if n.startswith(f"{side}/")}
        assert drawn == set(graph.order())
        for name, node in graph.items():
            label = g.nodes[f"{side}/{name}"]["label"]
            assert f"%{name}" in label and node.op in label, label
            t = node.type
            shape = f"[{t.out_features}, {t.in_features}]" if isinstance(t, QWeight) else str(t)
            assert shape in label, label
            if isinstance(t, QWeight) or node.op == "qlinear":
                assert "nvfp4diva4" in label, label  # the format
            for o in graph.operands(name):
                assert g.has_edge(f"{side}/{o}", f"{side}/{name}")

    (parsed,) = pydot.graph_from_dot_file(str(tmp_path / "g.dot"))
    titles = [c.get_label().strip('"').split("\\n")[0] for c in clusters(parsed)]
    # per qlinear: the W4A4 GEMV (M <= 8), the W4A4 GEMM (to 64 rows), its 16-bit twin GEMM;
    # and one quantize_act per input
    assert titles == kernels and len(kernels) == (8 if block == "mlp" else 4)


@NEEDS_DOT
@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_graph_draws_svg_and_png(tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / f"g{suffix}"
    assert main(["graph", str(CKPT), "--block", "mlp", "--out", str(out)]) == 0
    data = out.read_bytes()
    if suffix == ".svg":
        text = data.decode()
        assert "<svg" in text and "qgemv_nvfp4diva4_bf16_n256_k512_m8_l4_res_a4" in text
        assert text.count('class="cluster"') == 2 + 8  # before, after, one per launch
    else:
        assert data.startswith(b"\x89PNG")
    assert capsys.readouterr().err == ""


def test_without_dot_the_dot_file_is_written_and_one_line_says_how_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(draw.shutil, "which", lambda name: None)
    assert main(["graph", str(CKPT), "--block", "qkv", "--out", str(tmp_path / "g.svg")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "apt-get install graphviz" in err[0] and "g.dot" in err[0]
    assert (tmp_path / "g.dot").read_text().startswith("strict digraph")
    assert not (tmp_path / "g.svg").exists()


def test_without_pydot_qir_imports_and_graph_says_how_to_install_it(tmp_path: Path):
    """pydot is the draw extra (the GPU machine's image lacks it): everything else runs."""
    code = (
        "import sys; sys.modules['pydot'] = None\n"  # makes `import pydot` raise ImportError
        "from qir.cli import main\n"
        f"sys.exit(main(['graph', {str(CKPT)!r}, '--block', 'qkv', '--out', {str(tmp_path / 'g.dot')!r}]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr == "qir: error: drawing a block needs pydot: pip install 'qir[draw]'\n"
    assert not (tmp_path / "g.dot").exists()


def test_an_unknown_picture_suffix_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    assert main(["graph", str(CKPT), "--block", "qkv", "--out", str(tmp_path / "g.pdf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "g.pdf" in err[0] and ".svg" in err[0]


def test_compiled_draws_itself_and_shows_in_a_notebook(tmp_path: Path):
    b = build(load(CKPT), "mlp", 0)
    c = qir.compile(b.graph, b.weights, backend="reference")
    (parsed,) = pydot.graph_from_dot_data(c.draw(tmp_path / "g.dot"))
    assert len(clusters(parsed)) == 8  # the launches a kernel backend would make
    assert (tmp_path / "g.dot").read_text() == c.draw()
    x = np.zeros((1, 256), np.float32).astype(b.graph.node("x").type.dtype.np)
    assert set(c({"x": x})) == {"y"}  # drawing changed nothing
    svg = c._repr_svg_()
    assert (svg is not None and "<svg" in svg) == draw.dot_available()
