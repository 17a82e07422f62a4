"""Differential fuzzing of the GGUF reader against gguf-py's (llama.cpp's own Python reader), from
the fixtures llama.cpp's tools wrote (tests/data/gguf_*).

Mutated copies of the real files: truncations, byte flips and overwritten 64-bit fields in the
header (counts, lengths, dimensions, types, offsets), extra bytes, and changes that keep the file
valid (tensor data, a string's bytes). Whatever the file, qir raises its own errors (QirError)
and nothing else. A file qir opens, gguf-py opens too, with every tensor's bytes and every
metadata value equal; a file whose mutation keeps it valid both open. qir is the stricter: it
refuses what gguf-py lets through (overlapping tensors, holes, offsets off the alignment, names
longer than ggml's 63 bytes), so the converse is not asked.

Derandomized with a small budget in CI, as tests/models/test_checkpoint_fuzz.py; `QIR_FUZZ=long`
runs a random search of QIR_FUZZ_EXAMPLES (default 5000).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from qir.errors import QirError
from qir.models.gguf_io import GGUFFile
from tests.models.test_checkpoint_fuzz import FUZZ
from tests.requires import import_or_skip

gguf = import_or_skip("gguf", "gguf")

DATA = Path(__file__).resolve().parents[1] / "data"
# The smaller files: each example writes one copy.
FILES = [DATA / "gguf_llama" / "model-Q4_0.gguf", DATA / "gguf_qwen3" / "model-Q4_K_M.gguf"]
HUGE = [2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1, 0]


def _official(path: Path) -> gguf.GGUFReader | None:
    try:
        return gguf.GGUFReader(path)
    except Exception:  # gguf-py raises ValueError, struct/numpy errors, ...: any is a refusal
        return None


@pytest.fixture(scope="module")
def sources() -> dict[Path, tuple[bytes, int]]:
    """Each file's bytes and where its tensor data starts (everything before is header)."""
    return {p: (p.read_bytes(), GGUFFile(p).data_start) for p in FILES}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf_fuzz")


def mutate(data: st.DataObject, whole: bytearray, header: int) -> bool:
    """One mutation of `whole` in place; whether it keeps the file valid."""
    kind = data.draw(st.sampled_from(["data", "string", "cut", "flip", "u64", "u32", "extend"]))
    event(kind)
    if kind == "data":  # a tensor byte: nothing a reader checks
        at = data.draw(st.integers(header, len(whole) - 1))
        whole[at] ^= data.draw(st.integers(1, 255))
        return True
    if kind == "string":  # a letter of the metadata's text for another letter
        letters = [i for i in range(24, header) if 97 <= whole[i] <= 122]
        at = data.draw(st.sampled_from(letters))
        whole[at] = data.draw(st.integers(97, 122))
        # a key's letter may now repeat another key, or name one qir reads with a new meaning
        return False
    if kind == "cut":
        del whole[data.draw(st.integers(0, len(whole) - 1)) :]
    elif kind == "flip":
        at = data.draw(st.integers(0, header - 1))
        whole[at] ^= 1 << data.draw(st.integers(0, 7))
    elif kind in ("u64", "u32"):
        width = 8 if kind == "u64" else 4
        at = data.draw(st.integers(4, header - width))
        value = data.draw(st.sampled_from(HUGE)) % 2 ** (8 * width)
        whole[at : at + width] = value.to_bytes(width, "little")
    else:
        whole += bytes(data.draw(st.integers(1, 64)))
    return False


@FUZZ
@given(st.data())
def test_what_qir_opens_gguf_py_opens_with_the_same_bytes(
    sources: dict[Path, tuple[bytes, int]], scratch: Path, data: st.DataObject
) -> None:
    src = data.draw(st.sampled_from(FILES))
    raw, header = sources[src]
    whole = bytearray(raw)
    valid = all(mutate(data, whole, header) for _ in range(data.draw(st.integers(1, 2))))
    path = scratch / "model.gguf"
    path.write_bytes(bytes(whole))
    official = _official(path)
    try:
        ours = GGUFFile(path)
        tensors = {name: ours.raw(name).tobytes() for name in ours}
    except QirError:
        assert not valid, "qir refused a file whose mutation keeps it valid"
        event("qir refuses")
        return
    event("qir opens")
    assert official is not None, "qir opened a file gguf-py refuses"
    theirs = {t.name: np.asarray(t.data).tobytes() for t in official.tensors}
    assert tensors == theirs
    for key, value in ours.metadata.items():
        field = official.fields[key]
        assert np.array_equal(np.asarray(field.contents()), np.asarray(value)), key
