"""A GGUF model (llama.cpp's file: one .gguf, a folder holding one, or the first shard of a
split one) opened as a qir Checkpoint: its config from the metadata (qir.models.gguf_config),
its tensors under the Hugging Face names the block builder reads, every linear read by the
reader its ggml type registers (qir.formats.ggml_types), the tokenizer from tokenizer.ggml.*
(qir.text.gguf_tokenizer).

What llama.cpp's converters changed is undone where the tensors are looked up, so every
reader (whole models, tensor-parallel parts, `qir dequant`) sees Hugging Face's weights:
- the llama family's q and k rows (`Architecture.gguf_permuted_qk`), permuted by the converter
  for llama.cpp's adjacent-pair RoPE, are put back in Hugging Face's order: an exact shuffle
  of whole rows, which are byte slices of whole blocks in every ggml type, so qir runs its
  usual rotate-half RoPE on unchanged codes;
- Gemma's norms, stored as 1 + w, are w again (w - 1 in float32, as transformers reads them:
  the block builder's 1 + w then gives the stored factor back).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np

from qir.errors import FormatError
from qir.formats.ggml_types import GgmlType, reader
from qir.models.architectures import Architecture
from qir.models.checkpoint import Checkpoint
from qir.models.checkpoint_view import CheckpointView, Linear
from qir.models.gguf_config import config as gguf_config
from qir.models.gguf_config import hf_name, module_names
from qir.models.gguf_io import GGUFModel
from qir.models.quant_conventions import QuantConvention
from qir.models.safetensors_io import TensorStore
from qir.types import QWeight


def _unpermute(heads: int, rows: int) -> np.ndarray:
    """Row indices putting llama.cpp's permuted q/k rows (per head: pairs (j, j + d/2)
    adjacent) back in Hugging Face's order (per head: first halves, then second halves)."""
    d = rows // heads
    return np.arange(rows).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(-1)


class GgufStore:
    """A GGUF model's tensors under Hugging Face names (the TensorStore interface), with the
    converter's changes undone (the module docstring)."""

    def __init__(self, model: GGUFModel, arch: Architecture, config: Mapping[str, Any]) -> None:
        self.model, self.arch = model, arch
        names = module_names(arch)
        self._stored: dict[str, str] = {}
        for name in model:
            new = hf_name(name, names)
            if new is not None:
                self._stored[new] = name
        self._heads = {
            "q_proj": config["num_attention_heads"],
            "k_proj": config["num_key_value_heads"],
        }

    def stored(self, name: str) -> str:
        """The GGUF name of tensor `name`."""
        try:
            return self._stored[name]
        except KeyError:
            raise FormatError(f"{self.model.path}: no tensor {name!r} in the GGUF model") from None

    def ggml_type(self, name: str) -> GgmlType:
        return self.model.info(self.stored(name)).type

    def ne(self, name: str) -> tuple[int, ...]:
        return self.model.info(self.stored(name)).ne

    def keys(self) -> list[str]:
        return list(self._stored)

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.model.info(self.stored(name)).shape

    def dtype(self, name: str) -> np.dtype:
        if self._norm(name):
            return np.dtype(np.float32)
        return self.model.get(self.stored(name)).dtype

    def _norm(self, name: str) -> bool:
        return self.arch.norm == "x*(1+w)" and name.endswith("norm.weight")

    def get(self, name: str) -> np.ndarray:
        a = self.model.get(self.stored(name))
        if self._norm(name):
            a = a.astype(np.float32) - np.float32(1)
        elif self.arch.gguf_permuted_qk:
            proj = name.rsplit(".", 2)[-2]
            if proj in self._heads and name.startswith("model.layers."):
                a = a[_unpermute(self._heads[proj], a.shape[0])]
        if a.flags.writeable:
            a.flags.writeable = False
        return a


def read_linear(ck: CheckpointView, module: str) -> Linear:
    """The linear `module` of a GGUF model, read by its ggml type's registered reader."""
    name = f"{module}.weight"
    if name not in ck.store:
        raise FormatError(f"{name}: missing from {ck.path}")
    gguf = ck.gguf_store  # type: ignore[attr-defined]
    t, ne = gguf.ggml_type(name), gguf.ne(name)
    # An expert's rows where ck.store slices stacked experts; plain types come as elements.
    raw = np.asarray(ck.store.get(name))
    if raw.dtype != np.uint8:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    if len(ne) < 2 or raw.ndim != 2:
        raise FormatError(f"{name}: {t.name} {list(ne)} (ggml ne) is not a linear's [in, out]")
    where = f"{name} ({gguf.stored(name)})"
    r = reader(t.id, where)
    out_features, in_features = raw.shape[0], int(ne[0])
    fmt = r.format()
    fmt.check_read_shape(out_features, in_features, where)
    bufs = r.repack(raw, out_features, in_features, where)
    return Linear(module, QWeight(fmt, out_features, in_features), bufs)


def _no_match(config: Mapping[str, Any]) -> bool:
    return False


# Not registered: load() makes GGUF checkpoints itself, never by matching a config.json.
CONVENTION = QuantConvention("gguf", _no_match, read_linear)


class GgufCheckpoint(Checkpoint):
    """A Checkpoint read from a GGUF model."""

    def __init__(self, path: Path) -> None:
        model = GGUFModel(path)
        config, arch = gguf_config(model)
        self.gguf_store = GgufStore(model, arch, config)
        # GgufStore has TensorStore's interface (keys, shape, dtype, get)
        super().__init__(model.path, config, CONVENTION, store=cast(TensorStore, self.gguf_store))

    @property
    def model(self) -> GGUFModel:
        return self.gguf_store.model

    def _where(self) -> str:
        return str(self.path)

    def tokenizer(self) -> Any:
        from qir.text.gguf_tokenizer import tokenizer_of

        return tokenizer_of(self.model)
