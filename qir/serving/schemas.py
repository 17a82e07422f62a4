"""The OpenAI API's request and response bodies, as pydantic models: what `qir serve` reads
and writes on /v1/chat/completions, /v1/completions and /v1/models.

Every field OpenAI, vLLM or llama-server defines for these endpoints is either a field here
(honoured: docs/serving-fields.md says how) or in REFUSED with the values that leave the result
unchanged: another value is a 400 naming it (`refused()`), never accepted and ignored. Fields
no server defines are ignored, as OpenAI's server ignores them. Sampling fields left out take
vLLM's defaults (temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty 1) where the
checkpoint's generation_config.json does not set them, as vLLM does.

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
Penalty = Annotated[float, Field(ge=-2, le=2)]
TokenId = Annotated[int, Field(ge=0), WHOLE]
TopLogprobs = Annotated[int, Field(ge=0, le=20), WHOLE]
# A seed: any int64 (vLLM's range) or uint64; its 64 bits key the draws.
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), WHOLE]


def _off(value: Any) -> bool:
    return value is None or value is False or value in (0, "", [], {}, "none")


def _is(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in neutral)


# Fields another server defines that qir does not do, with the test that a value leaves the
# result unchanged (docs/serving-fields.md lists them with the reason).
REFUSED: dict[str, Callable[[Any], bool]] = {
    # OpenAI
    "suffix": _off,
    "functions": _off,
    "function_call": _off,
    "audio": _off,
    "modalities": lambda v: _off(v) or v == ["text"],
    "prediction": _off,
    "reasoning_effort": _off,
    "web_search_options": _off,
    # vLLM
    "use_beam_search": _off,
    "length_penalty": _is(1, 1.0),
    "skip_special_tokens": _is(True),
    "spaces_between_special_tokens": _is(True),
    "truncate_prompt_tokens": _off,
    "truncation_side": _off,
    "logits_processors": _off,
    "logprob_token_ids": _off,
    "prompt_embeds": _off,
    "mm_processor_kwargs": _off,
    "chat_template": _off,
    "guided_decoding_backend": _off,
    "guided_whitespace_pattern": _off,
    "structural_tag": _off,
    "kv_transfer_params": _off,
    "ec_transfer_params": _off,
    "vllm_xargs": _off,
    "return_token_ids": _off,
    "return_token_offsets": _off,
    "repetition_detection": _off,
    "thinking_token_budget": _off,
    "priority": _off,
    "media_io_kwargs": _off,
    # llama-server
    "n_probs": _off,
    "repeat_penalty": _is(1, 1.0),
    "penalize_nl": _off,
    "mirostat": _off,
    "typical_p": _is(1, 1.0),
    "tfs_z": _is(1, 1.0),
    "dry_multiplier": _off,
    "xtc_probability": _off,
    "top_n_sigma": lambda v: v is None or v == -1 or v == -1.0,
    "dynatemp_range": _off,
    "samplers": _off,
    "min_keep": _off,
    "t_max_predict_ms": _off,
    "t_max_prompt_ms": _off,
    "post_sampling_probs": _off,
    "lora": _off,
    "response_fields": _off,
    "return_tokens": _off,
    "image_data": _off,
    "multimodal_data": _off,
    "reasoning_format": lambda v: v in (None, "none"),
    "thinking_forced_open": _off,
    "grammar_lazy": _off,
    "grammar_triggers": _off,
    "preserved_tokens": _off,
    "n_cmpl": lambda v: v is None or v == 1,
    "n_indent": _off,
}


# Requests: unknown fields kept (and checked by `refused`), types not coerced.
REQUEST = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = REQUEST
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = REQUEST
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of json, regex, choice, grammar (json_object: any
    JSON object)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # options of vLLM's other backends, meaningless here: only their neutral values
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: None = None
    structural_tag: None = None


LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]


class GenerationRequest(BaseModel):
    """What both endpoints take: limits, sampling, penalties, restrictions, scores, structured
    outputs, stop strings and ids, streaming."""

    model_config = REQUEST

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    n_predict: Annotated[int, Field(ge=-1), WHOLE] | None = None  # llama-server's; -1: what fits
    temperature: NonNegative | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=-1), WHOLE] | None = None  # vLLM's -1 (and 0): off
    min_p: Probability | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=128), WHOLE] = 1
    best_of: Annotated[int, Field(ge=1, le=128), WHOLE] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: LogitBias | None = None
    min_tokens: Annotated[int, Field(ge=0), WHOLE] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    prompt_logprobs: TopLogprobs | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    grammar: str | None = None  # llama-server's: GBNF
    json_schema: dict[str, Any] | None = None  # llama-server's
    cache_salt: str | None = Field(None, min_length=1)

    def refused(self) -> tuple[str, str] | None:
        """(field, message) of the first field asking for what qir does not do."""
        for name, unchanged in REFUSED.items():
            value = (self.model_extra or {}).get(name)
            if not unchanged(value):
                return name, f"{name}: not supported by this server (got {value!r})"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
        if self.best_of not in (None, self.n) and self.stream:
            return "best_of", "best_of greater than n: not with stream (the best are known last)"
        if len(self.grammars()) > 1:
            fields = ", ".join(f for f, _, _ in self.grammars())
            return self.grammars()[1][0], f"one structured output per request (got {fields})"
        return None

    def grammars(self) -> list[tuple[str, str, Any]]:
        """(field, kind, spec) of every structured output asked for (qir.serving.grammar)."""
        out: list[tuple[str, str, Any]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            out.append(("response_format", "json", {"type": "object"}))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.json_schema if rf.json_schema is not None else None
            out.append(("response_format", "json", schema or {}))
        so = self.structured_outputs
        if so is not None:
            given = [
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("gbnf", so.grammar),
                ("json", {"type": "object"} if so.json_object else None),
            ]
            out += [("structured_outputs", k, v) for k, v in given if v is not None]
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "gbnf"),
            ("grammar", "gbnf"),
            ("json_schema", "json"),
        ):
            value = getattr(self, name)
            if value is not None:
                out.append((name, kind, value))
        if self.guided_json_object:
            out.append(("guided_json_object", "json", {"type": "object"}))
        return out

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_options(self) -> dict[str, Any]:
        """Engine.sampling's keywords (None: vLLM's default, or the checkpoint's)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": 0 if self.top_k == -1 else self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
        }

    def token_limit(self) -> tuple[int | None, str]:
        """The most tokens asked for (None: what fits) and the field that asked:
        max_completion_tokens (OpenAI's newer name) over max_tokens over n_predict."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        if self.max_tokens is not None:
            return self.max_tokens, "max_tokens"
        if self.n_predict is not None and self.n_predict >= 0:
            return max(self.n_predict, 1), "n_predict"
        return None, "max_tokens"

    @property
    def samples(self) -> int:
        """Sequences run per prompt: best_of, else n."""
        return self.best_of or self.n


class TextPart(BaseModel):
    model_config = REQUEST
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = REQUEST
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = REQUEST
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = REQUEST
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as a chat template takes them: text content, "developer" as "system" (OpenAI's
    newer name for it), an assistant's tool calls with their arguments as objects (as
    transformers' templates read them), a tool's result with its call's id."""
    import json

    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else ""
        if isinstance(m.content, list):
            content = "".join(p.text or "" for p in m.content)
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content,
        }
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    arguments = json.loads(c.function.arguments)
                except ValueError:
                    arguments = c.function.arguments
                calls.append(
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": arguments},
                    }
                )
            message["tool_calls"] = calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


class FunctionDefinition(BaseModel):
    model_config = REQUEST
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = REQUEST
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = REQUEST
    name: str


class NamedToolChoice(BaseModel):
    model_config = REQUEST
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    echo: bool = False

    def refused(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text" or part.text is None:
                    where = f"messages.[{i}].content.[{j}]"
                    return where, f"{where}: only text parts (got type {part.type!r})"
        if self.echo:
            return "echo", "echo: not supported on chat completions (got True)"
        if self.continue_final_message and self.add_generation_prompt:
            return (
                "continue_final_message",
                "continue_final_message: takes add_generation_prompt false",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            return (
                "continue_final_message",
                "continue_final_message: the last message must be the assistant's",
            )
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            return "tool_choice", f"tool_choice: no tool named {choice.function.name!r} in tools"
        if choice == "required" and not self.tools:
            return "tool_choice", "tool_choice: required, but no tools"
        if self.forced_tools and self.grammars():
            return "tool_choice", "tool_choice: a forced call takes no other structured output"
        return super().refused()

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    @property
    def forced_tools(self) -> bool:
        """Whether the reply must be tool calls (tool_choice required or named)."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        )

    @property
    def top(self) -> int | None:
        """Top ids with each generated id's score (None: no scores)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


class CompletionRequest(GenerationRequest):
    # A prompt (text or ids), or a list of them: a choice each.
    prompt: (
        str
        | Ids
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Ids], Field(min_length=1)]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20), WHOLE] | None = None
    add_special_tokens: bool = True
    # 0 with echo: score the prompt, draw nothing
    max_tokens: Annotated[int, Field(ge=0), WHOLE] | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts sent (a text or ids each)."""
        p: Any = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    @property
    def top(self) -> int | None:
        return self.logprobs

    def refused(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 only with echo (scoring the prompt)"
        return super().refused()


# Responses.


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions' shape: per token (the prompt's first, with echo), its text, its
    log-probability (None for a prompt's first token), the top ones by text, and where its text
    starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: a token's log-probability, its rank (1: the most likely;
    null where it is not among those reported) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# Per prompt token (None for the first): the token's and the top ones', by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A tool call in a stream: its first delta has the id, type and name, later ones add to
    its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    """A chunk's change: the role first, then content (or tool calls), then nothing (the
    finish chunk); fields that are not part of it are left out, not null."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, on a choice's first chunk


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's


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

    def template_messages(self) -> list[dict[str, Any]]:
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
