"""/v1/chat/completions and /v1/completions: a body in, a Request to the engine per prompt, their
deltas out as one response or as server-sent events (qir.serving.sse).

A completions body may hold a list of prompts (texts or id lists): each is its own request to
the engine and its own choices (prompt i's sample j is choice i * n + j), in one response. n
samples of a prompt run as one engine request (the samples share the prompt's KV pages);
best_of > n runs best_of and answers the n whose ids have the highest summed logprob."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from qir.errors import UsageError
from qir.serving import schemas as s
from qir.serving import tools as tl
from qir.serving.context import Context
from qir.serving.disconnect import Gone, until_disconnect
from qir.serving.engine import Delta, Engine, EngineClosed, QueueFull, Request, Stream, merge
from qir.serving.errors import ApiError, check_model, named, parse, too_long
from qir.serving.openapi import body_of, refusals
from qir.serving.responses import Chat, Choice, Format, Text, Tokens
from qir.serving.rules import Rules
from qir.serving.sse import EventStream, events
from qir.serving.tokenizing import PromptTooLong

# Seconds a client refused for a full queue is told to wait before it tries again.
RETRY_AFTER = 1


@dataclass(frozen=True)
class Reply:
    """What a chat reply is read as: plain text, the family's tool calls (auto), or a forced
    call (tool_choice required or named: JSON, qir.serving.tools.forced_calls)."""

    parser: str | None = None
    forced: bool = False
    name: str | None = None  # the named tool
    parallel: bool = True  # more than one call (parallel_tool_calls false: the first only)


def router(ctx: Context) -> APIRouter:
    """The two endpoints of the context's engine."""
    api = APIRouter()
    engine, name = ctx.engine, ctx.name

    # The bodies are parsed here, not by FastAPI, so that a client that leaves out
    # `Content-Type: application/json` (curl -d) is served, and errors name the field.
    @api.post(
        "/v1/chat/completions",
        response_model=None,
        openapi_extra=body_of(s.ChatCompletionRequest),
        responses=refusals(s.ChatCompletion, s.ChatCompletionChunk),
    )
    async def chat(request: HttpRequest) -> Response:
        body = parse(s.ChatCompletionRequest, await request.body())
        _check_common(body, name)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        extra: dict[str, Any] = dict(body.chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        if body.documents is not None:
            extra["documents"] = body.documents
        try:
            prompt = await ctx.text.chat(
                body.template_messages(),
                body.add_generation_prompt and not body.continue_final_message,
                continue_final=body.continue_final_message,
                add_special_tokens=body.add_special_tokens,
                **extra,
            )
        except UsageError as e:
            raise ApiError(400, named("messages", e), "messages") from None
        except PromptTooLong as e:
            raise too_long(engine.max_seq, e.at_least, "messages") from None
        reply, grammar = Reply(), None
        if body.forced_tools:
            choice = body.tool_choice
            named_tool = choice.function.name if isinstance(choice, s.NamedToolChoice) else None
            reply = Reply(forced=True, name=named_tool)
            schema = tl.forced_schema(tools, named_tool, body.parallel_tool_calls)
            grammar = _grammar(engine, "tool_choice", "json", schema)
        elif tools and body.tool_choice != "none":
            reply = Reply(parser=engine.tool_parser, parallel=body.parallel_tool_calls)
        tokens = Tokens(engine.tokenizer, bool(body.return_tokens_as_token_ids))
        fmt = Chat(name, tokens, body.top, show_prompt=body.prompt_logprobs is not None)
        return await _generate(ctx, request, body, [prompt], "messages", fmt, grammar, reply)

    @api.post(
        "/v1/completions",
        response_model=None,
        openapi_extra=body_of(s.CompletionRequest),
        responses=refusals(s.Completion, s.Completion),
    )
    async def completions(request: HttpRequest) -> Response:
        body = parse(s.CompletionRequest, await request.body())
        _check_common(body, name)
        prompts = []
        for i, text in enumerate(body.prompts()):
            field = (
                "prompt"
                if len(body.prompt) == 1 or isinstance(body.prompt, str)
                else f"prompt.[{i}]"
            )
            try:
                if isinstance(text, str):
                    prompts.append(await ctx.text.encode(text, body.add_special_tokens))
                else:
                    prompts.append(tuple(text))
            except PromptTooLong as e:
                raise too_long(engine.max_seq, e.at_least, field) from None
        tokens = Tokens(engine.tokenizer, bool(body.return_tokens_as_token_ids))
        fmt = Text(
            name, tokens, body.top, echo=body.echo, show_prompt=body.prompt_logprobs is not None
        )
        return await _generate(ctx, request, body, prompts, "prompt", fmt)

    return api


def _check_common(body: s.GenerationRequest, name: str) -> None:
    refused = body.refused()
    if refused is not None:
        raise ApiError(400, refused[1], refused[0], "unsupported_parameter")
    check_model(body.model, name)


def _prompt_error(engine: Engine, e: UsageError, n: int, field: str) -> ApiError:
    if n > engine.max_seq:
        message = f"{field}: {n} tokens, more than the model's context of {engine.max_seq}"
        return ApiError(400, message, field, "context_length_exceeded")
    return ApiError(400, named(field, e), field)


def _field_of(e: UsageError, fields: Sequence[str]) -> str | None:
    word = str(e).split(" ", 1)[0].rstrip(":")
    return word if word in fields else None


def _sampling(engine: Engine, body: s.GenerationRequest) -> Any:
    try:
        return engine.sampling(**body.sampling_options())
    except UsageError as e:
        raise ApiError(400, str(e), _field_of(e, list(s.GenerationRequest.model_fields))) from None


def _grammar(engine: Engine, field: str, kind: str, spec: Any) -> Any:
    try:
        return engine.grammars.compile(kind, spec, field)
    except UsageError as e:
        raise ApiError(400, str(e), field) from None


def _rules(engine: Engine, body: s.GenerationRequest) -> Rules:
    """The body's penalties and restrictions with its words and biases as ids."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise ApiError(400, f"logit_bias: keys are token ids, got {key!r}", "logit_bias")
        bias[int(key)] = value
    bad: list[tuple[int, ...]] = []
    for word in body.bad_words or []:
        # vLLM's: the word's ids alone and after a space (as it is in running text)
        for variant in (word, f" {word}"):
            ids = tuple(engine.tokenizer.encode(variant, add_special_tokens=False))
            if ids and ids not in bad:
                bad.append(ids)
    defaults = engine.default_penalties()
    try:
        return Rules(
            repetition_penalty=(
                body.repetition_penalty
                if body.repetition_penalty is not None
                else defaults["repetition_penalty"]
            ),
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            logit_bias=bias,
            allowed_token_ids=(
                frozenset(body.allowed_token_ids) if body.allowed_token_ids is not None else None
            ),
            bad_words=tuple(bad),
            min_tokens=body.min_tokens,
        )
    except UsageError as e:
        raise ApiError(400, str(e), _field_of(e, list(s.GenerationRequest.model_fields))) from None


async def _generate(
    ctx: Context,
    request: HttpRequest,
    body: s.GenerationRequest,
    prompts: Sequence[tuple[int, ...]],
    prompt_field: str,
    fmt: Format,
    grammar: Any = None,
    reply: Reply = Reply(),
) -> Response:
    engine = ctx.engine
    sampling = _sampling(engine, body)
    rules = _rules(engine, body)
    if grammar is None and body.grammars():
        field, kind, spec = body.grammars()[0]
        grammar = _grammar(engine, field, kind, spec)
    for prompt in prompts:
        try:  # the prompt alone first, so that a refusal names the right field
            engine.check(Request(prompt, 1, sampling))
        except UsageError as e:
            raise _prompt_error(engine, e, len(prompt), prompt_field) from None
    limit, limit_field = body.token_limit()
    scoring_only = limit == 0  # echo with max_tokens 0: the prompt's scores, no text
    echo = isinstance(body, s.CompletionRequest) and body.echo
    top = fmt.top
    samples = body.samples
    ranked = samples > body.n  # best_of: every sample scored to rank them
    keep = tl.kept_ids(reply.parser, engine.tokenizer) if reply.parser is not None else frozenset()
    requests = []
    for prompt in prompts:
        max_tokens = limit if limit else max(1, engine.max_seq - len(prompt))
        prompt_top = body.prompt_logprobs
        if echo and top is not None and prompt_top is None:
            prompt_top = top  # vLLM's: echo scores the prompt as logprobs asks
        requests.append(
            Request(
                prompt,
                1 if scoring_only else max_tokens,
                sampling,
                body.stop_strings,
                body.ignore_eos,
                rules=rules,
                stop_token_ids=frozenset(body.stop_token_ids or ()),
                keep_stop=body.include_stop_str_in_output,
                logprobs=top if top is not None else (0 if ranked else None),
                prompt_logprobs=prompt_top,
                n=samples,
                grammar=grammar,
                cache_salt=body.cache_salt,
                keep_tokens=keep,
            )
        )
    streams: list[Stream] = []
    try:
        for r in requests:
            streams.append(engine.submit(r))
    except UsageError as e:
        _cancel(streams)
        field = _field_of(e, list(s.ChatCompletionRequest.model_fields)) or limit_field
        code = "context_length_exceeded" if field == limit_field else None
        raise ApiError(400, named(field, e), field, code) from None
    except QueueFull as e:
        _cancel(streams)
        raise ApiError(
            429,
            f"the server is busy: {e}",
            None,
            "rate_limit_exceeded",
            "requests",
            headers={"Retry-After": str(RETRY_AFTER)},
        ) from None
    except EngineClosed as e:
        _cancel(streams)
        raise ApiError(503, str(e), None, "shutting_down", "server_error") from None
    texts = [await _echo_text(ctx, p) for p in prompts] if echo else [""] * len(prompts)
    build = _Builder(prompts, texts, samples, reply, scoring_only)
    if body.stream:
        return EventStream(streams, events(streams, build, fmt, body.include_usage), ctx.metrics)
    try:
        choices, error = await until_disconnect(_collect(streams, build), request.receive)
    except Gone:
        return Response(status_code=499)  # no one reads it
    finally:
        _cancel(streams)
        for stream in streams:
            ctx.metrics.finished(stream)
    if error is not None:
        raise ApiError(500, f"generation failed: {error}", type="server_error")
    if ranked:  # the n of each prompt's samples with the highest summed logprob
        best = []
        for i in range(len(prompts)):
            mine = choices[i * samples : (i + 1) * samples]
            mine.sort(key=lambda c: -(c.cumulative if c.cumulative is not None else -1e30))
            best += mine[: body.n]
        for k, c in enumerate(best):
            c.index = k
        choices = best
    return JSONResponse(fmt.whole(choices, build.usage()).model_dump(mode="json"))


async def _echo_text(ctx: Context, prompt: Sequence[int]) -> str:
    return await ctx.text.decode(prompt)


def _cancel(streams: Sequence[Stream]) -> None:
    for stream in streams:
        if not stream.done:
            stream.cancel()


class _Builder:
    """The choices of one response as deltas come: text, ids, scores, tool calls."""

    def __init__(
        self,
        prompts: Sequence[tuple[int, ...]],
        texts: Sequence[str],
        samples: int,
        reply: Reply,
        scoring_only: bool,
    ) -> None:
        self.samples = samples
        self.reply = reply
        self.scoring_only = scoring_only
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.choices = [
            Choice(i * samples + j, prompt=p, prompt_text=t)
            for i, (p, t) in enumerate(zip(prompts, texts, strict=True))
            for j in range(samples)
        ]
        self._calls = [
            tl.CallStream(reply.parser) if reply.parser is not None else None for _ in self.choices
        ]

    def choice(self, prompt: int, delta: Delta) -> Choice:
        return self.choices[prompt * self.samples + delta.index]

    def add(self, prompt: int, delta: Delta) -> tuple[Choice, str]:
        """The delta's choice and the content it adds (tool-call text held back)."""
        c = self.choice(prompt, delta)
        if delta.prompt_scores is not None:
            c.prompt_scores = delta.prompt_scores
        if self.scoring_only:
            c.finish = delta.finish_reason and "length"
            return c, ""
        c.ids += delta.token_ids
        c.scores += delta.scores
        c.cumulative = (
            delta.cumulative_logprob if delta.cumulative_logprob is not None else c.cumulative
        )
        calls = self._calls[c.index]
        piece = calls.add(delta.text) if calls is not None else delta.text
        c.text += piece
        if delta.finish_reason is not None:
            c.finish = delta.finish_reason
            rest = self._finish(c)
            c.text += rest
            piece += rest
        return c, piece

    def _finish(self, c: Choice) -> str:
        """The rest of a choice's content once it ended; its calls are read."""
        calls = self._calls[c.index]
        if calls is not None:
            rest, c.calls = calls.finish()
            c.calls = c.calls if self.reply.parallel else c.calls[:1]
            if c.calls:
                c.finish = "tool_calls"
            return rest
        if self.reply.forced:
            c.calls = tl.forced_calls(c.text, self.reply.name)
            if c.calls:
                c.text = ""
                c.finish = "tool_calls" if self.reply.name is None else "stop"
        return ""

    def usage(self) -> s.Usage:
        n = 0 if self.scoring_only else sum(len(c.ids) for c in self.choices)
        return s.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=n,
            total_tokens=self.prompt_tokens + n,
        )


async def _collect(streams: Sequence[Stream], build: _Builder) -> tuple[list[Choice], str | None]:
    async for i, delta in merge(streams):
        if delta.finish_reason == "error":
            return build.choices, delta.error
        build.add(i, delta)
    return build.choices, None
