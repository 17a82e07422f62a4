"""Tool calls: each family's format read back by its parser (hermes, llama3_json, mistral in
both its forms), the parser chosen by the marker a chat template spells, a reply that is not a
call left as content, streamed content held back at a partial marker, the forced-choice schema
and its calls, and tools reaching a chat template."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from qir.serving import tools as tl
from tests.requires import import_or_skip

jsonschema = import_or_skip("jsonschema", "jsonschema")

ARGS = {"city": "Paris", "days": 2}


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (
            "hermes",
            f'Sure. <tool_call>\n{{"name": "get", "arguments": {json.dumps(ARGS)}}}\n</tool_call>',
            "Sure. ",
        ),
        ("llama3_json", f'<|python_tag|>{{"name": "get", "parameters": {json.dumps(ARGS)}}}', None),
        ("llama3_json", f'{{"name": "get", "parameters": {json.dumps(ARGS)}}}', None),
        ("mistral", f'[TOOL_CALLS][{{"name": "get", "arguments": {json.dumps(ARGS)}}}]', None),
        ("mistral", f"[TOOL_CALLS]get[ARGS]{json.dumps(ARGS)}", None),
    ],
)
def test_each_familys_calls_parse(parser: str, text: str, content: str | None) -> None:
    got_content, calls = tl.parse(parser, text)
    assert got_content == content
    (call,) = calls
    assert call.name == "get" and json.loads(call.arguments) == ARGS and call.id.startswith("call_")
    # Streamed: the content passes, the call is held and read at the end.
    stream = tl.CallStream(parser)
    passed = "".join(stream.add(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, streamed = stream.finish()
    assert passed + rest == (content or "") and [c.name for c in streamed] == ["get"]


def test_two_calls_and_replies_that_are_not_calls() -> None:
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    assert [c.name for c in tl.parse("hermes", two)[1]] == ["a", "b"]
    assert tl.parse("hermes", "no calls here") == ("no calls here", [])
    assert tl.parse("hermes", "<tool_call>{broken") == ("<tool_call>{broken", [])
    assert tl.parse("llama3_json", "{not json") == ("{not json", [])
    stream = tl.CallStream("hermes")
    assert stream.add("text <tool") == "text " and stream.add("kit") == "<toolkit"
    assert stream.finish() == ("", [])


def test_the_parser_is_the_templates_family() -> None:
    assert tl.detect("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tl.detect("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert tl.detect("<|python_tag|>{{ tools }}") == "llama3_json"
    assert tl.detect("[INST] {{ m }} [/INST]") is None


def test_forced_schemas_and_their_calls() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    named = tl.forced_schema(tools, "get")
    assert named == tools[0]["function"]["parameters"]
    required = tl.forced_schema(tools, None, parallel=False)
    reply = [{"name": "now", "parameters": {}}]
    jsonschema.validate(reply, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(reply * 2, required)  # one call where not parallel
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], required)
    (call,) = tl.forced_calls(json.dumps(reply), None)
    assert (call.name, call.arguments) == ("now", "{}")
    (call,) = tl.forced_calls('{"city": "Oslo"}', "get")
    assert (call.name, json.loads(call.arguments)) == ("get", {"city": "Oslo"})
    assert tl.forced_calls('{"city": "Os', "get") == []


def test_tools_reach_the_chat_template() -> None:
    from qir.text.chat import ChatTemplate

    class Tok:
        special: ClassVar[dict[str, str]] = {}

    source = "{% for t in tools %}<tools>{{ t.function.name }}</tools>{% endfor %}{{ messages[0].content }}{{ flavour }}"
    text = ChatTemplate(source, "default", "test").render(
        [{"role": "user", "content": "hi"}],
        Tok(),
        True,
        tools=[{"type": "function", "function": {"name": "get"}}],
        flavour="!",
    )
    assert text == "<tools>get</tools>hi!"
