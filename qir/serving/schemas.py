"""The OpenAI API's request and response bodies, as pydantic models: what `qir serve` reads
and writes on /v1/chat/completions, /v1/completions and /v1/models.

Requests keep unknown fields (`extra="allow"`) and ignore them, as OpenAI's server does, except
those that would change the result and that qir does not do (REFUSED: logprobs, n > 1, tools,
penalties, ...), which `refused()` names for a 400. Sampling fields left out take the
checkpoint's generation_config.json (as vLLM does), not OpenAI's temperature 1. top_k, min_p and
ignore_eos are extensions vLLM also accepts.

Types are strict, as OpenAI's are: "10" is not an integer nor "true" a boolean (an integer is
taken where a number is asked for)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON (and JSON Schema) has them: 10 or 10.0, not "10" nor 10.5. (Constraints go
# before the validator: after it, pydantic leaves them out of the JSON schema.)
WHOLE = BeforeValidator(_whole)
Int = Annotated[int, WHOLE]
Ids = Annotated[list[Int], Field(min_length=1)]
NonNegative = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(ge=0, le=1)]


def _off(value: Any) -> bool:
    return value is None or value is False or value in (0, "", [], {}, "none")


# Fields qir does not implement, with the test that a value leaves the result unchanged.
REFUSED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": _off,
    "best_of": lambda v: v in (None, 1),
    "echo": _off,
    "suffix": _off,
    "presence_penalty": _off,
    "frequency_penalty": _off,
    "repetition_penalty": lambda v: v in (None, 1),
    "logit_bias": _off,
    "tools": _off,
    "tool_choice": _off,
    "functions": _off,
    "function_call": _off,
    "response_format": lambda v: _off(v) or (isinstance(v, dict) and v.get("type") == "text"),
    "audio": _off,
    "modalities": lambda v: _off(v) or v == ["text"],
    "prediction": _off,
}


# Requests: unknown fields kept (and checked by `refused`), types not coerced.
REQUEST = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = REQUEST
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """What both endpoints take: limits, sampling, stop strings, streaming."""

    model_config = REQUEST

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    temperature: NonNegative | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=-1), WHOLE] | None = None  # vLLM's -1 (and 0): off
    min_p: Probability | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int | None = None
    ignore_eos: bool = False

    def refused(self) -> tuple[str, str] | None:
        """(field, message) of the first field asking for what qir does not do."""
        if self.n not in (None, 1):
            return "n", f"n: one choice per request (got {self.n}); send n requests"
        for name, unchanged in REFUSED.items():
            value = (self.model_extra or {}).get(name)
            if not unchanged(value):
                return name, f"{name}: not supported by this server (got {value!r})"
        return None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_options(self) -> dict[str, Any]:
        """Engine.sampling's keywords (None: the checkpoint's default)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": 0 if self.top_k == -1 else self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
        }

    def token_limit(self) -> tuple[int | None, str]:
        """The most tokens asked for (None: what fits) and the field that asked."""
        return self.max_tokens, "max_tokens"


class TextPart(BaseModel):
    model_config = REQUEST
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = REQUEST
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


def template_messages(messages: list[Message]) -> list[dict[str, str]]:
    """Messages as a chat template takes them: text content, "developer" as "system" (OpenAI's
    newer name for it)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else ""
        if isinstance(m.content, list):
            content = "".join(p.text or "" for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None

    def token_limit(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def refused(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            if not _off((m.model_extra or {}).get("tool_calls")):
                return f"messages.[{i}].tool_calls", "tool calls: not supported by this server"
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text" or part.text is None:
                    where = f"messages.[{i}].content.[{j}]"
                    return where, f"{where}: only text parts (got type {part.type!r})"
        return super().refused()

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)


class CompletionRequest(GenerationRequest):
    # One prompt: text or token ids (a list of one of either is taken too).
    prompt: (
        str
        | Ids
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Ids], Field(min_length=1)]
    )

    def one_prompt(self) -> str | list[int] | None:
        """The prompt, or None where several were sent."""
        p: Any = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return p  # text, ids, or nothing
        return p[0] if len(p) == 1 else None


# Responses.


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A chunk's change: the role first, then content, then nothing (the finish chunk);
    fields that are not part of it are left out, not null."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qir"
    max_model_len: int  # vLLM's extension: the context, in tokens


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Version(BaseModel):
    version: str


# /tokenize and /detokenize, as vLLM takes and answers them.


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0), WHOLE]]


class DetokenizeResponse(BaseModel):
    prompt: str
