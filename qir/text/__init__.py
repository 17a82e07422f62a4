"""Text in, text out: the checkpoint's own tokenizer (tokenizer.json through Hugging Face's
`tokenizers`), its chat template (rendered as transformers renders it), its generation
defaults, and streaming detokenization with stop strings. The compiler still sees ids."""

from qir.text.chat import ChatTemplate
from qir.text.generation_config import GenerationConfig
from qir.text.stream import TextStream
from qir.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "GenerationConfig", "TextStream", "Tokenizer"]
