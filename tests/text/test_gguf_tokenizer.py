"""GGUF tokenizers built from tokenizer.ggml.* against llama.cpp's own tokenizer on a corpus of
218 strings (tests/data/gguf_tokenizer_ids.json, made by tests/data/oracle/gguf_tokenizer_ids.py
with llama-cpp-python 0.3.36): the real SmolLM2 vocabulary (GPT-2 BPE, pre-tokenizer smollm,
49152 tokens), the fixtures' byte-level BPEs (llama-bpe, qwen2) and SentencePiece vocabularies
(with and without the space prefix); BOS as the vocabulary adds it, special tokens matched."""

from __future__ import annotations

import json

import pytest

from qir.cli import main
from qir.models.gguf_io import GGUFModel
from qir.text.gguf_tokenizer import build
from tests.conftest import DATA
from tests.requires import import_or_skip

smollm2 = import_or_skip("qir.cli.demo", "smollm2").smollm2
IDS = json.loads((DATA / "gguf_tokenizer_ids.json").read_text(encoding="utf-8"))
SMOLLM2 = smollm2()
VOCABS = {
    "smollm2": SMOLLM2,
    "llama": DATA / "gguf_llama" / "model-F16.gguf",  # BPE, llama-bpe
    "qwen2": DATA / "gguf_qwen2" / "model-F16.gguf",  # BPE, qwen2
    "phi3": DATA / "gguf_phi3" / "model-F16.gguf",  # SentencePiece, space prefix
    "gemma3": DATA / "gguf_gemma3" / "model-F16.gguf",  # SentencePiece, no space prefix
}


@pytest.mark.parametrize("name", VOCABS)
def test_ids_equal_llama_cpp_on_the_corpus(name):
    tok = build(GGUFModel(VOCABS[name]))
    corpus = IDS["corpus"]
    assert len(corpus) >= 200 and "" in corpus
    got = [tok.encode(s) for s in corpus]
    wrong = [
        (s, want, ids)
        for s, want, ids in zip(corpus, IDS["ids"][name], got, strict=True)
        if ids != want
    ]
    assert not wrong, f"{len(wrong)} of {len(corpus)} differ, first: {wrong[0]}"


def test_tokenize_command_prints_the_ids(tmp_path, capsys):
    path = VOCABS["llama"]
    corpus = IDS["corpus"][:20]
    strings = tmp_path / "s.json"
    strings.write_text(json.dumps(corpus))
    assert main(["tokenize", str(path), "--file", str(strings), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == IDS["ids"]["llama"][:20]
    assert main(["tokenize", str(path), "--text", corpus[3]]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, IDS["ids"]["llama"][3]))


def test_chat_template_and_stop_ids_come_from_the_metadata():
    from qir.models import load

    ck = load(SMOLLM2)
    tok = ck.tokenizer()
    assert tok.config["chat_template"].startswith("{% for message in messages %}")
    assert ck.config["eos_token_id"] == [0, 2]  # <|endoftext|> and <|im_end|>, as llama.cpp's EOG
    assert tok.special["eos_token"] == "<|im_end|>"
