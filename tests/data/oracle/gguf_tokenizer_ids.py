"""llama.cpp's token ids of a corpus, the reference for qir's GGUF tokenizers:
`python gguf_tokenizer_ids.py OUT.json NAME=MODEL.gguf ...` with llama-cpp-python 0.3.36.

The corpus (`corpus()`, written into OUT.json with the ids) is 240 strings: prose, code with
tabs and runs of spaces, numbers, emoji, CJK, accents, chat special tokens, leading and
trailing spaces and newlines, the empty string; each base string as it is, with a leading
space, with a trailing newline and with its spaces doubled. Each model's ids are
`Llama(model_path, vocab_only=True).tokenize(text, add_bos=True, special=True)`: BOS as the
vocabulary adds it, special tokens in the text matched (as qir's tokenizer matches added
tokens). OUT.json: {"corpus": [...], "ids": {NAME: [[id, ...], ...]}}.
"""

from __future__ import annotations

import json
import sys

import llama_cpp

BASE = [
    "",
    "Hello world",
    "hello World!",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Once upon a time, there was a small model that answered questions.",
    "I'm sure they'll say it's fine, but we've seen what you'd do.",
    "SHOUTING AND whispering, MiXeD cAsE.",
    "def f(x):\n\treturn x * 2\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i];\n}",
    "    indented with four spaces",
    "\ttab\tseparated\tvalues\t",
    "trailing spaces    ",
    "a  b   c    d     e",
    "line one\nline two\n\nline four\r\nwindows line",
    "\n\n\n",
    "   ",
    "12345",
    "3.14159 and 2.71828",
    "Phone: +1 (555) 123-4567, year 2024, 1,000,000 dollars",
    "0x1F 0b1010 1e-9 -42",
    "Emoji: 😀 🎉 👍🏽 🇫🇷",
    "🤖🤖🤖",
    "日本語のテキスト",
    "中文分词测试\uff0c标点\u3002",  # fullwidth comma and full stop
    "한국어 문장입니다.",
    "Café, naïve, façade, jalapeño, Ångström, Straße",
    "Привет, мир!",
    "مرحبا بالعالم",
    "Ελληνικά γράμματα",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|>",
    "text<|im_end|>more",
    "<|endoftext|>",
    "https://example.com/path?query=1&b=2#frag",
    "user@example.com",
    "C:\\Windows\\System32",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<html><body><p>Hi</p></body></html>",
    "SELECT * FROM table WHERE id = 7;",
    "$$\\int_0^1 x^2 dx = 1/3$$",
    "...!!!???---___",
    "'s 't 're 've 'm 'll 'd",
    "don't DON'T Don'T",
    "a\u00a0b\u2009c\u3000d",
    "zero\u200bwidth",
    "x" * 40,
    "ab" * 20,
    "the the the the the",
    "Mr. Smith went to Washington D.C. on Jan. 5th.",
    " leading space",
    "  two leading spaces",
    "tabs\t\t\tand spaces   mixed \t \t",
    "numbers123mixed456with789letters",
    "αβγδε 123 ΑΒΓ",
    "résumé café naïve",
    "\u00e9 vs e\u0301",
    "🙂 smile, 🙃 upside down",
    "end.",
    "?",
]


def corpus() -> list[str]:
    out: list[str] = []
    for s in BASE:
        for v in (s, " " + s, s + "\n", s.replace(" ", "  ")):
            if v not in out:
                out.append(v)
    return out


def ids(model: str, texts: list[str]) -> list[list[int]]:
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]
    finally:
        llm.close()


if __name__ == "__main__":
    texts = corpus()
    assert len(texts) >= 200, len(texts)
    out = {"corpus": texts, "ids": {}}
    for spec in sys.argv[2:]:
        name, _, path = spec.partition("=")
        out["ids"][name] = ids(path, texts)
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)
        f.write("\n")
