"""The request schemas on their own: what a template gets of chat messages, which values of the
fields qir does not do leave the result unchanged, one prompt out of the ways to send it."""

from __future__ import annotations

import pytest

from tests.requires import import_or_skip

schemas = import_or_skip("qir.serving.schemas", "pydantic")
REFUSED = schemas.REFUSED
ChatCompletionRequest = schemas.ChatCompletionRequest
CompletionRequest = schemas.CompletionRequest


def test_chat_messages_as_a_template_takes_them() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ]
        }
    )
    assert body.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    assert body.refused() is None and body.token_limit() == (None, "max_tokens")
    both = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
        }
    )
    assert both.token_limit() == (7, "max_completion_tokens")


@pytest.mark.parametrize(
    ("value", "changes"),
    [
        ({"use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True}, None),
        ({"mirostat": 0, "typical_p": 1.0, "repeat_penalty": 1.0, "n_probs": 0}, None),
        ({"modalities": ["text"], "suffix": "", "top_n_sigma": -1}, None),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"repeat_penalty": 1.1}, "repeat_penalty"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"suffix": "end"}, "suffix"),
        ({"mirostat": 2}, "mirostat"),
    ],
)
def test_fields_qir_does_not_do_are_refused_only_where_they_matter(
    value: dict[str, object], changes: str | None
) -> None:
    body = CompletionRequest.model_validate({"prompt": "x", **value})
    refused = body.refused()
    assert (refused[0] if refused else None) == changes
    assert set(value) <= set(REFUSED)


def test_prompts_limits_and_sampling_options() -> None:
    def prompts(prompt: object) -> object:
        return CompletionRequest.model_validate({"prompt": prompt}).prompts()

    assert prompts("hi") == ["hi"] and prompts([3, 4]) == [[3, 4]] and prompts(["hi"]) == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"] and prompts([[5], [6, 7]]) == [[5], [6, 7]]
    body = CompletionRequest.model_validate({"prompt": "x", "top_k": -1, "stop": "##", "seed": 3})
    assert body.sampling_options() == {
        "temperature": None,
        "top_p": None,
        "top_k": 0,
        "min_p": None,
        "seed": 3,
    }
    assert body.stop_strings == ("##",) and not body.include_usage

    def limit(**fields: object) -> object:
        return CompletionRequest.model_validate({"prompt": "x", **fields}).token_limit()

    assert limit() == (None, "max_tokens") and limit(n_predict=5) == (5, "n_predict")
    assert limit(n_predict=-1) == (None, "max_tokens")
    assert limit(max_tokens=3, n_predict=5) == (3, "max_tokens")
    assert limit(max_tokens=3, max_completion_tokens=7) == (7, "max_completion_tokens")


def test_structured_outputs_by_every_name() -> None:
    schema = {"type": "object"}
    for fields, want in [
        ({"response_format": {"type": "json_object"}}, ("response_format", "json", schema)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": schema},
                }
            },
            ("response_format", "json", schema),
        ),
        ({"structured_outputs": {"regex": "a+"}}, ("structured_outputs", "regex", "a+")),
        ({"structured_outputs": {"choice": ["a"]}}, ("structured_outputs", "choice", ["a"])),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            ("structured_outputs", "gbnf", 'root ::= "a"'),
        ),
        ({"guided_json": schema}, ("guided_json", "json", schema)),
        ({"guided_choice": ["x", "y"]}, ("guided_choice", "choice", ["x", "y"])),
        ({"grammar": 'root ::= "a"'}, ("grammar", "gbnf", 'root ::= "a"')),
        ({"json_schema": schema}, ("json_schema", "json", schema)),
    ]:
        body = CompletionRequest.model_validate({"prompt": "x", **fields})
        assert body.grammars() == [want] and body.refused() is None
    two = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a", "grammar": "b"})
    assert two.refused() is not None and two.refused()[0] == "grammar"
