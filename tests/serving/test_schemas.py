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
        ({"logprobs": False, "top_logprobs": 0, "echo": False, "tool_choice": "none"}, None),
        ({"tools": [], "logit_bias": {}, "presence_penalty": 0.0, "best_of": 1}, None),
        ({"response_format": {"type": "text"}, "modalities": ["text"], "n": 1}, None),
        ({"logprobs": 0}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.1}, "frequency_penalty"),
        ({"suffix": "end"}, "suffix"),
        ({"n": 3}, "n"),
    ],
)
def test_fields_qir_does_not_do_are_refused_only_where_they_matter(
    value: dict[str, object], changes: str | None
) -> None:
    body = CompletionRequest.model_validate({"prompt": "x", **value})
    refused = body.refused()
    assert (refused[0] if refused else None) == changes
    assert set(value) - {"n"} <= set(REFUSED)


def test_one_prompt_and_sampling_options() -> None:
    def one(prompt: object) -> object:
        return CompletionRequest.model_validate({"prompt": prompt}).one_prompt()

    assert one("hi") == "hi" and one([3, 4]) == [3, 4] and one(["hi"]) == "hi" and one([[5]]) == [5]
    assert one(["a", "b"]) is None and one([]) == []
    body = CompletionRequest.model_validate({"prompt": "x", "top_k": -1, "stop": "##", "seed": 3})
    assert body.sampling_options() == {
        "temperature": None,
        "top_p": None,
        "top_k": 0,
        "min_p": None,
        "seed": 3,
    }
    assert body.stop_strings == ("##",) and not body.include_usage
