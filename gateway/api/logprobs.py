"""Engine logprobs (token ids and floats) → OpenAI's two wire formats: chat's per-token objects and the legacy
completions' parallel lists."""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.decode.detokenize import TokenVocab
from gateway.decode.engine import TokenLogprob
from gateway.schema.replies import ChatCompletionTokenLogprob, ChoiceLogprobs, CompletionLogprobs, TopLogprob

__all__ = ["LegacyLogprobs", "chat_logprobs"]

#: what OpenAI reports for a probability that underflows to zero (JSON has no -Infinity)
_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def chat_logprobs(vocab: TokenVocab, lps: Sequence[TokenLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                token=vocab.text(t.token_id),
                bytes=vocab.bytes(t.token_id),
                logprob=_finite(t.logprob if t.logprob is not None else _FLOOR),
                top_logprobs=[
                    TopLogprob(token=vocab.text(i), bytes=vocab.bytes(i), logprob=_finite(lp))
                    for i, lp in t.top
                ],
            )
            for t in lps
        ]
    )


class LegacyLogprobs:
    """Builds ``CompletionLogprobs`` for one choice; keeps the ``text_offset`` running across chunks."""

    def __init__(self, vocab: TokenVocab, start_offset: int = 0):
        self.vocab = vocab
        self.offset = start_offset

    def build(self, lps: Sequence[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for t in lps:
            text = self.vocab.text(t.token_id)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if t.logprob is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(t.logprob))
            top = {self.vocab.text(i): _finite(lp) for i, lp in t.top}
            top.setdefault(text, _finite(t.logprob))  # the sampled token is always listed, as in vLLM
            out.top_logprobs.append(top)
        return out
