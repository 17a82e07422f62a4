"""Opening a checkpoint: `load(path)` recognises a GGUF model or a checkpoint directory and
makes its Checkpoint. Above both kinds (qir.models.checkpoint, qir.models.gguf_checkpoint), so
that neither imports the other."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qir.errors import FormatError
from qir.models import strict_json
from qir.models.checkpoint import Checkpoint
from qir.models.checkpoint_dir import find, read_bytes
from qir.models.config_fields import check_config
from qir.models.gguf_checkpoint import GgufCheckpoint
from qir.models.gguf_io import is_gguf
from qir.models.multimodal import text_model
from qir.models.quant_conventions import CONVENTIONS, load_all


def _unsupported(config: Mapping[str, Any]) -> str:
    for key in ("quantization_config", "quantization"):
        q = config.get(key)
        if isinstance(q, Mapping):
            if q.get("quant_method") == "compressed-tensors":
                groups = q.get("config_groups")
                formats = {
                    str(g.get("format") or q.get("format"))
                    for g in (groups.values() if isinstance(groups, Mapping) else ())
                    if isinstance(g, Mapping)
                } or {str(q.get("format"))}
                return (
                    f"not supported: compressed-tensors format {', '.join(sorted(formats))} ({key})"
                )
            if "quant_method" in q:
                return f"not supported: quantization {q['quant_method']} ({key}.quant_method)"
            if "mode" in q:
                return f"not supported: MLX mode {q['mode']} ({key}.mode)"
            return f"not supported: quantization {dict(q)!r} ({key})"
    return "not supported: quantization none (config.json has no quantization_config)"


def load(path: str | Path) -> Checkpoint:
    """Open a checkpoint directory: read and check config.json, detect its format, validate every
    safetensors header (tensors stay lazy). A GGUF model (a .gguf file, a directory holding
    one and no config.json, or the first shard of a split one) is read from its metadata
    (qir.models.gguf_checkpoint)."""
    path = Path(path)
    if is_gguf(path):
        load_all()
        ck = GgufCheckpoint(path)
        check_config(ck.config, str(ck.path))
        return ck
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as e:  # a name too long, say
        raise FormatError(f"{path}: cannot open ({e.strerror})") from None
    if not is_dir:
        raise FormatError(
            f"{path}: checkpoint {'is not a directory' if exists else 'does not exist'}"
        )
    cfg_path = find(path, "config.json", "config.json")
    if cfg_path is None:
        raise FormatError(
            f"{path / 'config.json'}: missing (a checkpoint directory needs config.json)"
        )
    config = strict_json.loads(read_bytes(cfg_path), str(cfg_path))
    if not isinstance(config, dict):
        raise FormatError(f"{cfg_path}: not a JSON object")
    # ModelOpt exports describe the quantization in hf_quant_config.json beside config.json
    # (older ones only there); matchers see it as config["hf_quant_config"].
    hf_quant = find(path, "hf_quant_config.json", "hf_quant_config.json")
    if hf_quant is not None:
        config.setdefault("hf_quant_config", strict_json.loads(read_bytes(hf_quant), str(hf_quant)))
    config, rename, line = text_model(config, str(cfg_path))
    check_config(config, str(cfg_path))
    load_all()
    for convention in CONVENTIONS:
        if convention.matches(config):
            return Checkpoint(path, config, convention, (rename, line) if rename and line else None)
    raise FormatError(f"{cfg_path}: {_unsupported(config)}")
