"""A byte-level tokenizer: UTF-8 bytes are ids 0–255, then a few special tokens.

Chosen because it works offline with nothing to download and never fails on any text; the
decoder's vocabulary (model preset ``vocab_size``) only needs to hold :data:`VOCAB_SIZE` ids.
Text tokens are about 4× denser than a BPE tokenizer's, which the useful-token counts reflect.
"""

from __future__ import annotations

NAME = "byte-level"
"""The tokenizer as the measurement contract names it (token counts depend on it)."""
PAD = 256
BOS = 257
EOS = 258
IMAGE_START = 259
IMAGE_END = 260
IMAGE = 261
"""Placeholder id at the positions where projected image embeddings replace token embeddings."""
VOCAB_SIZE = 262


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
