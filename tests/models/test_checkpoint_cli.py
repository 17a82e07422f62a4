"""Every rule of a strict checkpoint reaches the user of every command that opens a checkpoint
as exit code 2 and one line on stderr, with no traceback, and the checkpoint stays as it was.

One crafted copy of a real fixture per rule (work happens on copies in tmp_path, never on
tests/data); the table's ids are the rules of docs/checkpoints.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qir import cli

DATA = Path(__file__).resolve().parents[1] / "data"
MLX = DATA / "mlx_affine4_g64_S"  # has an index naming its one model.safetensors
INDEX = "model.safetensors.index.json"
TENSOR = "model.layers.0.mlp.up_proj.scales"


def _copy(dst: Path) -> Path:
    dst.mkdir()
    for f in MLX.iterdir():
        if f.suffix in (".json", ".safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


def _header(ck: Path) -> tuple[dict[str, Any], bytes]:
    raw = (ck / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(ck: Path, header: bytes | dict[str, Any], data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    (ck / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data)


def _edit_header(
    edit: Callable[[dict[str, Any]], object], extra: bytes = b""
) -> Callable[[Path], None]:
    def craft(ck: Path) -> None:
        header, data = _header(ck)
        edit(header)
        _write(ck, header, data + extra)

    return craft


def _by_offset(h: dict[str, Any]) -> list[str]:
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])


def _overlap(h: dict[str, Any]) -> None:
    second = _by_offset(h)[1]
    begin, end = h[second]["data_offsets"]
    h[second]["data_offsets"] = [begin - 2, end - 2]


def _hole(h: dict[str, Any]) -> None:
    h.pop(_by_offset(h)[1])


def _edit_index(edit: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    def craft(ck: Path) -> None:
        index = json.loads((ck / INDEX).read_text())
        edit(index["weight_map"])
        (ck / INDEX).write_text(json.dumps(index))

    return craft


def _edit_config(edit: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    def craft(ck: Path) -> None:
        config = json.loads((ck / "config.json").read_text())
        edit(config)
        (ck / "config.json").write_text(json.dumps(config))

    return craft


def _text(name: str, raw: bytes) -> Callable[[Path], None]:
    return lambda ck: (ck / name).write_bytes(raw)


def _shard_outside(ck: Path) -> None:
    shutil.copy(ck / "model.safetensors", ck.parent / "elsewhere.safetensors")
    (ck / "link.safetensors").symlink_to(ck.parent / "elsewhere.safetensors")
    _edit_index(lambda wm: wm.update({TENSOR: "link.safetensors"}))(ck)


def _two_copies(ck: Path) -> None:
    shutil.copy(ck / "model.safetensors", ck / "copy.safetensors")
    _edit_index(lambda wm: wm.update({TENSOR: "copy.safetensors"}))(ck)


DEEP = b"[" * 100_000

# rule -> (how to break a copy of the fixture, what the one line must say)
RULES: dict[str, tuple[Callable[[Path], None], str]] = {
    # model.safetensors
    "header nested 100000 deep": (lambda ck: _write(ck, DEEP, b""), "safetensors header: not JSON"),
    "header not UTF-8": (lambda ck: _write(ck, b'{"\xff": 1}', b""), "not UTF-8"),
    "header length past the file": (
        lambda ck: (ck / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}"),
        "bad safetensors header length 1099511627776",
    ),
    "data_offsets as floats": (
        _edit_header(
            lambda h: h[TENSOR].update(data_offsets=[float(o) for o in h[TENSOR]["data_offsets"]])
        ),
        f"tensor '{TENSOR}': data_offsets [",
    ),
    "three data_offsets": (
        _edit_header(lambda h: h[TENSOR]["data_offsets"].append(0)),
        f"tensor '{TENSOR}': data_offsets",
    ),
    "shape of booleans": (
        _edit_header(lambda h: h[TENSOR].update(shape=[True] * 2)),
        f"tensor '{TENSOR}': shape [true, true]",
    ),
    "entry without dtype": (
        _edit_header(lambda h: h[TENSOR].pop("dtype")),
        f"'{TENSOR}': no dtype",
    ),
    "unknown dtype": (_edit_header(lambda h: h[TENSOR].update(dtype="I4")), 'dtype "I4"'),
    "shape disagrees with bytes": (
        _edit_header(lambda h: h[TENSOR].update(shape=[512, 5])),
        f"tensor '{TENSOR}' has 4096 bytes, but BF16 [512, 5] needs 5120",
    ),
    "overlapping tensors": (_edit_header(_overlap), "overlaps tensor"),
    "hole between tensors": (_edit_header(_hole), "leaves a hole of"),
    "bytes after the last tensor": (
        _edit_header(lambda h: None, b"\0" * 4),
        "4 byte(s) after the last",
    ),
    "truncated data": (
        lambda ck: (ck / "model.safetensors").write_bytes(
            (ck / "model.safetensors").read_bytes()[:-9]
        ),
        "truncated: tensor",
    ),
    "__metadata__ not strings": (
        _edit_header(lambda h: h.update(__metadata__={"format": 1})),
        '__metadata__ is {"format": 1}, expected an object of strings',
    ),
    # the index and the directory
    "index shard ../": (
        _edit_index(lambda wm: wm.update({TENSOR: "../mlx/model.safetensors"})),
        "'../mlx/model.safetensors' has a '..' path component",
    ),
    "index shard absolute": (
        _edit_index(lambda wm: wm.update({TENSOR: str(MLX / "model.safetensors")})),
        "is not a relative file name inside the checkpoint",
    ),
    "index shard not a string": (
        _edit_index(lambda wm: wm.update({TENSOR: 3})),
        "is 3, expected a file name",
    ),
    "shard symlink leading outside": (_shard_outside, "outside the checkpoint directory"),
    "shard missing": (
        _edit_index(lambda wm: wm.update({TENSOR: "model-00002-of-00002.safetensors"})),
        "model-00002-of-00002.safetensors: shard listed in model.safetensors.index.json is missing",
    ),
    "index names a tensor the shard lacks": (
        _edit_index(lambda wm: wm.update({"model.extra.weight": "model.safetensors"})),
        "model.safetensors: no tensor 'model.extra.weight' (the index says it is there)",
    ),
    "tensor in a shard the index puts elsewhere": (_two_copies, "(two copies)"),
    "index nested 100000 deep": (_text(INDEX, DEEP), "model.safetensors.index.json: not JSON"),
    # config.json
    "config nested 100000 deep": (_text("config.json", DEEP), "config.json: not JSON"),
    "config not UTF-8": (
        _text("config.json", '{"a": 1}'.encode("utf-16")),
        "config.json: not UTF-8",
    ),
    "config not an object": (_text("config.json", b"[]"), "config.json: not a JSON object"),
    "config key twice": (
        _text("config.json", b'{"hidden_size": 256, "hidden_size": 256}'),
        "key 'hidden_size' appears twice",
    ),
    "num_hidden_layers -1": (
        _edit_config(lambda c: c.update(num_hidden_layers=-1)),
        "config.json: num_hidden_layers is -1, expected an integer >= 1",
    ),
    "hidden_size a string": (
        _edit_config(lambda c: c.update(hidden_size="256")),
        "config.json: hidden_size is '256', expected an integer >= 1",
    ),
    "quantization mode not a string": (
        _edit_config(lambda c: c["quantization"].update(mode=["affine"])),
        "config.json: quantization.mode is ['affine'], expected a string",
    ),
}


def _snapshot(ck: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for p in sorted(ck.rglob("*")):
        rel = str(p.relative_to(ck))
        out[rel] = (
            f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
        )
    return out


def _commands(ck: Path, out: Path) -> dict[str, list[str]]:
    x = out / "x.npy"
    np.save(x, np.zeros((1, 256), np.float16))
    return {
        "inspect": ["inspect", str(ck)],
        "dequant": ["dequant", str(ck), "model.layers.0.mlp.up_proj", "-o", str(out / "w.npy")],
        "compile": ["compile", str(ck), "--block", "mlp", "--json", str(out / "plan.json")],
        "dump": ["dump", str(ck), "--block", "qkv", "--out", str(out / "dump")],
        "run": ["run", str(ck), "--block", "mlp", "--input", str(x), "--out", str(out / "y.npz")],
        "demo": ["demo", "--backend", "host"],
        "cache warm": ["cache", "warm", str(ck), "--host"],
    }


@pytest.mark.parametrize("rule", list(RULES))
def test_every_command_refuses_in_one_line(
    tmp_path: Path, rule: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    craft, message = RULES[rule]
    ck = _copy(tmp_path / "ck")
    craft(ck)
    before = _snapshot(ck)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("QIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cli.demo, "embedded_checkpoints", lambda: [ck])  # what demo opens
    for command, argv in _commands(ck, out).items():
        code = cli.main(["-q", *argv])
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert code == 2, (command, captured.err)
        assert len(lines) == 1 and lines[0].startswith("qir: error: "), (command, captured.err)
        assert message in lines[0], (command, lines[0])
        assert captured.out == "", command
        assert _snapshot(ck) == before, command


def test_fixture_opens_with_every_command_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The unbroken copy passes the same checks (the table's refusals come from the rules)."""
    ck = _copy(tmp_path / "ck")
    before = _snapshot(ck)
    out = tmp_path / "out"
    out.mkdir()
    for command in ("inspect", "dequant", "compile"):
        assert cli.main(["-q", *_commands(ck, out)[command]]) == 0, command
        assert capsys.readouterr().err == ""
    assert _snapshot(ck) == before


@pytest.mark.parametrize(
    ("rule", "command"),
    [("header nested 100000 deep", "inspect"), ("config nested 100000 deep", "run")],
)
def test_deep_nesting_in_a_real_process(tmp_path: Path, rule: str, command: str) -> None:
    """The issue's report: `qir inspect` and `qir run --backend reference` on deeply nested JSON
    ended in a RecursionError traceback."""
    ck = _copy(tmp_path / "ck")
    RULES[rule][0](ck)
    argv = _commands(ck, tmp_path)[command]
    if command == "run":
        argv += ["--backend", "reference"]
    r = subprocess.run(
        [sys.executable, "-m", "qir.cli", *argv], capture_output=True, text=True, check=False
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and RULES[rule][1] in r.stderr
