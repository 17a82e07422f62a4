"""What the layers below the Checkpoint class read a checkpoint through: `Linear`, one linear as
read, and `CheckpointView`, the part of a Checkpoint that the quantization conventions
(qir.models.quant_conventions) and the architectures read (config.json's fields, the tensors).
qir.models.checkpoint implements it from above, so neither imports the Checkpoint class."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from qir.models.safetensors_io import TensorStore
from qir.types import QWeight


@dataclass(frozen=True)
class Linear:
    """One quantized linear: its IR weight type and kernel-layout buffers (read-only views)."""

    module: str
    weight: QWeight
    buffers: dict[str, np.ndarray]


class CheckpointView(Protocol):
    path: Path
    config: dict[str, Any]
    store: TensorStore

    def field(self, key: str) -> Any: ...

    def linear(self, module: str) -> Linear: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...
