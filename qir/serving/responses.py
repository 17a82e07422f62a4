"""The response bodies and stream chunks of /v1/chat/completions and /v1/completions: one
Format per endpoint turns a generation's text, finish reason and usage into OpenAI's shapes,
all of one response sharing an id and a creation time."""

from __future__ import annotations

import time
import uuid
from typing import Any

from qir.serving import schemas as s


class Format:
    prefix = ""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def start(self) -> Any | None:
        """The chunk a stream opens with, if the endpoint has one."""
        return None

    def piece(self, text: str) -> Any:
        raise NotImplementedError

    def end(self, finish: str) -> Any:
        raise NotImplementedError

    def usage(self, usage: s.Usage) -> Any:
        raise NotImplementedError

    def whole(self, text: str, finish: str, usage: s.Usage) -> Any:
        raise NotImplementedError


class Chat(Format):
    prefix = "chatcmpl"

    def _chunk(self, delta: s.ChatDelta, finish: str | None = None) -> s.ChatCompletionChunk:
        choice = s.ChatChunkChoice(delta=delta, finish_reason=finish)
        return s.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def start(self) -> s.ChatCompletionChunk:
        return self._chunk(s.ChatDelta(role="assistant", content=""))

    def piece(self, text: str) -> s.ChatCompletionChunk:
        return self._chunk(s.ChatDelta(content=text))

    def end(self, finish: str) -> s.ChatCompletionChunk:
        return self._chunk(s.ChatDelta(), finish)

    def usage(self, usage: s.Usage) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, text: str, finish: str, usage: s.Usage) -> s.ChatCompletion:
        choice = s.ChatChoice(message=s.ChatMessage(content=text), finish_reason=finish)
        return s.ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        )


class Text(Format):
    prefix = "cmpl"

    def _chunk(self, text: str, finish: str | None = None) -> s.Completion:
        choice = s.CompletionChoice(text=text, finish_reason=finish)
        return s.Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def piece(self, text: str) -> s.Completion:
        return self._chunk(text)

    def end(self, finish: str) -> s.Completion:
        return self._chunk("", finish)

    def usage(self, usage: s.Usage) -> s.Completion:
        return s.Completion(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, text: str, finish: str, usage: s.Usage) -> s.Completion:
        return s.Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[s.CompletionChoice(text=text, finish_reason=finish)],
            usage=usage,
        )
