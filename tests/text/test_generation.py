"""Text generation on the real fixtures: greedy text is transformers' greedy ids decoded,
streamed pieces concatenate to it, a seed gives the same ids on every backend, generation
stops at eos ids and stop strings, and a chat turn reuses the KV rows of the conversation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import transformers

from qir.dtypes import F32
from qir.errors import UsageError
from qir.models import Model
from qir.text import TextStream
from tests.text.conftest import BYTE_LEVEL, SENTENCEPIECE, copy_checkpoint


@pytest.mark.parametrize("path", [BYTE_LEVEL, SENTENCEPIECE], ids=lambda p: p.name)
def test_greedy_text_is_transformers_greedy_ids_decoded(path: Path) -> None:
    golden = np.load(path / "golden_model.npz")
    model = Model.load(path, act=F32)
    gen = model.generate(golden["tokens"], 8, do_sample=False, ignore_eos=True)
    np.testing.assert_array_equal(gen.tokens, golden["greedy"])
    stream = TextStream(model.tokenizer)
    pieces = [stream.add(int(t)) for t in gen.tokens] + [stream.finish()]
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    assert "".join(pieces) == theirs.decode(golden["greedy"], skip_special_tokens=True)


def test_a_text_prompt_runs_its_ids(tmp_path: Path) -> None:
    model = Model.load(SENTENCEPIECE, act=F32)
    text = model.generate("The model reads the prompt", 6, do_sample=False, ignore_eos=True)
    ids = model.tokenizer.encode("The model reads the prompt")
    assert ids[0] == 1  # the post-processor's BOS
    gen = model.generate(ids, 6, do_sample=False, ignore_eos=True)
    assert text == model.tokenizer.decode(gen.tokens)
    options = {"stream": True, "do_sample": False, "ignore_eos": True}
    pieces = list(model.generate("The model reads the prompt", 6, **options))
    assert len(pieces) > 1 and "".join(pieces) == text


@pytest.mark.parametrize("backend", ["reference", "host"])
def test_a_seed_gives_the_same_ids_on_every_backend(backend: str) -> None:
    model = Model.load(BYTE_LEVEL, backend=backend)
    options = {"temperature": 1.3, "top_k": 40, "top_p": 0.95, "min_p": 0.01, "ignore_eos": True}
    a = model.generate([3, 10, 17], 6, seed=11, **options).tokens
    b = model.generate([3, 10, 17], 6, seed=11, **options).tokens
    c = model.generate([3, 10, 17], 6, seed=12, **options).tokens
    ref = Model.load(BYTE_LEVEL).generate([3, 10, 17], 6, seed=11, **options).tokens
    assert a.tolist() == b.tolist() == ref.tolist() and a.tolist() != c.tolist()
    assert model.stats.seed == 12 and "temperature 1.3" in model.stats.sampling


def test_generation_stops_at_an_eos_id_and_at_stop_strings(tmp_path: Path) -> None:
    ck = copy_checkpoint(SENTENCEPIECE, tmp_path / "ck")
    free = Model.load(ck).generate([3, 10, 17], 8, do_sample=False, ignore_eos=True).tokens
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [250, int(free[3])]}))
    model = Model.load(ck)
    gen = model.generate([3, 10, 17], 8, do_sample=False)
    assert gen.tokens.tolist() == free[: list(free).index(free[3]) + 1].tolist()
    assert gen.finish == "eos"
    assert model.generate([3, 10, 17], 8, do_sample=False, ignore_eos=True).finish == "length"
    text = model.generate("Hello", 12, do_sample=False, ignore_eos=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = model.generate("Hello", 12, do_sample=False, ignore_eos=True, stop=[stop])
    assert cut == text[: text.find(stop)] and model.last.finish == "stop"


def test_a_chat_turn_reuses_the_conversations_kv_rows() -> None:
    model = Model.load(BYTE_LEVEL, act=F32)
    turn = [{"role": "user", "content": "What is the capital of France?"}]
    first = model.chat(turn, 5, do_sample=False)
    turn += [{"role": "assistant", "content": first}, {"role": "user", "content": "Thanks!"}]
    second = model.chat(turn, 5, do_sample=False)
    assert model.stats.cached_tokens >= 12  # the first turn's prompt was not recomputed
    fresh = Model.load(BYTE_LEVEL, act=F32)
    assert fresh.chat(turn, 5, do_sample=False) == second
    assert fresh.stats.cached_tokens == 0
    model.reset()
    model.chat(turn, 1, do_sample=False)
    assert model.stats.cached_tokens == 0


def test_text_errors_are_one_line_usage_errors(tmp_path: Path) -> None:
    ck = copy_checkpoint(BYTE_LEVEL, tmp_path / "ck")
    (ck / "tokenizer.json").unlink()
    bare = Model.load(ck)
    with pytest.raises(UsageError, match=r"no tokenizer\.json"):
        bare.generate("hello", 2)
    assert bare.generate([1, 2], 2, do_sample=False).tokens.shape == (2,)  # ids still work
    model = Model.load(BYTE_LEVEL, max_seq=16)
    with pytest.raises(UsageError, match="past --max-seq 16"):
        model.generate("The quick brown fox jumps over the lazy dog " * 2, 2)
    with pytest.raises(UsageError, match="temperature must be a number >= 0"):
        model.generate("hi", 2, temperature=-1.0)
    with pytest.raises(UsageError, match="stop strings need a text prompt"):
        model.generate([1, 2], 2, stop=["x"])
