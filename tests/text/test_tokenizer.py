"""The checkpoint's tokenizer and chat template against transformers' AutoTokenizer on every
fixture: the same ids for a text and for a chat turn, the same text for ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from qir.errors import UsageError
from qir.text import ChatTemplate, Tokenizer
from tests.conftest import DATA
from tests.text.conftest import BYTE_LEVEL, SENTENCEPIECE, TEXTS, copy_checkpoint

FIXTURES = sorted(p for p in DATA.iterdir() if (p / "tokenizer.json").is_file())
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello, world!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "café 🙂"},
    ],
]


def auto(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_every_fixture_ships_a_tokenizer():
    assert len(FIXTURES) == 14  # the 12 S fixtures and the two Mistral ones


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_ids_and_text_equal_transformers(path: Path):
    ours, theirs = Tokenizer.load(path), auto(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert max(ids, default=0) < 256  # the fixtures' models have 256 ids
    assert ours.eos_id == theirs.eos_token_id


@pytest.mark.parametrize("path", [BYTE_LEVEL, SENTENCEPIECE], ids=lambda p: p.name)
@pytest.mark.parametrize("messages", CHATS, ids=["one_turn", "with_history"])
def test_chat_prompt_equals_apply_chat_template(path: Path, messages):
    ours, theirs = Tokenizer.load(path), auto(path)
    text = ChatTemplate.load(ours).render(messages, ours)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ours.encode(text, add_special_tokens=False) == ids
    # The template's own special tokens: BOS from the [INST] template, none from ChatML.
    assert (ids[0] == ours.token_id("<s>")) == (path == SENTENCEPIECE)


def test_a_template_that_raises_is_a_usage_error_with_its_message():
    tok = Tokenizer.load(SENTENCEPIECE)  # its template refuses roles out of order
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(UsageError, match="Conversation roles must alternate"):
        ChatTemplate.load(tok).render(bad, tok)


def test_named_templates_files_and_fallbacks(tmp_path: Path):
    ck = copy_checkpoint(BYTE_LEVEL, tmp_path / "ck")
    config = json.loads((ck / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T{{ messages[0]['content'] | tojson }}"},
    ]
    (ck / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(ck)
    msgs = [{"role": "user", "content": "é"}]
    assert ChatTemplate.load(tok).render(msgs, tok) == "Dé"
    assert ChatTemplate.load(tok, "tool_use").render(msgs, tok) == 'T"é"'  # tojson keeps é
    (ck / "chat_template.jinja").write_text("J{{ bos_token }}{{ strftime_now('%Y') | length }}")
    assert ChatTemplate.load(tok).render(msgs, tok) == "J<|begin_of_text|>4"
    (ck / "additional_chat_templates").mkdir()
    (ck / "additional_chat_templates" / "rag.jinja").write_text("R")
    assert ChatTemplate.load(tok, "rag").render(msgs, tok) == "R"
    with pytest.raises(UsageError, match="no chat template 'nope'"):
        ChatTemplate.load(tok, "nope")


def test_templates_run_sandboxed(tmp_path: Path):
    ck = copy_checkpoint(BYTE_LEVEL, tmp_path / "ck")
    tok = Tokenizer.load(ck)
    msgs = [{"role": "user", "content": "x"}]
    for source in (
        "{{ messages.__class__.__mro__ }}",
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace(a=1) %}{% set ns._secret = 2 %}",
    ):
        (ck / "chat_template.jinja").write_text(source)
        with pytest.raises(UsageError, match="chat template"):
            ChatTemplate.load(tok).render(msgs, tok)


def test_missing_files_are_one_line_usage_errors(tmp_path: Path):
    ck = copy_checkpoint(BYTE_LEVEL, tmp_path / "ck")
    config = json.loads((ck / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (ck / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="no chat template"):
        ChatTemplate.load(Tokenizer.load(ck))
    (ck / "tokenizer.json").unlink()
    with pytest.raises(UsageError, match=r"no tokenizer\.json.*--tokens"):
        Tokenizer.load(ck)


def test_bad_messages_are_named():
    tok = Tokenizer.load(BYTE_LEVEL)
    chat = ChatTemplate.load(tok)
    with pytest.raises(UsageError, match=r"messages\[0\]: role 'robot'"):
        chat.render([{"role": "robot", "content": "x"}], tok)
    with pytest.raises(UsageError, match=r"messages\[1\]: expected an object with a string"):
        chat.render([{"role": "user", "content": "x"}, {"role": "user"}], tok)
