"""Writes the tokenizer files of the test fixtures and the embedded checkpoints.

The fixtures' models are tiny random Llamas with a vocabulary of 256 ids (bos 1, eos 2), whose
producers dropped the tokenizer files. These two tokenizers are trained here with Hugging Face's
`tokenizers` on a small fixed corpus, so that every text path (encoding, chat templates,
streaming detokenization) runs on a real checkpoint layout:

- byte-level BPE (GPT-2 / Llama 3 / Qwen style): ByteLevel pre-tokenizer and decoder, a
  post-processor that adds the BOS token, ChatML chat template in tokenizer_config.json;
- SentencePiece-style BPE (Llama 2 / Mistral style): Metaspace pre-tokenizer, the ▁ -> space
  decoder, a post-processor that adds BOS (`add_bos_token` in tokenizer_config.json, which
  transformers 5 ignores beside a tokenizer.json), and an [INST] chat template that raises on
  roles out of order, in chat_template.jinja.

Both fit 256 ids: the byte-level one learns only the bytes its corpus has (other bytes are
dropped by the tokenizer, as `tokenizers` does for an unknown byte without a fallback).

Run from the repository root: `python scripts/make_fixture_tokenizers.py`. The output is
committed; training is deterministic for a given `tokenizers` version.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 256

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A compiler turns quantized matrix products into fused kernels that run on the GPU.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Weights are packed in groups; each group has its own scale and zero point.",
    "The model reads the prompt once, then writes one token at a time.",
    "Numbers you can trust come from a reference that is simple to read.",
    "café, naïve, déjà vu — “quoted” text, 日本語 and an emoji 🙂 in one line.",
    "User: what is the capital of France? Assistant: Paris is the capital of France.",
    "system prompt: you are a helpful assistant. Answer briefly and clearly.",
    "0123456789 + - * / = ( ) [ ] { } < > # @ & % $ ! ? ; : ' \" _ ~ ^ | \\ `",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz",
    "Lines end in newlines.\nTabs\tseparate columns.\n\nA blank line ends a paragraph.",
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

INST = """{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system is not none %}
            {{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""


def byte_level() -> tuple[Tokenizer, dict[str, object], str | None]:
    specials = ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # The bytes the corpus uses, in ByteLevel's printable mapping.
    alphabet = sorted({c for line in CORPUS for c in _byte_chars(line)})
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
        "chat_template": CHATML,
    }
    return tok, config, None


def _byte_chars(text: str) -> list[str]:
    table = pre_tokenizers.ByteLevel.alphabet()
    mapping = _bytes_to_unicode()
    assert set(mapping.values()) <= set(table)
    return [mapping[b] for b in text.encode()]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def sentencepiece_style() -> tuple[Tokenizer, dict[str, object], str | None]:
    specials = ["<unk>", "<s>", "</s>"]
    # byte_fallback as real Llama 2 / Mistral tokenizer.json files have it (transformers' Llama
    # class rebuilds the model so); with no <0xNN> pieces an unknown character is dropped.
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    config = {
        # Not LlamaTokenizerFast: transformers 5 rebuilds that class's model from the vocab
        # (dropping a character with no piece, where this file's <unk> keeps it); with all 256
        # byte pieces, as real Llama 2 files have, the two agree.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
    }
    return tok, config, INST


KINDS = {"byte_level": byte_level, "sentencepiece": sentencepiece_style}
# Which checkpoint folders get which tokenizer.
TARGETS = {
    "byte_level": [
        "tests/data/awq_gemm_g64_S",
        "tests/data/awq_gemv_g64_S",
        "tests/data/ct_fp8_dynamic_S",
        "tests/data/ct_mxfp4a16_S",
        "tests/data/ct_nvfp4_w4a4_S",
        "tests/data/ct_nvfp4a16_S",
        "tests/data/ct_w4a16_int4_S",
        "tests/data/modelopt_nvfp4_S",
        "qir/models/embedded/awq_gemm_g64_S",
        "qir/models/embedded/ct_nvfp4_w4a4_S",
    ],
    "sentencepiece": [
        "tests/data/mlx_affine4_g64_S",
        "tests/data/mlx_affine8_g64_S",
        "tests/data/mlx_mixed_3_6_S",
        "tests/data/mlx_nvfp4_S",
        "qir/models/embedded/mlx_affine4_g64_S",
        "qir/models/embedded/mlx_mixed_3_6_S",
    ],
}


def main() -> None:
    for kind, folders in TARGETS.items():
        tok, config, template = KINDS[kind]()
        assert tok.get_vocab_size() <= VOCAB, (kind, tok.get_vocab_size())
        for folder in folders:
            out = ROOT / folder
            tok.save(str(out / "tokenizer.json"))
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
            if template is not None:
                (out / "chat_template.jinja").write_text(template)
        print(f"{kind}: {tok.get_vocab_size()} ids -> {len(folders)} folders")


if __name__ == "__main__":
    main()
