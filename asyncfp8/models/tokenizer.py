"""A byte-level tokenizer with no merges: one token per byte, nothing to download.

A genuine `Qwen2Tokenizer` with an empty merge list, so it loads back exactly as saved in
transformers and vLLM (why: docs/running.md, "Tiny models")."""

from __future__ import annotations

from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BYTE_VOCAB_SIZE = 256
# The smallest chat template that is one: each turn as "role: content" on its own line,
# then "assistant:" to generate. Plain bytes, no special tokens, so a tiny model reads it
# as text; it lets task=dataset's chat path run end to end on the project's own models.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)


def byte_vocab() -> dict[str, int]:
    """Byte-level symbol -> id, in byte order (the id of a byte is its value)."""
    symbols = bytes_to_unicode()
    return {symbols[b]: b for b in range(BYTE_VOCAB_SIZE)}


def build_byte_tokenizer() -> Qwen2Tokenizer:
    vocab = byte_vocab()
    vocab[EOS_TOKEN] = BYTE_VOCAB_SIZE
    vocab[PAD_TOKEN] = BYTE_VOCAB_SIZE + 1
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=EOS_TOKEN
    )
    # Decoder-only generation pads on the left so every prompt ends where sampling starts.
    tokenizer.padding_side = "left"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
