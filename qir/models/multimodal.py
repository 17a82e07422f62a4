"""A multimodal checkpoint's text model, read as a text checkpoint of its own.

Gemma 3's releases from 4B up are `gemma3` (Gemma3ForConditionalGeneration): the text model's
config is `text_config` (model_type gemma3_text) and its tensors sit under `language_model.`
(`language_model.model.layers.*`, `language_model.lm_head`, as transformers, mlx-lm and the Hub
store them; `model.language_model.*` as transformers 5 names them in memory). qir runs the text
model on token ids: the config it reads is text_config with the top level's quantization and
dtype, the store shows the text tensors under the text model's names, and the vision tower and
projector are never read. Transformers' Gemma3ForConditionalGeneration does not apply
text_config's final_logit_softcapping (its text model and mlx-lm do; the releases leave it
null): a checkpoint that sets it is refused rather than answered one tool's way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qir.errors import FormatError

# Top-level keys of a multimodal config.json that describe its text model's weights too.
SHARED_KEYS = ("quantization_config", "quantization", "hf_quant_config", "tie_word_embeddings")
# Stored-name prefixes of the text model -> its names as a text checkpoint's.
PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)


@dataclass(frozen=True)
class Multimodal:
    """What a multimodal family's text model is (one row of MULTIMODAL)."""

    model_type: str
    text_model_type: str
    text_class: str
    what: str


MULTIMODAL: Mapping[str, Multimodal] = {
    "gemma3": Multimodal("gemma3", "gemma3_text", "Gemma3ForCausalLM", "Gemma 3's text model"),
}


def text_name(stored: str) -> str | None:
    """The name a stored tensor goes by in the text model, None for the other towers'."""
    for old, new in PREFIXES:
        if stored.startswith(old):
            return new + stored.removeprefix(old)
    return None


def _renamed(value: Any) -> Any:
    """A quantization config whose per-module entries name text modules by their text names."""
    if not isinstance(value, Mapping):
        return value
    out = {}
    for key, v in value.items():
        name = text_name(key) if "." in key else key
        if name is not None:
            out[name] = v
    return out


def text_model(
    config: dict[str, Any], where: str
) -> tuple[dict[str, Any], Callable[[str], str | None] | None, str | None]:
    """(the config qir reads, the store's renaming, a line saying so) for config.json: a
    multimodal family's text model, or the config itself (no renaming) for any other."""
    row = MULTIMODAL.get(str(config.get("model_type")))
    if row is None:
        return config, None, None
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise FormatError(
            f"{where}: model_type {row.model_type!r} needs a text_config object (its text model)"
        )
    if text.get("final_logit_softcapping") is not None:
        raise FormatError(
            f"{where}: text_config.final_logit_softcapping is set, which transformers' "
            f"{row.model_type} model does not apply and its text model does: not supported"
        )
    flat = dict(text)
    flat["model_type"] = row.text_model_type
    flat["architectures"] = [row.text_class]
    for key in SHARED_KEYS:
        if key in config:
            flat[key] = _renamed(config[key])
    for key in ("torch_dtype", "dtype", "vocab_size"):
        if flat.get(key) is None and config.get(key) is not None:
            flat[key] = config[key]
    line = f"{row.what} of a {row.model_type} checkpoint (text_config; other towers not read)"
    return flat, text_name, line
