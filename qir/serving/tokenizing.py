"""Tokenizing, chat templating and detokenizing for the HTTP server, in a worker process: off
the event loop and off the engine's step loop. Hugging Face's `tokenizers` holds the GIL while
it encodes (seconds for a few MB of text), so a thread would stall both; a process stalls
neither, and what a huge text costs in memory stays out of the server.

A prompt's tokens are capped before any of that work: a text longer (in characters) than
`cap` tokens can cover is refused as it is (PromptTooLong, with the fewest tokens it can be).
Each token of a BPE tokenizer stands for at most as many characters as its vocabulary entry
spells, so `cap` tokens cover at most `cap` times the longest entry; SLACK covers normalizers
that shrink text (NFC, strip). Tokenizers where one token can stand for any length of text (an
unknown-token fused over a run, a word-level model) get no such cap: their texts are tokenized
in the worker, and the caller checks the count."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qir.errors import QirError

# How much a normalizer may shrink text before it is tokenized, at most.
SLACK = 4


class PromptTooLong(QirError):
    """A text longer than `cap` tokens, refused before it was tokenized."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least

    def __reduce__(self) -> Any:  # raised in the worker, re-raised here
        return (PromptTooLong, (self.at_least,))


def longest_piece(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for (None: no bound)."""
    model = tokenizer.backend.model
    if type(model).__name__ != "BPE":
        return None
    if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
        return None  # a run of unknown characters becomes one token
    return max(len(t) for t in tokenizer.backend.get_vocab(with_added_tokens=True))


class TextWorker:
    """The checkpoint's tokenizer and chat template in a worker process (started by `start`,
    stopped by `close`), for texts of at most `cap` tokens."""

    def __init__(self, checkpoint: Path, cap: int, longest: int | None) -> None:
        self.checkpoint = checkpoint
        self.cap = cap
        self.per_token = None if longest is None else longest * SLACK
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker and load the tokenizer there, without waiting for it."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_load,
                initargs=(self.checkpoint, self.cap, self.per_token),
            )
            self._pool.submit(_ready)

    def kill(self) -> None:
        """Stop the worker now (the server is stopping at once)."""
        if self._pool is not None:
            for process in list(self._pool._processes.values()):  # no public way before 3.14
                process.kill()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def check(self, text: str) -> None:
        """PromptTooLong where `text` cannot fit in `cap` tokens, before it goes anywhere."""
        _check(text, self.cap, self.per_token)

    async def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        self.check(text)
        return tuple(await self._run(_encode, text, add_special_tokens))

    async def chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        add_special_tokens: bool = False,
        **extra: Any,
    ) -> tuple[int, ...]:
        """The ids of the messages through the chat template (the assistant's turn opened);
        the cap applies to the text the template makes (it may leave parts out).
        continue_final: the text ends with the last message's content (vLLM's
        continue_final_message: the model continues it); extra: the template's other variables
        (tools, documents, chat_template_kwargs)."""
        return tuple(
            await self._run(
                _chat, messages, add_generation_prompt, continue_final, add_special_tokens, extra
            )
        )

    async def decode(self, ids: Sequence[int]) -> str:
        return str(await self._run(_decode, list(ids)))

    async def _run(self, fn: Any, *args: Any) -> Any:
        self.start()
        assert self._pool is not None
        try:
            return await asyncio.wrap_future(self._pool.submit(fn, *args))
        except concurrent.futures.process.BrokenProcessPool:
            self._pool = None  # the worker died (killed, out of memory): a new one next time
            raise


# The worker's side.

_STATE: dict[str, Any] = {}


def _load(checkpoint: Path, cap: int, per_token: int | None) -> None:
    from qir.text import ChatTemplate, Tokenizer

    tokenizer = Tokenizer.load(checkpoint)
    _STATE.update(tokenizer=tokenizer, cap=cap, per_token=per_token, template=None)
    try:
        _STATE["template"] = ChatTemplate.load(tokenizer)
    except QirError as e:  # a checkpoint without one: chat requests hear why
        _STATE["template_error"] = e


def _ready() -> None:
    pass


def _check(text: str, cap: int, per_token: int | None) -> None:
    if per_token is not None and len(text) > cap * per_token:
        raise PromptTooLong(-(-len(text) // per_token))


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    return list(_STATE["tokenizer"].encode(text, add_special_tokens=add_special_tokens))


def _chat(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final: bool = False,
    add_special_tokens: bool = False,
    extra: dict[str, Any] | None = None,
) -> list[int]:
    template = _STATE["template"]
    if template is None:
        raise _STATE["template_error"]
    text = template.render(messages, _STATE["tokenizer"], add_generation_prompt, **(extra or {}))
    if continue_final:  # cut what the template closes the last message with
        last = str(messages[-1].get("content") or "")
        at = text.rfind(last) if last else -1
        if at >= 0:
            text = text[: at + len(last)]
    _check(text, _STATE["cap"], _STATE["per_token"])  # what the template made of the messages
    return _encode(text, add_special_tokens)


def _decode(ids: list[int]) -> str:
    return str(_STATE["tokenizer"].decode(ids))
