"""Tool calls: how a model family writes them, read back into OpenAI's `tool_calls`.

The chat template renders the request's `tools` (as transformers passes them: a list of
{"type": "function", "function": {name, description, parameters}}); the model answers in its
family's own format, which a parser reads (the names are vLLM's --tool-call-parser names):

- `hermes` (Hermes, Qwen 2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, text before the first block is content;
- `llama3_json` (Llama 3.1+): the whole reply a JSON object `{"name": ..., "parameters":
  {...}}` (or several separated by `;`), optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} objects (v3 tokenizers),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later).

The parser is the one whose marker the chat template spells (or `--tool-call-parser`).
tool_choice "required" or a named tool is enforced by a JSON schema instead, as vLLM does: the
reply is the named function's arguments, or a JSON list of {"name", "parameters"} objects (any
family), so it always parses.

Streamed, text is passed on as content until a call's marker appears (a partial marker is held
back, as a stop string is), and the calls are sent as tool_call deltas (each call's id, name and
whole arguments) once the reply ends.

A tokenizer may hold a marker as a special token (Mistral's [TOOL_CALLS] and [ARGS], Llama's
<|python_tag|>), which decoded text skips: a reply the parser reads keeps those ids' text
(`kept_ids`, qir.text.TextStream's `keep`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qir.errors import UsageError

if TYPE_CHECKING:
    from qir.text.tokenizer import Tokenizer

PARSERS = ("hermes", "llama3_json", "mistral")
# What each parser's calls start with (llama3_json: the reply itself, at its start).
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
# What each parser reads that a tokenizer may hold as special tokens, which decoding would drop
# (Mistral's [TOOL_CALLS] and [ARGS] are control tokens, Llama's <|python_tag|> is special).
TOKENS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
    "llama3_json": ("<|python_tag|>",),
}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect(template: str | None) -> str | None:
    """The parser of a chat template's family, by the marker it spells (None: no tools)."""
    if template is None:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def kept_ids(parser: str, tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the parser's tokens (TOKENS) that the tokenizer has, to keep in the text."""
    ids = (tokenizer.token_id(t) for t in TOKENS[parser])
    return frozenset(i for i in ids if i is not None)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(obj: Any, args_key: str = "arguments") -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return Call(obj["name"], _arguments(args), call_id())


def _json_values(text: str) -> list[Any]:
    """The JSON values written one after another in `text` (whitespace, `;` or `,` between)."""
    decoder, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        value, i = decoder.raw_decode(text, i)
        out.append(value)


def parse(parser: str, text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole reply; a reply that does not parse is all content."""
    try:
        if parser == "hermes":
            return _hermes(text)
        if parser == "mistral":
            return _mistral(text)
        if parser == "llama3_json":
            return _llama3(text)
    except ValueError:
        return text, []
    raise UsageError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")


def _hermes(text: str) -> tuple[str | None, list[Call]]:
    blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.S)
    if not blocks:
        return text, []
    calls = [_call(json.loads(b)) for b in blocks]
    if any(c is None for c in calls):
        return text, []
    content = text[: text.find("<tool_call>")]
    return content if content.strip() else None, [c for c in calls if c is not None]


def _mistral(text: str) -> tuple[str | None, list[Call]]:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text, []
    content, rest = (text[:at] if text[:at].strip() else None), text[at:]
    calls: list[Call | None] = []
    for part in rest.split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        if "[ARGS]" in part:  # v11: name[ARGS]{...}
            name, args = part.split("[ARGS]", 1)
            calls.append(Call(name.strip(), _arguments(json.loads(args)), call_id()))
            continue
        for value in _json_values(part):
            for obj in value if isinstance(value, list) else [value]:
                calls.append(_call(obj))
    if not calls or any(c is None for c in calls):
        return text, []
    return content, [c for c in calls if c is not None]


def _llama3(text: str) -> tuple[str | None, list[Call]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(v, "parameters") for v in _json_values(body)]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


def forced_schema(
    tools: list[dict[str, Any]], name: str | None, parallel: bool = True
) -> dict[str, Any]:
    """The JSON schema a forced reply follows: the named function's parameters, or (required)
    a non-empty list of {"name", "parameters"} calls of any of the tools (one, where not
    parallel)."""
    empty = {"type": "object", "properties": {}}
    if name is not None:
        (fn,) = [t["function"] for t in tools if t["function"]["name"] == name]
        return dict(fn.get("parameters") or empty)
    return {
        "type": "array",
        "minItems": 1,
        **({} if parallel else {"maxItems": 1}),
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": t["function"].get("parameters") or empty,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        },
    }


def forced_calls(text: str, name: str | None) -> list[Call]:
    """The calls of a forced reply (`forced_schema`'s shape; empty where it did not finish)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if name is not None:
        return [Call(name, _arguments(value), call_id())]
    calls = [_call(v, "parameters") for v in value] if isinstance(value, list) else []
    return [c for c in calls if c is not None]


class CallStream:
    """A streamed reply's text split into content (passed on as it comes) and the calls (held
    from their marker on, parsed at the end)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.marker = MARKERS[parser]
        self._held = ""  # a possible start of the marker
        self._calls: str | None = None  # the text from the marker on, once it came
        self._started = False  # any content passed on (llama3_json: calls open the reply)

    def add(self, piece: str) -> str:
        """The content of `piece` to pass on now."""
        if self._calls is not None:
            self._calls += piece
            return ""
        text = self._held + piece
        if self.parser == "llama3_json" and not self._started:
            stripped = text.lstrip()
            if not stripped:
                self._held = text
                return ""
            if stripped.startswith("{") or stripped.startswith(self.marker[:1]):
                if stripped.startswith("{") or stripped.startswith(self.marker):
                    self._calls = text
                    return ""
                if self.marker.startswith(stripped):
                    self._held = text
                    return ""
        at = text.find(self.marker)
        if at >= 0:
            self._calls, self._held = text[at:], ""
            self._started = True
            return text[:at]
        keep = next(
            (
                n
                for n in range(min(len(self.marker) - 1, len(text)), 0, -1)
                if self.marker.startswith(text[-n:])
            ),
            0,
        )
        self._held = text[len(text) - keep :] if keep else ""
        out = text[: len(text) - keep]
        self._started = self._started or bool(out.strip())
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(the rest of the content, the calls) once the reply ended; calls that do not parse
        are content."""
        if self._calls is None:
            rest, self._held = self._held, ""
            return rest, []
        content, calls = parse(self.parser, self._calls)
        if not calls:
            return self._calls, []
        return content or "", calls
