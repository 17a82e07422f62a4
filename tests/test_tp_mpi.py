"""`--tp N`: ranks as MPI processes (mpiexec from the mpich wheel). The CLI's logits and greedy
ids equal --tp 1, a split that cannot be made is refused with exit 2, and a rank that hangs or
dies ends the others (a collective's timeout) instead of hanging the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from tests.conftest import DATA

QIR = [sys.executable, "-m", "qir.cli"]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
COMMON = ["--backend", "host", "--act-dtype", "f32", "--max-seq", "32"]


def _qir(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QIR, *argv], capture_output=True, text=True, timeout=timeout)


def test_generate_and_run_on_mpi_ranks_equal_one_rank(tmp_path):
    """An AWQ checkpoint whose down_proj has 5 groups of 64 (as the issue's 1408 is 11 groups
    of 128): 3 + 2 groups on 2 ranks, 2 + 1 + 1 + 1 on 4."""
    from tests.tp_checkpoints import trimmed

    ck = str(trimmed(tmp_path / "awq", "awq_gemm_g64_S", 320))
    gen = ["generate", ck, "--tokens", "3,10,17,24,31", "--max-new-tokens", "3", "--greedy"]
    outs = {}
    for n in (1, 2, 4):
        out = tmp_path / f"g{n}.npz"
        p = _qir(*gen, *COMMON, "--tp", str(n), "--out", str(out))
        assert p.returncode == 0, p.stderr
        assert p.stdout.count("wrote ") == 1  # rank 0 alone prints
        outs[n] = np.load(out)
    for n in (2, 4):
        np.testing.assert_array_equal(outs[n]["tokens"], outs[1]["tokens"])
        ref = outs[1]["logits"]
        assert np.abs(outs[n]["logits"] - ref).max() / np.abs(ref).max() <= 1e-5
    run = ["run", ck, "--block", "model", "--tokens", "3,10,17", *COMMON]
    p = _qir(*run, "--tp", "2", "--out", str(tmp_path / "r2.npz"))
    assert p.returncode == 0, p.stderr
    q = _qir(*run, "--out", str(tmp_path / "r1.npz"))
    a, b = np.load(tmp_path / "r1.npz")["logits"], np.load(tmp_path / "r2.npz")["logits"]
    assert np.abs(a - b).max() / np.abs(a).max() <= 1e-5, q.stderr


def test_gptoss_on_two_mpi_ranks_equals_one_rank(tmp_path):
    """Sinks, biases, MXFP4 experts and sliding windows (a prompt past the window of 8)."""
    from qir.dtypes import F32
    from qir.models import Model

    ck = DATA / "gptoss_mxfp4"
    tokens = list(range(3, 13))
    gen = ["generate", str(ck), "--tokens", ",".join(map(str, tokens)), "--max-new-tokens", "3"]
    p = _qir(*gen, "--greedy", *COMMON, "--tp", "2", "--out", str(tmp_path / "g2.npz"))
    assert p.returncode == 0, p.stderr
    two = np.load(tmp_path / "g2.npz")
    one = Model.load(ck, backend="host", act=F32, max_seq=32).generate(tokens, 3, do_sample=False)
    np.testing.assert_array_equal(two["tokens"], one.tokens)
    assert np.abs(two["logits"] - one.logits).max() / np.abs(one.logits).max() <= 1e-5


def test_chat_on_two_mpi_ranks_answers_as_one_rank():
    """Rank 0 reads the piped stdin and broadcasts each line; every rank runs the turns (the
    conversation kept between them, /reset, /exit) and rank 0 alone prints."""
    from qir.dtypes import F32
    from qir.models import Model

    ck = DATA / "awq_gemm_g64_S"  # a byte-level BPE tokenizer and a ChatML template
    script = "What is the capital of France?\nThanks!\n/reset\nHello\n/exit\nnever read\n"
    argv = [*QIR, "-q", "chat", str(ck), "--max-new-tokens", "4", "--stats"]
    argv += ["--backend", "reference", "--act-dtype", "f32", "--tp", "2"]
    model = Model.load(ck, act=F32)
    for sampling, options in (
        ({"do_sample": False}, ["--greedy"]),
        ({"temperature": 1.5, "seed": 5}, ["--temperature", "1.5", "--seed", "5"]),
    ):
        done = subprocess.run(
            [*argv, *options], input=script, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        replies = done.stdout.splitlines()
        stats = [line for line in done.stderr.splitlines() if line.startswith("qir: prompt")]
        assert len(replies) == 3 and len(stats) == 3  # one rank speaks
        assert done.stderr.count("conversation reset") == 1
        assert "cached" in stats[1]  # turn 2 reused turn 1's rows on every rank
        model.reset()
        first = [{"role": "user", "content": "What is the capital of France?"}]
        assert replies[0] == model.chat(first, 4, **sampling)
        first += [
            {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": "Thanks!"},
        ]
        assert replies[1] == model.chat(first, 4, **sampling)
        model.reset()
        assert replies[2] == model.chat([{"role": "user", "content": "Hello"}], 4, **sampling)


def test_a_split_that_cannot_be_made_is_refused():
    ck = str(DATA / "autogptq_g64_llama")
    p = _qir("generate", ck, "--tokens", "3", "--max-new-tokens", "1", *COMMON, "--tp", "3")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 3  # one line per rank, each naming itself
    for r in range(3):
        assert (
            f"qir: error: rank {r}: tensor_parallel: %l0.attn has 4 heads and 2 KV heads; "
            "3 ranks must be at most the KV heads or a multiple of them" in p.stderr
        )


RANK = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from qir.collectives import all_reduce
    from qir.runtime.collectives import MpiComm

    comm = MpiComm(timeout=120)  # the ranks start at their own pace on a loaded machine
    x = np.ones(4, np.float32)
    assert all_reduce(comm, x, "warm-up").tolist() == [comm.size] * 4
    comm.timeout = float(sys.argv[2])
    if comm.rank == 1:
        if sys.argv[1] == "hang":
            time.sleep(60)
        os._exit(3)
    all_reduce(comm, x, "%l0.o.all_reduce")
    """
)


def _job(tmp_path: Path, what: str) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    t0 = time.perf_counter()
    p = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(script), what, "1.5"],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    return p, time.perf_counter() - t0


def test_a_rank_that_hangs_makes_the_others_exit_with_a_message(tmp_path):
    p, seconds = _job(tmp_path, "hang")
    assert p.returncode != 0
    assert (
        "qir: error: rank 0: %l0.o.all_reduce timed out after 1.5 s waiting for the other 1 "
        "rank(s) (one died or hangs)" in p.stderr
    )
    assert seconds < 40  # not rank 1's 60 s sleep


def test_a_rank_that_dies_ends_the_job(tmp_path):
    p, seconds = _job(tmp_path, "die")
    assert p.returncode != 0
    assert seconds < 40


def test_compile_reports_each_ranks_bytes_and_collectives(tmp_path, capsys):
    from qir.cli import main
    from qir.models import load
    from qir.models.blocks import build

    ck = DATA / "autogptq_g64_llama"  # 2 layers, hidden 256, vocab 256, 2 KV heads, biases
    argv = ["-q", "compile", str(ck), "--block", "model", "--act-dtype", "f32", "--max-seq", "32"]
    assert main([*argv, "--m", "1", "--json", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())["memory"]
    assert main([*argv, "--tp", "2", "--json", str(tmp_path / "tp.json")]) == 0
    report = json.loads((tmp_path / "tp.json").read_text())
    assert report["tp"] == 2 and len(report["ranks"]) == 2
    b = build(load(ck), "model", 0)
    graph = b.graph
    embed = sum(a.nbytes for a in b.weights["model.embed_tokens"].values())
    norms = sum(
        graph.node(w).type.shape[0] * 2
        for w in graph.weights
        if graph.node(w).op == "weight" and not hasattr(graph.node(w).type, "format")
    )
    row_biases = 4 * 256 * 4  # o_proj and down_proj of 2 layers, f32: kept on rank 0 only
    mems = [r["memory"] for r in report["ranks"]]
    # the sharded weights split in two (row-parallel biases on rank 0 alone), the replicated
    # ones (embedding, norms) on both
    assert sum(m["weights_bytes"] for m in mems) == one["weights_bytes"] + embed + norms
    assert mems[0]["weights_bytes"] - mems[1]["weights_bytes"] == row_biases
    for r, rank in enumerate(report["ranks"]):
        assert rank["graph"] == f"model.rank{r}of2"
        assert rank["memory"]["kv_cache_bytes"] == one["kv_cache_bytes"] // 2  # 1 KV head each
        ops = [c["op"] for c in rank["collectives"]]
        assert ops == ["all_reduce"] * 4 + ["all_gather"]
        # 4 all_reduces of a 256-float row, 1 all_gather of a rank's 128 logits
        assert rank["collective_bytes_per_token"] == {"payload": 4 * 1024 + 512, "sent": 4608}
        assert rank["k_parts"] == [  # o_proj's and down_proj's inputs: 128 of 256, 256 of 512
            {"inputs": [128 * r, 128 * (r + 1)], "of": 256, "linears": ["o_proj"]},
            {"inputs": [256 * r, 256 * (r + 1)], "of": 512, "linears": ["down_proj"]},
        ]
    err = capsys.readouterr().err
    assert "rank 1/2: weights" in err and "5 collectives move 4608 B per token" in err
    assert "K parts 128..256 of 256 (o_proj), 256..512 of 512 (down_proj)" in err
    # 5 groups of 64 in down_proj: 3 on rank 0, 2 on rank 1, and gate/up's rows with them
    from tests.tp_checkpoints import trimmed

    awq = str(trimmed(tmp_path / "awq", "awq_gemm_g64_S", 320))
    argv[2] = awq
    assert main([*argv, "--tp", "2", "--json", str(tmp_path / "awq.json")]) == 0
    ranks = json.loads((tmp_path / "awq.json").read_text())["ranks"]
    assert [r["k_parts"][1]["inputs"] for r in ranks] == [[0, 192], [192, 320]]
    assert ranks[0]["memory"]["weights_bytes"] > ranks[1]["memory"]["weights_bytes"]
    assert "K parts 0..128 of 256 (o_proj), 0..192 of 320 (down_proj)" in capsys.readouterr().err


def test_graph_and_dump_show_one_ranks_part(tmp_path):
    from qir.cli import main

    ck = str(DATA / "autogptq_g64_llama")
    argv = ["-q", "dump", ck, "--block", "layer", "--tp", "2", "--rank", "1"]
    assert main([*argv, "--out", str(tmp_path / "d")]) == 0
    before = (tmp_path / "d" / "before.ir").read_text()
    assert before.startswith("graph layer.rank1of2 {")
    assert before.count("= all_reduce") == 2
    note = (tmp_path / "d" / "all_reduce_f16_n256_r2.cu").read_text()
    assert "run by the block's communicator" in note
    assert (
        main(
            [
                "-q",
                "dump",
                ck,
                "--block",
                "layer",
                "--tp",
                "2",
                "--rank",
                "2",
                "--out",
                str(tmp_path / "e"),
            ]
        )
        == 2
    )
