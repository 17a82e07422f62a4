"""docs/serving-fields.md against the request schemas: every field the table calls honoured is
a field of its endpoint's request, every refused one is refused (400 naming it) for a value that
changes the result and taken at its neutral value, every accepted one changes nothing and is
not refused; and every field the code refuses is in the table."""

from __future__ import annotations

import re
from pathlib import Path

from tests.requires import import_or_skip

schemas = import_or_skip("qir.serving.schemas", "pydantic")
REFUSED, ChatCompletionRequest = schemas.REFUSED, schemas.ChatCompletionRequest
CompletionRequest = schemas.CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving-fields.md"
SAMPLES = [True, 2, 1.5, "x", ["x"], {"a": 1}, -3]


def rows() -> list[tuple[list[str], str, str]]:
    out = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        names = [n for n in re.findall(r"`([^`]+)`", cells[0]) if "." not in n]
        out.append((names, cells[2], re.split(r"[ :;,(]", cells[3])[0]))
    return out


def body(endpoint: str, **fields: object) -> ChatCompletionRequest | CompletionRequest:
    if endpoint == "chat":
        return ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], **fields}
        )
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_the_table_is_what_the_code_does() -> None:
    table = rows()
    assert len(table) > 40
    listed: set[str] = set()
    for names, endpoint, status in table:
        endpoints = ["chat", "completions"] if endpoint == "both" else [endpoint]
        for name in names:
            listed.add(name)
            for e in endpoints:
                schema = ChatCompletionRequest if e == "chat" else CompletionRequest
                if status == "honoured":
                    assert name in schema.model_fields, (name, e)
                elif status == "accepted":
                    assert name not in schema.model_fields and name not in REFUSED, name
                    assert body(e, **{name: "x"}).refused() is None, name
                else:
                    assert status == "refused", (name, status)
                    if name in schema.model_fields:  # refused by a check of its own (chat echo)
                        assert body(e, **{name: True}).refused()[0] == name  # type: ignore[index]
                        continue
                    assert name in REFUSED and REFUSED[name](None), name
                    value = next(v for v in SAMPLES if not REFUSED[name](v))
                    refused = body(e, **{name: value}).refused()
                    assert refused is not None and refused[0] == name, (name, value)
    assert set(REFUSED) <= listed
