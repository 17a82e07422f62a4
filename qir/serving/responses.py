"""The response bodies and stream chunks of /v1/chat/completions and /v1/completions: one
Format per endpoint turns the choices of a generation (text, finish reason, scores, tool calls)
and its usage into OpenAI's shapes, all of one response sharing an id and a creation time.

Scores come as the engine's TokenScores (qir.serving.scheduler) and leave in the endpoint's
shape: chat's `logprobs.content` (token, logprob, bytes, top_logprobs), the legacy completions'
`logprobs` (tokens, token_logprobs, top_logprobs by token text, text_offset; with echo the
prompt's tokens first), and vLLM's `prompt_logprobs` (per prompt token, by id: logprob, rank,
decoded_token). A token's text is its id decoded alone (`token_id:N` with
return_tokens_as_token_ids)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qir.serving import schemas as s
from qir.serving.scheduler import TokenScore
from qir.serving.tools import Call


@dataclass
class Choice:
    """One choice of a response as it builds up."""

    index: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    scores: list[TokenScore] = field(default_factory=list)
    prompt: Sequence[int] = ()  # the prompt's ids (echo, prompt_logprobs)
    prompt_text: str = ""  # echoed before the text
    prompt_scores: Sequence[TokenScore | None] | None = None
    finish: str | None = None
    cumulative: float | None = None
    calls: list[Call] = field(default_factory=list)


class Tokens:
    """Token texts for scores: each id decoded alone, cached."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._text: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        if token not in self._text:
            self._text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._text[token]


def chat_logprobs(scores: Sequence[TokenScore], text: Tokens) -> s.ChatLogprobs:
    def top(token: int, logprob: float) -> s.TopLogprob:
        t = text(token)
        return s.TopLogprob(token=t, logprob=logprob, bytes=list(t.encode()))

    return s.ChatLogprobs(
        content=[
            s.TokenLogprob(
                **top(sc.token, sc.logprob).model_dump(),
                top_logprobs=[top(t, v) for t, v in sc.top],
            )
            for sc in scores
        ]
    )


def completion_logprobs(
    scores: Sequence[TokenScore | None], text: Tokens, start: int = 0
) -> s.CompletionLogprobs:
    """The legacy shape of `scores`, their text offsets from `start`."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = start
    for sc in scores:
        assert sc is not None
        t = text(sc.token)
        tokens.append(t)
        values.append(sc.logprob)
        tops.append({text(i): v for i, v in sc.top} or None)
        offsets.append(at)
        at += len(t)
    return s.CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
    )


def echoed_logprobs(
    prompt: Sequence[int],
    prompt_scores: Sequence[TokenScore | None],
    scores: Sequence[TokenScore],
    text: Tokens,
) -> s.CompletionLogprobs:
    """The legacy shape with the prompt's tokens first (the first one's logprob None)."""
    first = text(prompt[0])
    rest = completion_logprobs([*prompt_scores[1:], *scores], text, len(first))
    return s.CompletionLogprobs(
        tokens=[first, *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[0, *rest.text_offset],
    )


def prompt_logprobs(prompt_scores: Sequence[TokenScore | None], text: Tokens) -> s.PromptLogprobs:
    out: s.PromptLogprobs = []
    for sc in prompt_scores:
        if sc is None:
            out.append(None)
            continue
        ranked = {t: r for r, (t, _) in enumerate(sc.top, start=1)}
        entry = {
            str(t): s.PromptLogprob(logprob=v, rank=r, decoded_token=text(t))
            for r, (t, v) in enumerate(sc.top, start=1)
        }
        entry[str(sc.token)] = s.PromptLogprob(
            logprob=sc.logprob, rank=ranked.get(sc.token), decoded_token=text(sc.token)
        )
        out.append(entry)
    return out


def tool_calls(calls: Sequence[Call]) -> list[s.ToolCallOut]:
    return [
        s.ToolCallOut(id=c.id, function=s.FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]


class Format:
    prefix = ""

    def __init__(
        self,
        model: str,
        tokens: Tokens,
        top: int | None = None,
        echo: bool = False,
        show_prompt: bool = False,
    ) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokens = tokens
        self.top = top  # scores with each id (None: no logprobs asked)
        self.echo = echo  # the prompt before the text (completions)
        self.show_prompt = show_prompt  # vLLM's prompt_logprobs asked for

    def start(self, index: int) -> Any | None:
        """The chunk a choice's stream opens with, if the endpoint has one."""
        return None

    def piece(self, choice: Choice, text: str, scores: Sequence[TokenScore]) -> Any:
        raise NotImplementedError

    def calls(self, choice: Choice, calls: Sequence[Call]) -> Any:
        raise NotImplementedError

    def end(self, choice: Choice) -> Any:
        raise NotImplementedError

    def usage(self, usage: s.Usage) -> Any:
        raise NotImplementedError

    def whole(self, choices: Sequence[Choice], usage: s.Usage) -> Any:
        raise NotImplementedError


class Chat(Format):
    prefix = "chatcmpl"

    def _chunk(
        self,
        index: int,
        delta: s.ChatDelta,
        finish: str | None = None,
        scores: Sequence[TokenScore] = (),
        prompt_scores: Sequence[TokenScore | None] | None = None,
    ) -> s.ChatCompletionChunk:
        logprobs = chat_logprobs(scores, self.tokens) if self.top is not None and scores else None
        choice = s.ChatChunkChoice(
            index=index, delta=delta, finish_reason=finish, logprobs=logprobs
        )
        return s.ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            prompt_logprobs=(
                prompt_logprobs(prompt_scores, self.tokens) if prompt_scores is not None else None
            ),
        )

    def start(self, index: int) -> s.ChatCompletionChunk:
        return self._chunk(index, s.ChatDelta(role="assistant", content=""))

    def piece(self, choice: Choice, text: str, scores: Sequence[TokenScore]) -> Any:
        first = (
            choice.prompt_scores if self.show_prompt and len(choice.ids) == len(scores) else None
        )
        return self._chunk(choice.index, s.ChatDelta(content=text), None, scores, first)

    def calls(self, choice: Choice, calls: Sequence[Call]) -> s.ChatCompletionChunk:
        deltas = [
            s.ToolCallDelta(
                index=i,
                id=c.id,
                type="function",
                function=s.FunctionDelta(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(calls)
        ]
        return self._chunk(choice.index, s.ChatDelta(tool_calls=deltas))

    def end(self, choice: Choice) -> s.ChatCompletionChunk:
        return self._chunk(choice.index, s.ChatDelta(), choice.finish)

    def usage(self, usage: s.Usage) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, choices: Sequence[Choice], usage: s.Usage) -> s.ChatCompletion:
        out = []
        for c in choices:
            message = s.ChatMessage(
                content=c.text if c.text or not c.calls else None, tool_calls=tool_calls(c.calls)
            )
            logprobs = chat_logprobs(c.scores, self.tokens) if self.top is not None else None
            out.append(
                s.ChatChoice(
                    index=c.index,
                    message=message,
                    finish_reason=c.finish or "stop",
                    logprobs=logprobs,
                )
            )
        first = choices[0].prompt_scores if choices and self.show_prompt else None
        return s.ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=out,
            usage=usage,
            prompt_logprobs=prompt_logprobs(first, self.tokens) if first is not None else None,
        )


class Text(Format):
    prefix = "cmpl"

    def _chunk(self, choice: s.CompletionChoice) -> s.Completion:
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, choice: Choice, scores: Sequence[TokenScore], start: int) -> Any:
        if self.top is None:
            return None
        return completion_logprobs(scores, self.tokens, start)

    def start(self, index: int) -> None:
        return None

    def echoed(self, choice: Choice) -> s.Completion:
        """A stream's first chunk of an echoed choice: the prompt (and its scores)."""
        logprobs = None
        if self.top is not None and choice.prompt_scores is not None:
            logprobs = echoed_logprobs(choice.prompt, choice.prompt_scores, [], self.tokens)
        return self._chunk(
            s.CompletionChoice(index=choice.index, text=choice.prompt_text, logprobs=logprobs)
        )

    def piece(self, choice: Choice, text: str, scores: Sequence[TokenScore]) -> Any:
        first = (
            choice.prompt_scores if self.show_prompt and len(choice.ids) == len(scores) else None
        )
        start = len(choice.prompt_text) + len(choice.text) - len(text) if self.echo else 0
        return self._chunk(
            s.CompletionChoice(
                index=choice.index,
                text=text,
                logprobs=self._logprobs(choice, scores, start) if scores else None,
                prompt_logprobs=prompt_logprobs(first, self.tokens) if first is not None else None,
            )
        )

    def end(self, choice: Choice) -> s.Completion:
        return self._chunk(
            s.CompletionChoice(index=choice.index, text="", finish_reason=choice.finish)
        )

    def usage(self, usage: s.Usage) -> s.Completion:
        return s.Completion(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, choices: Sequence[Choice], usage: s.Usage) -> s.Completion:
        out = []
        for c in choices:
            text, logprobs = c.text, None
            if self.echo:
                text = c.prompt_text + c.text
                if self.top is not None and c.prompt_scores is not None:
                    logprobs = echoed_logprobs(c.prompt, c.prompt_scores, c.scores, self.tokens)
            elif self.top is not None:
                logprobs = completion_logprobs(c.scores, self.tokens)
            out.append(
                s.CompletionChoice(
                    index=c.index,
                    text=text,
                    finish_reason=c.finish or "stop",
                    logprobs=logprobs,
                    prompt_logprobs=(
                        prompt_logprobs(c.prompt_scores, self.tokens)
                        if c.prompt_scores is not None and self.show_prompt
                        else None
                    ),
                )
            )
        return s.Completion(
            id=self.id, created=self.created, model=self.model, choices=out, usage=usage
        )
