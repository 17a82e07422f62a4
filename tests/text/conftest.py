"""Fixtures for the text tests: which checkpoints carry which tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import DATA

# One fixture per tokenizer kind (scripts/make_fixture_tokenizers.py).
BYTE_LEVEL = DATA / "awq_gemm_g64_S"  # byte-level BPE, ChatML template in tokenizer_config.json
SENTENCEPIECE = DATA / "mlx_affine4_g64_S"  # Metaspace BPE, [INST] template in chat_template.jinja
KINDS = {"byte_level": BYTE_LEVEL, "sentencepiece": SENTENCEPIECE}
TEXTS = [
    "Hello, world! How are you today?",
    " leading space and  two spaces",
    "Lines\nand\ttabs\n\n",
    "café, naïve — “quoted” 日本語 🙂",
    "<s>specials</s> <|im_start|>inline<|im_end|>",
    "",
    "unknown: Ωλφα ж",
]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A writable copy of a fixture (a copy: a checkpoint's files may not link outside it)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("golden*.npz"))
    return dst
