"""Streaming detokenization and stop strings: what is printed, piece by piece, concatenates to
decoding all the ids at once, and is at every point a prefix of it (no half character, no
wrong space), for byte-level BPE and SentencePiece-style tokenizers (byte fallback included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qir.text import TextStream, Tokenizer
from tests.text.conftest import BYTE_LEVEL, SENTENCEPIECE, TEXTS


def byte_fallback_tokenizer(tmp: Path) -> Tokenizer:
    """A Llama-2-style tokenizer with all 256 <0xNN> byte pieces: a character without a piece
    of its own becomes its UTF-8 bytes, one id each."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    words = Backend(models.BPE(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Metaspace()
    words.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(words.get_vocab(), key=words.get_vocab().get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in json.loads(words.to_str())["model"]["merges"]]
    tok = Backend(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp / "tokenizer.json"))
    return Tokenizer.load(tmp)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    fallback = tmp_path_factory.mktemp("fallback")
    return {
        "byte_level": Tokenizer.load(BYTE_LEVEL),
        "sentencepiece": Tokenizer.load(SENTENCEPIECE),
        "byte_fallback": byte_fallback_tokenizer(fallback),
    }


def streamed(
    tok: Tokenizer, ids: list[int], stop: list[str] | None = None
) -> tuple[list[str], TextStream]:
    stream = TextStream(tok, stop or [])
    pieces = []
    for i in ids:
        pieces.append(stream.add(i))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream


def check_prefixes(tok: Tokenizer, ids: list[int]) -> None:
    pieces, _ = streamed(tok, ids)
    full = tok.decode(ids)
    assert "".join(pieces) == full
    printed = ""
    for piece in pieces:
        printed += piece
        assert full.startswith(printed)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece", "byte_fallback"])
def test_encoded_texts_stream_back_exactly(tokenizers, kind: str) -> None:
    tok = tokenizers[kind]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        check_prefixes(tok, ids)
        if kind == "byte_fallback" and "<" not in text:  # lossless (but for a leading space)
            assert tok.decode(ids) == text.lstrip(" ")


def test_a_character_split_into_byte_pieces_prints_when_the_run_ends(tokenizers) -> None:
    tok = tokenizers["byte_fallback"]
    ids = tok.encode("a € b", add_special_tokens=False)
    pieces = [tok.backend.id_to_token(i) for i in ids]
    at = pieces.index("<0xE2>")
    assert pieces[at : at + 3] == ["<0xE2>", "<0x82>", "<0xAC>"]  # € has no piece of its own
    printed, _ = streamed(tok, ids)
    # Nothing while the run goes on (a later byte could make it invalid), then all of it.
    assert printed[at : at + 4] == ["", "", "", "€ b"[: len(printed[at + 3])]]
    assert "€" in printed[at + 3] and "".join(printed) == "a € b"


@settings(max_examples=60, deadline=None)
@given(st.data())
@example(data=None)
def test_any_ids_stream_to_their_decoding(tokenizers, data) -> None:
    for kind, tok in tokenizers.items():
        if data is None:  # an incomplete character at the very end prints as U+FFFD
            ids = tok.encode("€", add_special_tokens=False)[:2]
        else:
            ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40), label=kind)
        check_prefixes(tok, ids)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_stop_strings_end_the_text_before_them(tokenizers, data) -> None:
    tok = tokenizers[data.draw(st.sampled_from(sorted(tokenizers)))]
    ids = data.draw(st.lists(st.integers(3, tok.vocab_size - 1), min_size=1, max_size=30))
    full = tok.decode(ids)
    if len(full) < 2:
        return
    a = data.draw(st.integers(0, len(full) - 1))
    stop = full[a : a + data.draw(st.integers(1, 4))]
    other = data.draw(st.text(min_size=1, max_size=3))
    pieces, stream = streamed(tok, ids, [other, stop])
    # Generation ends at the first id that completes a stop string (the model would not make
    # the later ids), so a stop string complete in a shorter prefix wins over one that starts
    # earlier but is completed later ("in" with stops "n" and "in!" prints "i"). Text is
    # checked where a character is complete: not after a lone byte id or a partial UTF-8 end.
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if k < len(ids) and (ids[k - 1] in tok.byte_ids or text.endswith("\ufffd")):
            continue
        hits = [i for i in (text.find(stop), text.find(other)) if i >= 0]
        if hits:
            assert "".join(pieces) == text[: min(hits)]
            break
    assert stream.stopped


def test_text_held_for_a_possible_stop_string_comes_out_when_it_is_not_one(tokenizers) -> None:
    tok = tokenizers["byte_level"]
    ids = tok.encode("Hello, world!", add_special_tokens=False)
    pieces, stream = streamed(tok, ids, ["world?"])
    assert "".join(pieces) == "Hello, world!" and not stream.stopped
    assert not any(p.endswith("worl") for p in pieces[:-1])  # held while it could be "world?"
