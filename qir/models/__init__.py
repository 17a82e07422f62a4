"""Checkpoint loading (config.json detection, lazy safetensors) and block builders."""

from qir.models.checkpoint import Checkpoint, Linear, layer_module, load

__all__ = ["Checkpoint", "Linear", "layer_module", "load"]
