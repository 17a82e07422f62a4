"""`qir generate --prompt/--chat` and `qir chat`: text streamed to stdout, the same as the
Python API, and one-line errors (exit 2) for what text cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qir.cli import main
from qir.models import Model
from tests.text.conftest import BYTE_LEVEL, SENTENCEPIECE, copy_checkpoint

REF = ["--backend", "reference"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["-q", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_prompt_prints_the_apis_text(capsys, tmp_path: Path) -> None:
    options = ["--max-new-tokens", "10", "--temperature", "0.9", "--seed", "5", "--ignore-eos"]
    out_npz = tmp_path / "g.npz"
    code, out, err = run(
        capsys,
        "generate",
        str(SENTENCEPIECE),
        "--prompt",
        "Hello",
        *options,
        *REF,
        "--stats",
        "--out",
        str(out_npz),
    )
    assert code == 0
    model = Model.load(SENTENCEPIECE)
    want = model.generate("Hello", 10, temperature=0.9, seed=5, ignore_eos=True)
    assert out == want + "\n"
    prompt = len(model.tokenizer.encode("Hello"))
    assert f"prompt {prompt} tokens" in err and "10 generated" in err and "seed 5" in err
    saved = np.load(out_npz)
    assert saved["tokens"].tolist() == model.last.tokens.tolist()
    assert saved["logits"].shape == (10, 256) and saved["logits"].dtype == np.float32


def test_generate_chat_with_a_system_message(capsys) -> None:
    argv = ["generate", str(BYTE_LEVEL), "--chat", "Hi!", "--system", "Be brief.", "--greedy"]
    code, out, _ = run(capsys, *argv, "--max-new-tokens", "6", *REF)
    assert code == 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert out == Model.load(BYTE_LEVEL).chat(messages, 6, do_sample=False) + "\n"


def test_chat_keeps_the_conversation_between_turns(tmp_path: Path) -> None:
    script = "What is the capital of France?\nThanks!\n/reset\nHello\n/exit\nnever read\n"
    argv = [sys.executable, "-m", "qir.cli", "-q", "chat", str(BYTE_LEVEL), "--greedy"]
    argv += ["--max-new-tokens", "4", "--stats", "--backend", "reference"]
    done = subprocess.run(argv, input=script, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    replies = done.stdout.splitlines()
    stats = [line for line in done.stderr.splitlines() if line.startswith("qir: prompt")]
    assert len(replies) == 3 and len(stats) == 3
    assert "cached" not in stats[0] and "cached" in stats[1]  # turn 2 reuses turn 1's rows
    assert "conversation reset" in done.stderr and "cached" not in stats[2].split("tokens")[0]
    model = Model.load(BYTE_LEVEL)
    first = [{"role": "user", "content": "What is the capital of France?"}]
    assert replies[0] == model.chat(first, 4, do_sample=False)
    assert replies[2] == model.chat([{"role": "user", "content": "Hello"}], 4, do_sample=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "x", "--tokens", "1"], "give one of --prompt TEXT, --chat TEXT or --tokens"),
        (["--prompt", "x", "--system", "s"], "--system goes with --chat"),
        (["--tokens", "1,2", "--stop", "x"], "--stop takes text"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be a number >= 0, got -1"),
        (["--prompt", "x", "--top-p", "0"], r"top_p must be a number in (0, 1], got 0.0"),
        (["--prompt", "x" * 400], "is past --max-seq"),
        (["--chat", "x", "--template", "nope"], "no chat template 'nope'"),
    ],
)
def test_generate_refuses_in_one_line(capsys, argv: list[str], message: str) -> None:
    code, out, err = run(capsys, "generate", str(BYTE_LEVEL), *argv, "--max-new-tokens", "2", *REF)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("qir: error: ")
    assert message in lines[0] and out == ""


def test_text_needs_the_tokenizer_and_the_template(capsys, tmp_path: Path) -> None:
    ck = copy_checkpoint(SENTENCEPIECE, tmp_path / "ck")
    (ck / "chat_template.jinja").write_text("{{ raise_exception('this model does not chat') }}")
    code, _, err = run(capsys, "generate", str(ck), "--chat", "hi", "--max-new-tokens", "2", *REF)
    assert code == 2 and "this model does not chat" in err and len(err.splitlines()) == 1
    (ck / "chat_template.jinja").unlink()
    code, _, err = run(capsys, "chat", str(ck), *REF)
    assert code == 2 and "no chat template" in err
    (ck / "tokenizer.json").unlink()
    code, _, err = run(capsys, "generate", str(ck), "--prompt", "hi", "--max-new-tokens", "2", *REF)
    assert code == 2 and "no tokenizer.json" in err and "--tokens" in err
    code, out, _ = run(
        capsys, "generate", str(ck), "--tokens", "1,2", "--max-new-tokens", "2", *REF
    )
    assert code == 0 and len(out.split()) == 2


def test_fields_qir_does_not_apply_are_named(capsys, tmp_path: Path) -> None:
    ck = copy_checkpoint(BYTE_LEVEL, tmp_path / "ck")
    (ck / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    code, _, err = run(capsys, "generate", str(ck), "--prompt", "hi", "--max-new-tokens", "1", *REF)
    assert code == 0 and "sets repetition_penalty=1.1, which qir does not apply" in err


def test_a_chat_turn_past_max_seq_is_refused_and_the_chat_goes_on(tmp_path: Path) -> None:
    script = "The quick brown fox jumps over the lazy dog, twice over.\nHi\n"
    argv = [sys.executable, "-m", "qir.cli", "-q", "chat", str(BYTE_LEVEL), "--greedy"]
    argv += ["--max-new-tokens", "2", "--max-seq", "24", "--backend", "reference"]
    done = subprocess.run(argv, input=script, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "is past --max-seq 24 (/reset starts over)" in done.stderr
    assert len(done.stdout.splitlines()) == 1  # the second turn's reply
