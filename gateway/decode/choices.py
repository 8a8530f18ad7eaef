"""What a request asks of the engine per choice (``ChoiceSpec``) and what comes back: ``Delta``s as the choice
decodes, a ``ChoiceResult`` when they are added up, ``TokenLogprob``s inside both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.decode.sampling import SamplingParams
from gateway.speculation.verify import SpeculationStats

__all__ = ["ChoiceResult", "ChoiceSpec", "Delta", "FinishReason", "TokenLogprob"]

#: why a choice ended: a stop string or EOS, or its ``max_tokens``
FinishReason = Literal["stop", "length"]


@dataclass
class ChoiceSpec:
    """Everything one choice needs, already validated."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str] = ()
    #: None: no logprobs; k >= 0: the chosen token's logprob and the k most likely tokens
    logprobs: int | None = None
    #: also score the prompt's tokens (completions with echo + logprobs): costs one step per prompt token
    prompt_logprobs: bool = False
    #: special tokens come out as text (a tool-call opener such as ``[TOOL_CALLS]`` is one)
    keep_special_tokens: bool = False
    #: speculative decoding (gateway/speculation/verify.py): ``auto`` (the gateway's setting), ``off``,
    #: ``prompt_lookup`` or ``draft_model``
    speculation: str = "auto"
    #: text the drafter may copy from besides the prompt (OpenAI's ``prediction`` content), as token ids
    reference_ids: Sequence[int] = ()
    #: the served LoRA adapter the choice runs (the request's ``model``; None: the base model)
    adapter: str | None = None


@dataclass
class TokenLogprob:
    token_id: int
    #: None for the first prompt token, which nothing predicts
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    """What one choice emits: new text, the logprobs of the tokens it accounts for, at the end a reason."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    #: tokens sampled so far by this choice (EOS included); final on the finishing delta
    completion_tokens: int = 0
    #: on a choice's first delta only, when ``ChoiceSpec.prompt_logprobs``
    prompt_logprobs: list[TokenLogprob] | None = None
    #: prompt tokens whose caches were reused instead of sent (on every delta; final on the finishing one)
    cached_tokens: int = 0
    #: the choice's speculative decoding so far (None: it decodes without guesses)
    speculation: SpeculationStats | None = None


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    speculation: SpeculationStats | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        self.speculation = delta.speculation
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
