"""Checkpoint loading (config.json detection, lazy safetensors), block builders and whole
models (qir.models.model)."""

from qir.models.checkpoint import Checkpoint, layer_module
from qir.models.checkpoint_view import Linear
from qir.models.loader import load
from qir.models.model import Generation, Model

__all__ = ["Checkpoint", "Generation", "Linear", "Model", "layer_module", "load"]
