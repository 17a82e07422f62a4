"""compressed-tensors config parsing shared by its conventions (ct_int, ct_float, nvfp4): the
config, its `config_groups`, a group's format and which group targets a module. Registers no
convention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qir.models.quant_conventions.common import quant_config, regex_match


def ct_config(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """config.json's `quantization_config` if it is compressed-tensors', else None."""
    return quant_config(config, "compressed-tensors")


def config_groups(q: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The config groups by name (entries that are not dicts are skipped)."""
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping):
        return {}
    return {str(k): g for k, g in groups.items() if isinstance(g, Mapping)}


def group_format(q: Mapping[str, Any], group: Mapping[str, Any]) -> Any:
    """A group's `format`, falling back to the config's."""
    return group.get("format") or q.get("format")


def targets(module: str, patterns: Any) -> bool:
    """compressed-tensors target matching for the linears we load: `re:<regex>` against the
    module path, a plain name against the path or its class (every loaded module is a Linear)."""
    for t in patterns or ():
        if t in ("Linear", module):
            return True
        if isinstance(t, str) and t.startswith("re:") and regex_match(t, module):
            return True
    return False


def target_group(q: Mapping[str, Any], module: str) -> tuple[str, Mapping[str, Any]] | None:
    """The first config group (name, group) whose targets cover `module`, or None."""
    return next(
        ((name, g) for name, g in config_groups(q).items() if targets(module, g.get("targets"))),
        None,
    )
