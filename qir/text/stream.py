"""Text as it is generated: incremental detokenization and stop strings.

Detokenization decodes a window of the ids (from a few ids back) and prints what the newest id
added to the window's text, holding it back while the text ends in an incomplete UTF-8
character (U+FFFD) and while a run of byte-fallback pieces (<0xNN>) goes on: such a run decodes
as one string, a later byte can turn the whole run into U+FFFDs. Decoding from a few ids back,
rather than only the new id, keeps the spaces a SentencePiece-style decoder drops from the
first piece of a text, so what is printed concatenates to decoding all the ids at once and is
at every point a prefix of it.

Stop strings: text that might be the start of one is held back until it is known not to be;
a stop string found ends the text before it (it is not part of the text, as OpenAI's `stop`).

Special tokens are skipped, as `skip_special_tokens` does, except those in `keep`: a tool-call
parser reads markers that tokenizers hold as special tokens (Mistral's [TOOL_CALLS])."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from qir.text.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        keep_stop: bool = False,
        keep: Collection[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.keep_stop = keep_stop  # the text ends after the stop string, not before it
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # the ids whose text has been taken
        self._held = ""  # text that may begin a stop string
        self.stopped = False  # a stop string was found: nothing more comes out
        self._byte_ids = tokenizer.byte_ids - frozenset(keep)
        # Decoded without skipping, less the special ids not kept: the kept ones print
        self._skipped = tokenizer.special_ids - frozenset(keep) if keep else None

    def _decode(self, start: int, end: int | None = None) -> str:
        if self._skipped is None:
            return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True)
        ids = [t for t in self.ids[start:end] if t not in self._skipped]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token: int) -> str:
        """The text that `token` completes (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        if token in self._byte_ids:
            return ""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(after[len(before) :])

    def finish(self) -> str:
        """The rest, once no id comes any more (an incomplete character prints as U+FFFD, as
        decoding all the ids does)."""
        if self.stopped:
            return ""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        self._prefix = self._read = len(self.ids)
        text = self._release(after[len(before) :]) if len(after) > len(before) else ""
        text, self._held = text + self._held, ""
        return text

    def _release(self, piece: str) -> str:
        text = self._held + piece
        if not self.stop:
            self._held = ""
            return text
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            at, first = min(hits)
            return text[: at + (len(first) if self.keep_stop else 0)]
        keep = max((self._partial(text, s) for s in self.stop), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    @staticmethod
    def _partial(text: str, stop: str) -> int:
        """The length of the longest end of `text` that begins `stop`."""
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-n:]):
                return n
        return 0
