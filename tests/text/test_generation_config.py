"""generation_config.json resolved as transformers' generate resolves it, and sampling values
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qir.errors import UsageError
from qir.formats.base import FormatError
from qir.sampling import Sampling
from qir.text import GenerationConfig


def config(tmp_path: Path, **values) -> GenerationConfig:
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return GenerationConfig.load(tmp_path)


def test_transformers_defaults(tmp_path: Path) -> None:
    assert config(tmp_path).sampling() == Sampling.greedy()  # do_sample defaults to false
    s = config(tmp_path, do_sample=True).sampling(seed=3)
    assert s == Sampling(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, seed=3)


def test_the_file_then_the_caller(tmp_path: Path) -> None:
    qwen = config(
        tmp_path, do_sample=True, temperature=0.7, top_p=0.8, top_k=20, eos_token_id=[5, 7]
    )
    assert qwen.sampling() == Sampling(temperature=0.7, top_k=20, top_p=0.8)
    assert qwen.sampling(top_k=0, min_p=0.05) == Sampling(temperature=0.7, top_p=0.8, min_p=0.05)
    assert qwen.sampling(temperature=0).is_greedy and qwen.sampling(do_sample=False).is_greedy
    assert qwen.eos_ids == [5, 7]
    # A sampling value given on its own turns sampling on, whatever the file says.
    plain = config(tmp_path, do_sample=False, eos_token_id=2)
    assert plain.sampling(top_p=0.9) == Sampling(temperature=1.0, top_k=50, top_p=0.9)
    assert plain.sampling(temperature=0.5).temperature == 0.5 and plain.eos_ids == [2]


def test_max_new_tokens_and_fields_not_applied(tmp_path: Path) -> None:
    assert config(tmp_path, max_new_tokens=9, max_length=100).max_new_tokens(30) == 9
    assert config(tmp_path, max_length=100).max_new_tokens(30) == 70
    assert config(tmp_path).max_new_tokens(30) is None
    assert config(tmp_path, repetition_penalty=1.05, typical_p=1.0).not_applied() == [
        "repetition_penalty=1.05"
    ]


def test_without_a_file_the_eos_comes_from_config_json(tmp_path: Path) -> None:
    assert GenerationConfig.load(tmp_path, {"eos_token_id": [2, 9]}).eos_ids == [2, 9]
    assert GenerationConfig.load(tmp_path).eos_ids == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"do_sample": "yes"}, "do_sample must be true or false"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"eos_token_id": [2, "x"]}, "eos_token_id must be an int or a list of ints"),
    ],
)
def test_malformed_files_are_named(tmp_path: Path, values, message) -> None:
    with pytest.raises(FormatError, match=message):
        config(tmp_path, **values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"temperature": -0.5}, r"temperature must be a number >= 0, got -0.5"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
        ({"min_p": 2.0}, r"min_p must be a number in \[0, 1\]"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"seed": 1.5}, "seed must be an int"),
    ],
)
def test_bad_sampling_values_are_refused(values, message) -> None:
    with pytest.raises(UsageError, match=message):
        Sampling(**{"temperature": 1.0, **values})
