"""Chat templates, rendered as transformers renders them: a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, the loop controls extension, `raise_exception`, a `tojson` that
keeps non-ASCII text and takes indent/separators/sort_keys, `strftime_now`, and the named
special tokens (bos_token, eos_token, ...) beside `messages` and `add_generation_prompt`.

Where the template comes from, first found wins: chat_template.jinja, then tokenizer_config.json's
`chat_template` (a string, or a list of {name, template} of which "default" is used unless a name
is asked for); named templates also come from additional_chat_templates/<name>.jinja."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from qir.errors import UsageError
from qir.formats.base import FormatError
from qir.models import checkpoint_dir
from qir.text.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
NAMED_DIR = "additional_chat_templates"
ROLES = ("system", "user", "assistant", "tool")


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _private(name: object) -> None:
    from jinja2.exceptions import SecurityError

    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


def _environment() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class GuardedNamespace(Namespace):
        """Jinja's namespace() without underscore names: templates come from strangers."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            ns, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                _private(key)
            Namespace.__init__(ns, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _private(name)
            super().__setitem__(name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = GuardedNamespace
    return env


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a chat: a list of {role, content} objects, roles from ROLES."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise UsageError("messages: expected a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
            raise UsageError(f"messages[{i}]: expected an object with a string 'content'")
        if m.get("role") not in ROLES:
            raise UsageError(
                f"messages[{i}]: role {m.get('role')!r} is not one of {', '.join(ROLES)}"
            )
        out.append(dict(m))
    return out


@dataclass
class ChatTemplate:
    source: str
    name: str  # "default", or the named template's name
    origin: str  # the file (and key) it was read from

    @classmethod
    def load(cls, tokenizer: Tokenizer, name: str | None = None) -> ChatTemplate:
        """The checkpoint's chat template (`name`: one of its named templates)."""
        root = tokenizer.path
        found = cls._find(root, tokenizer.config, name or "default")
        if found is None:
            what = f"chat template {name!r}" if name else "chat template"
            raise UsageError(
                f"{root}: no {what} ({TEMPLATE_FILE}, or chat_template in tokenizer_config.json); "
                "--chat needs one (a plain --prompt does not)"
            )
        return cls(*found)

    @staticmethod
    def _find(root: Path, config: Mapping[str, Any], name: str) -> tuple[str, str, str] | None:
        file = TEMPLATE_FILE if name == "default" else f"{NAMED_DIR}/{name}.jinja"
        path = checkpoint_dir.find(root, file, "chat template")
        if path is not None:
            return _text(path), name, str(path)
        where = f"{root}/tokenizer_config.json: chat_template"
        entry = config.get("chat_template")
        if isinstance(entry, str) and name == "default":
            return entry, name, where
        if isinstance(entry, list):
            for item in entry:
                if not (isinstance(item, dict) and isinstance(item.get("template"), str)):
                    raise FormatError(f"{where}: expected a list of {{name, template}} objects")
                if item.get("name") == name:
                    return item["template"], name, f"{where}[{name!r}]"
        elif entry is not None and not isinstance(entry, str):
            raise FormatError(f"{where}: expected a string or a list of {{name, template}}")
        return None

    def render(
        self,
        messages: Any,
        tokenizer: Tokenizer,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text of `messages`; a template that raises (or fails) is a UsageError
        carrying its message."""
        from jinja2.exceptions import TemplateError

        context = {k: v for k, v in tokenizer.special.items() if v is not None}
        context.update(extra)
        try:
            template = _environment().from_string(self.source)
            return str(
                template.render(
                    messages=check_messages(messages),
                    add_generation_prompt=add_generation_prompt,
                    **context,
                )
            )
        except TemplateError as e:
            raise UsageError(f"chat template ({self.origin}): {e}") from None


def _text(path: Path) -> str:
    raw = checkpoint_dir.read_bytes(path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
