"""Token ids → text, one token at a time, without ever emitting half a character.

Byte-level BPE tokens can end in the middle of a UTF-8 sequence, and SentencePiece decodes a token
differently depending on what precedes it; so a token's text is the difference between decoding a short
window with and without it, and a difference ending in U+FFFD is held until the next tokens complete it
(the approach of TGI and vLLM).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "TokenVocab"]

#: prompt tokens decoded before the first new one, so the first token is decoded in context
_CONTEXT_TOKENS = 5
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, context_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(context_ids[-_CONTEXT_TOKENS:]) if context_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            # keep the window short so a step costs the same at token 10 and at token 10,000
            if self._prefix_offset > 64:
                drop = self._prefix_offset
                self._ids = self._ids[drop:]
                self._prefix_offset -= drop
                self._read_offset -= drop
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete sequence becomes U+FFFD): the generation is over."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]


class TokenVocab:
    """Per-token strings and raw bytes for logprobs (cached: the same ids come back all the time)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._byte_decoder = _byte_level_decoder(tokenizer)
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _bytes(self, token_id: int) -> list[int]:
        if token_id in self._special:
            return list(self._text(token_id).encode())
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return list(self._text(token_id).encode())
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return [int(m.group(1), 16)]
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return [self._byte_decoder[c] for c in piece]
        return list(piece.replace("\u2581", " ").encode())

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special


def _byte_level_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's printable-char → byte table, when the tokenizer is byte-level BPE; else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in repr(decoder):
        return None
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}
