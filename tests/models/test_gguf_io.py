"""The GGUF reader (qir.models.gguf_io): every fixture read as gguf-py's GGUFReader reads it
(metadata, value types, tensor types, shapes and bytes); split models; and bad files, written
here byte by byte (independently of the code under test), refused in one line naming the
field or tensor, exit 2 from the CLI."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from qir.cli import main
from qir.errors import QirError
from qir.models.gguf_io import GGUFFile, GGUFModel
from tests.conftest import DATA
from tests.requires import import_or_skip

gguf = import_or_skip("gguf", "gguf")

FIXTURES = sorted(DATA.glob("gguf_*/*.gguf"))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fixtures_read_as_gguf_py_reads_them(path):
    ref, f = gguf.GGUFReader(path), GGUFFile(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        got = f.metadata[key]
        assert (got.tolist() if isinstance(got, np.ndarray) else got) == field.contents(), key
        assert f.types[key] == tuple(int(t) for t in field.types), key
    assert list(f.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert (info.type.id, info.ne) == (int(t.tensor_type), tuple(int(d) for d in t.shape))
        got = f.get(t.name)
        assert got.shape == t.data.shape and got.tobytes() == t.data.tobytes(), t.name


# ---- a GGUF written by hand -------------------------------------------------------------------


def _s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def write(
    kvs: list[bytes] | None = None,
    tensors: list[tuple[bytes | str, list[int], int, int]] | None = None,
    data: bytes | None = None,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
) -> bytes:
    """A GGUF file: `kvs` are encoded key/value pairs, `tensors` (name, ne, type, offset)."""
    kvs = [kv_u32("general.alignment", 32)] if kvs is None else kvs
    if tensors is None:
        tensors = [("a", [4, 2], 0, 0), ("b", [32], 8, 32)]  # F32 [2, 4], Q8_0 one block
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)  # fmt: skip
    infos = b"".join(
        _s(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", t, off)
        for name, ne, t, off in tensors
    )  # fmt: skip
    out = head + b"".join(kvs) + infos
    out += b"\0" * (-len(out) % 32)
    return out + (bytes(range(32)) + bytes(34) if data is None else data)


def kv_u32(key: str | bytes, v: int) -> bytes:
    return _s(key) + struct.pack("<II", 4, v)


def kv_str(key: str, v: bytes) -> bytes:
    return _s(key) + struct.pack("<I", 8) + _s(v)


BAD = {
    "truncated header": (write()[:20], "too short"),
    "truncated in a key": (write()[:40], "truncated: key 0 at byte 32"),
    "truncated in the data": (write()[:-10], "truncated: tensor 'b'"),
    "wrong magic": (write(magic=b"GGUG"), "not a GGUF file"),
    "version 1": (write(version=1), "version 1 is not supported"),
    "big-endian": (write(version=0x03000000), "big-endian"),
    "huge key count": (write(n_kv=2**62), "key/value count"),
    "huge tensor count": (write(n_tensors=2**40), "tensor count"),
    "misaligned offset": (write(tensors=[("a", [4, 2], 0, 0), ("b", [32], 8, 33)]),
                          "tensor 'b' at offset 33: not a multiple of the alignment"),
    "overlapping tensors": (write(tensors=[("a", [4, 2], 0, 0), ("b", [32], 8, 0)]),
                            "tensor 'b' at offset 0: overlaps tensor 'a'"),
    "a hole": (write(tensors=[("a", [4, 2], 0, 0), ("b", [32], 8, 64)]), "leaves a hole"),
    "past the end": (write(tensors=[("a", [4, 2], 0, 0), ("b", [32], 8, 32)], data=bytes(40)),
                     "truncated: tensor 'b'"),
    "unknown type": (write(tensors=[("a", [4, 2], 99, 0)], data=bytes(32)),
                     "tensor 'a': unknown ggml type id 99"),
    "retired type": (write(tensors=[("a", [32, 1], 4, 0)], data=bytes(32)),
                     "unknown ggml type id 4"),
    "partial block": (write(tensors=[("a", [33], 8, 0)], data=bytes(64)),
                      "not whole blocks of 32"),
    "five dims": (write(tensors=[("a", [1, 1, 1, 1, 1], 0, 0)], data=bytes(32)),
                  "5 dimensions"),
    "long name": (write(tensors=[("x" * 64, [1], 0, 0)], data=bytes(32)), "64 bytes"),
    "duplicate tensor": (write(tensors=[("a", [1], 0, 0), ("a", [1], 0, 32)], data=bytes(64)),
                         "tensor 'a' appears twice"),
    "duplicate key": (write(kvs=[kv_u32("k", 1), kv_u32("k", 2)]), "key 'k' appears twice"),
    "empty key": (write(kvs=[kv_u32("", 1)]), "key 0 is empty"),
    "key not UTF-8": (write(kvs=[kv_u32(b"\xff", 1)]), "key 0 is not UTF-8"),
    "value not UTF-8": (write(kvs=[kv_str("s", b"\xc3")]), "s is not UTF-8"),
    "unknown value type": (write(kvs=[_s("k") + struct.pack("<II", 13, 0)]),
                           "k: unknown value type 13"),
    "nested array": (write(kvs=[_s("k") + struct.pack("<IIQ", 9, 9, 0)]), "a nested array"),
    "huge array": (write(kvs=[_s("k") + struct.pack("<IIQ", 9, 4, 2**60)]),
                   "k's count 1152921504606846976 cannot fit"),
    "alignment not u32": (write(kvs=[_s("general.alignment") + struct.pack("<IQ", 10, 32)]),
                          "general.alignment is a u64, expected a u32"),
    "alignment 3": (write(kvs=[kv_u32("general.alignment", 3)]), "not a power of two"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_files_are_refused_in_one_line(case, tmp_path, capsys):
    raw, message = BAD[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(QirError) as e:
        GGUFFile(path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_the_good_file_opens_in_both_readers(tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(write())
    f, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert f.get("a").tobytes() == ref.tensors[0].data.tobytes()
    assert f.get("b").tobytes() == ref.tensors[1].data.tobytes() and f.get("b").shape == (34,)


def test_split_models_open_from_the_first_shard(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama", split_max_tensors=1)
    writer.add_uint32("general.alignment", 32)
    for i in range(3):
        writer.add_tensor(f"t{i}", np.full((2, 4), i, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert [p.name for p in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    m = GGUFModel(tmp_path)  # a folder holding one split model: its first shard
    assert m.path == shards[0] and sorted(m) == ["t0", "t1", "t2"]
    assert float(m.get("t2")[0, 0]) == 2.0
    with pytest.raises(QirError, match="shard 2 of 3 of a split model; give the first"):
        GGUFModel(shards[1])
    shards[2].unlink()
    with pytest.raises(QirError, match=r"m-00003-of-00003\.gguf: missing"):
        GGUFModel(shards[0])
