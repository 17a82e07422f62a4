"""A checkpoint's tokenizer: its tokenizer.json run by Hugging Face's `tokenizers` (the library
transformers' fast tokenizers are), with the special tokens of tokenizer_config.json.

Special tokens around a text come from tokenizer.json's post-processor, as transformers 5's
AutoTokenizer applies them: beside a tokenizer.json it ignores tokenizer_config.json's
`add_bos_token`/`add_eos_token` (they only matter for tokenizers built without one)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qir.errors import UsageError
from qir.formats.base import FormatError
from qir.models import checkpoint_dir, strict_json

TOKENIZER_FILE = "tokenizer.json"
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
CONFIG_FILE = "tokenizer_config.json"
# The named special tokens a chat template may refer to.
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def read_json(root: Path, name: str) -> dict[str, Any] | None:
    """A JSON object file of the checkpoint, or None where it has none."""
    path = checkpoint_dir.find(root, name, name)
    if path is None:
        return None
    value = strict_json.loads(checkpoint_dir.read_bytes(path), str(path))
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value: Any, where: str) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken object."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise FormatError(f"{where}: expected a string or an object with a string 'content'")


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    special: dict[str, str | None]  # bos_token, eos_token, ... -> their text
    config: dict[str, Any]  # tokenizer_config.json (empty where there is none)
    path: Path

    @classmethod
    def load(cls, root: str | Path) -> Tokenizer:
        """The tokenizer of the checkpoint at `root`; a UsageError naming what is missing."""
        root = Path(root)
        path = checkpoint_dir.find(root, TOKENIZER_FILE, TOKENIZER_FILE)
        if path is None:
            raise UsageError(
                f"{root}: no {TOKENIZER_FILE}; text needs the checkpoint's tokenizer (token ids "
                "work without it: --tokens)"
            )
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError:  # pragma: no cover - a dependency of qir
            raise UsageError(
                "text needs Hugging Face's tokenizers: pip install tokenizers"
            ) from None
        try:
            backend = Backend.from_str(checkpoint_dir.read_bytes(path).decode("utf-8"))
        except (UnicodeDecodeError, Exception) as e:  # tokenizers raises a bare Exception
            raise FormatError(
                f"{path}: not a tokenizer the tokenizers library reads ({e})"
            ) from None
        config = read_json(root, CONFIG_FILE) or {}
        where = str(root / CONFIG_FILE)
        special = {k: _token_text(config.get(k), f"{where}: {k}") for k in SPECIAL}
        return cls(backend, special, config, root)

    @property
    def byte_ids(self) -> frozenset[int]:
        """The ids that may continue a run of byte-fallback pieces: the <0xNN> pieces of a
        byte-fallback model, and its special tokens (decoding skips them, joining the bytes on
        either side). A run decodes as one UTF-8 string (each byte U+FFFD if it is not valid
        UTF-8), so its text is only known when the run ends. Empty for other models."""
        if not getattr(self.backend.model, "byte_fallback", False):
            return frozenset()
        vocab = self.backend.get_vocab(with_added_tokens=False)
        pieces = {i for t, i in vocab.items() if _BYTE_PIECE.fullmatch(t)}
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        return frozenset(pieces | special)

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (those decoding skips)."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, t in added.items() if t.special)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (its added tokens included)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.special["eos_token"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; with its special tokens (BOS ...) as the post-processor adds them."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
