"""Structured outputs: a grammar the generated text must follow, compiled to a token mask per
step by llguidance (guidance-ai's Earley parser over the tokenizer's vocabulary: JSON schemas,
regular expressions, Lark and GBNF grammars, lists of choices).

Why llguidance and not xgrammar (both are what vLLM uses): llguidance's wheel depends on
nothing (xgrammar's pulls in torch and triton, gigabytes for a server that has no other use
for them), it compiles a grammar lazily (no per-grammar precompute of the whole vocabulary's
masks, so a new schema costs milliseconds before the first token), and it reads llama.cpp's
GBNF for llama-server's `grammar` field as well as Lark for vLLM's.

A request's grammar is compiled once into a matcher in its initial state, kept in an LRU
cache by (kind, text), and each sequence takes a copy of it (`Grammar.matcher`). At each step
the scheduler asks the copy which ids may come next (`allowed`: the mask, ANDed into the
row's allow bits, which the adjust_logits op applies on the device before the draw) and tells
it which one came (`accept`). Once the grammar is complete only the eos ids are allowed, so
the output ends there."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from qir.errors import UsageError

# Compiled grammars kept per engine.
CACHE_SIZE = 64
# The kinds a grammar is given as, and what each text is.
KINDS = ("json", "regex", "choice", "lark", "gbnf")


class Grammars:
    """One engine's grammar compiler: its tokenizer as llguidance sees it, and the cache."""

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        import llguidance

        self._ll = llguidance
        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos or None
        )
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()  # compiled on the event loop, copied on the engine's
        self.compiled = 0  # grammars compiled (cache misses)

    def compile(self, kind: str, spec: Any, field: str) -> Grammar:
        """The grammar `spec` of `kind` (a JSON schema as an object or its text, a regex, a
        list of strings, a Lark or GBNF text); a UsageError naming `field` where it is not
        one."""
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            source = self._source(kind, spec)
            matcher = self._ll.LLMatcher(self.tokenizer, source, log_level=0)
        except (ValueError, TypeError) as e:
            raise UsageError(f"{field}: not a valid {kind} grammar ({e})") from None
        if matcher.is_error():
            raise UsageError(f"{field}: not a valid {kind} grammar ({matcher.get_error()})")
        grammar = Grammar(matcher, self.vocab)
        with self._lock:
            self.compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _source(self, kind: str, spec: Any) -> str:
        ll = self._ll
        if kind == "json":
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is an object")
            # compact JSON: no runs of whitespace for a sampler to wander into
            return str(
                ll.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})
            )
        if kind == "regex":
            return str(ll.LLMatcher.grammar_from_regex(spec))
        if kind == "choice":
            if not (isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)):
                raise ValueError("choices are a non-empty list of strings")
            return str(ll.grammar_from("choice", spec))
        if kind == "lark":
            return str(ll.LLMatcher.grammar_from_lark(spec))
        if kind == "gbnf":
            return str(ll.grammar_from("gbnf", spec))
        raise ValueError(f"unknown kind {kind!r}")


class Grammar:
    """A compiled grammar; `matcher()` starts a sequence's walk through it."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self._initial = matcher
        self.vocab = vocab

    def matcher(self) -> Matcher:
        return Matcher(self._initial.deep_copy(), self.vocab)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self._m = matcher
        self.vocab = vocab
        self._mask = np.zeros((1, -(-vocab // 32)), np.int32)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the ids that may come next."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, self._mask)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        return bits[: self.vocab].astype(bool)

    def accept(self, token: int) -> None:
        self._m.consume_token(token)

    @property
    def done(self) -> bool:
        return bool(self._m.is_stopped())
