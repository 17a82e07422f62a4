"""A GGUF model's tokenizer (tokenizer.ggml.*) as a Hugging Face `tokenizers` Tokenizer that
tokenizes as llama.cpp does (src/llama-vocab.cpp), built from the metadata directly: no
tokenizer.json, and no search for SentencePiece merges over every pair of tokens (transformers'
conversion of a large vocabulary takes minutes).

- `gpt2` (byte-level BPE): tokens and merges ("a b") as stored; the pre-tokenizer is the
  regexes llama.cpp runs for `tokenizer.ggml.pre` (PRE), each splitting the pieces of the one
  before, then the GPT-2 byte map; Llama 3's pre-tokenizers take a whole piece that is a token
  before any merge (llama.cpp's ignore_merges).
- `llama` (SentencePiece): llama.cpp merges the adjacent pair whose joined text is a token of
  the highest score, leftmost first, and falls back to <0xNN> byte tokens. As BPE: the merges
  are every split of every token into two tokens, ranked by the joined token's score (then its
  id), found in one pass over the vocabulary. Spaces become U+2581, with one prepended to every
  run of text (at the start and after a special token) where add_space_prefix says so.
- Control tokens (token_type 3, and the tokens llama.cpp ends generations at, which it makes
  control tokens) are special tokens and user-defined ones (4) added tokens, both matched in
  text as llama.cpp matches them with parse_special.
- BOS/EOS around a text as tokenizer.ggml.add_bos_token / add_eos_token say, with llama.cpp's
  defaults (SPM and Llama 3's BPE add BOS); the chat template is tokenizer.chat_template.

Built tokenizers are kept per file (path, size, mtime) for the process.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from qir.errors import UsageError
from qir.formats.base import FormatError
from qir.models.gguf_config import EOG_TEXTS
from qir.models.gguf_io import ARRAY, STRING, GGUFModel
from qir.text.tokenizer import Tokenizer

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (llama.cpp's regexes in order, ignore_merges, add_bos by default)
PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
        False,
        False,
    ),
    "gpt-2": ((_GPT2,), False, False),
    "llama-bpe": ((_LLAMA3,), True, True),
    "llama3": ((_LLAMA3,), True, True),
    "qwen2": ((_QWEN2,), False, False),
    "smollm": ((r"\p{N}", _GPT2), False, False),
    "starcoder": ((r"\p{N}", _GPT2), False, False),
}
CONTROL, USER_DEFINED, BYTE = 3, 4, 6


def _strings(model: GGUFModel, key: str, required: bool = True) -> list[str] | None:
    value = model.value(key, ARRAY)
    if value is None:
        if required:
            raise FormatError(f"{model.path}: no {key} (the tokenizer needs it)")
        return None
    if model.types[key] != (ARRAY, STRING):
        raise FormatError(f"{model.path}: {key} is not an array of strings")
    return list(value)


def _numbers(model: GGUFModel, key: str, n: int) -> np.ndarray | None:
    value = model.value(key, ARRAY)
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf" or len(value) != n:
        raise FormatError(
            f"{model.path}: {key} must be {n} numbers (one per token), got "
            f"{len(value)} {getattr(value, 'dtype', 'strings')}"
        )
    return value


def _flag(model: GGUFModel, key: str, default: bool) -> bool:
    value = model.value(key, 7)
    return default if value is None else bool(value)


def _token_id(model: GGUFModel, which: str, n: int) -> int | None:
    key = f"tokenizer.ggml.{which}_token_id"
    value = model.value(key, 0, 1, 2, 3, 4, 5, 10, 11)
    if value is None:
        return None
    if not 0 <= value < n:
        raise FormatError(f"{model.path}: {key} {value} is outside the {n} tokens")
    return int(value)


def _bpe(tokens: list[str], merges: list[str], ignore_merges: bool) -> Any:
    from tokenizers import models

    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise FormatError(f"tokenizer.ggml.merges: {m!r} is not two tokens joined by a space")
        pairs.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    return models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)


def spm_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, as a merge ranked by the token's score (highest
    first), then by its id: SentencePiece's BPE as llama.cpp runs it."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, i in vocab.items():
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                found.append((-float(scores[i]), i, t[:k], t[k:]))
    found.sort()
    return [(a, b) for _, _, a, b in found]


def _spm(tokens: list[str], scores: np.ndarray, unk: int | None) -> Any:
    from tokenizers import models

    vocab = {t: i for i, t in enumerate(tokens)}
    return models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores),
        unk_token=tokens[unk] if unk is not None else None,
        byte_fallback=True,
        fuse_unk=True,
    )


def build(model: GGUFModel) -> Tokenizer:
    """The tokenizer of `model` (the module docstring); refusals name the key."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    kind = model.value("tokenizer.ggml.model", STRING)
    if kind is None:
        raise UsageError(
            f"{model.path}: no tokenizer.ggml.model; text needs the model's tokenizer (token "
            "ids work without it: --tokens)"
        )
    tokens = _strings(model, "tokenizer.ggml.tokens")
    assert tokens is not None
    n = len(tokens)
    types = _numbers(model, "tokenizer.ggml.token_type", n)
    types = np.ones(n, np.int64) if types is None else types.astype(np.int64)
    pre = model.value("tokenizer.ggml.pre", STRING) or "default"
    if kind == "gpt2":
        if pre not in PRE:
            raise FormatError(
                f"{model.path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                f"{', '.join(PRE)})"
            )
        regexes, ignore_merges, add_bos = PRE[pre]
        merges = _strings(model, "tokenizer.ggml.merges")
        assert merges is not None
        backend = Backend(_bpe(tokens, merges, ignore_merges))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
        space_prefix = False
    elif kind == "llama":
        scores = _numbers(model, "tokenizer.ggml.scores", n)
        if scores is None:
            raise FormatError(f"{model.path}: no tokenizer.ggml.scores (SentencePiece needs them)")
        unk = _token_id(model, "unknown", n)
        backend = Backend(_spm(tokens, scores, unk))
        space_prefix = _flag(model, "tokenizer.ggml.add_space_prefix", True)
        replace = normalizers.Replace(" ", "\u2581")
        backend.normalizer = (
            normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
            if space_prefix
            else replace
        )
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        backend.decoder = decoders.Sequence(steps)
        add_bos = True
    else:
        raise FormatError(
            f"{model.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)"
        )
    # llama.cpp makes the tokens it ends generations at control tokens, whatever their type
    control = (types == CONTROL) | np.isin(np.array(tokens, dtype=object), EOG_TEXTS)
    added = [
        AddedToken(tokens[i], special=bool(control[i]), normalized=False)
        for i in np.flatnonzero(control | (types == USER_DEFINED))
        if tokens[i]
    ]
    backend.add_tokens(added)
    bos, eos = _token_id(model, "bos", n), _token_id(model, "eos", n)
    add_bos = _flag(model, "tokenizer.ggml.add_bos_token", add_bos) and bos is not None
    add_eos = _flag(model, "tokenizer.ggml.add_eos_token", False) and eos is not None
    if add_bos or add_eos:
        single = ([tokens[bos]] if add_bos and bos is not None else []) + ["$A"]
        single += [tokens[eos]] if add_eos and eos is not None else []
        ids = [i for i, add in ((bos, add_bos), (eos, add_eos)) if add and i is not None]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), special_tokens=[(tokens[i], i) for i in ids]
        )
    special = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "unk_token": tokens[u] if (u := _token_id(model, "unknown", n)) is not None else None,
        "pad_token": tokens[p] if (p := _token_id(model, "padding", n)) is not None else None,
    }
    config: dict[str, Any] = {"add_bos_token": add_bos, "add_eos_token": add_eos}
    template = model.value("tokenizer.chat_template", STRING)
    if template is not None:
        config["chat_template"] = template
    return Tokenizer(backend, special, config, model.path)


_BUILT: dict[tuple[str, int, int], Tokenizer] = {}


def tokenizer_of(model: GGUFModel) -> Tokenizer:
    """`model`'s tokenizer, built once per file (path, size, mtime) for the process."""
    st = os.stat(model.path)
    key = (str(model.path), st.st_size, st.st_mtime_ns)
    if key not in _BUILT:
        if len(_BUILT) >= 8:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = build(model)
    return _BUILT[key]
