"""Next-token choice from one step's logits: pure torch, no model, no I/O.

Order (as in vLLM): logit bias → repetition / frequency / presence penalties → greedy argmax when
``temperature == 0``, else temperature → top-k → top-p → min-p → a draw from a seeded ``torch.Generator``, so
a request that names a seed reproduces its tokens. A grammar constraint (structured outputs,
gateway/grammars/structured.py) masks what its grammar forbids after the penalties and before the greedy/random choice,
so the seeded draws stay reproducible. Logprobs are reported from the log-softmax of the model's
raw logits (before any of the above), as OpenAI does.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["LogitsConstraint", "SamplingParams", "Sampler", "choice_seed", "top_logprobs"]

_MASK64 = (1 << 64) - 1


class LogitsConstraint(Protocol):
    """What a choice's output must match (gateway/grammars/structured.py's ``GrammarConstraint``)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor: ...  # forbidden tokens → -inf, in place
    def consume(self, token_id: int) -> None: ...
    def accepted_prefix(self, token_ids: Sequence[int]) -> int: ...  # how many it would take, in order

    @property
    def done(self) -> bool: ...  # nothing more may follow


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 or negative: off
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    #: makes each choice's constraint (structured outputs); None: any text
    constraint: Callable[[], LogitsConstraint] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choice_seed(seed: int | None, index: int) -> int | None:
    """Seed of choice ``index`` of a request seeded with ``seed``: fixed, distinct per choice, and not
    simply ``seed + index`` (which would make choice 1 of seed 7 equal choice 0 of seed 8)."""
    if seed is None:
        return None
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64  # splitmix64 finalizer
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    """The sampling state of one choice: its generator and the counts its penalties need."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]):
        self.params = params
        self.generator = torch.Generator()
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(seed)
        self._prompt_ids = list(prompt_ids)
        self._output_ids: list[int] = []
        self.constraint = params.constraint() if params.constraint is not None else None

    def observe(self, token_id: int) -> None:
        """Record a sampled token (penalties see it from the next step on, the constraint at once)."""
        self._output_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.consume(token_id)

    def allowed_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (guesses to follow what was observed) could be sampled in order: the
        constraint's accepted prefix, all of them without one. The state is left as it is."""
        return len(token_ids) if self.constraint is None else self.constraint.accepted_prefix(token_ids)

    @property
    def finished(self) -> bool:
        """The constraint allows no further token: the choice is complete."""
        return self.constraint is not None and self.constraint.done

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits [vocab]`` → the next token id."""
        p = self.params
        logits = self.process(logits)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        if p.greedy:
            return int(torch.argmax(logits))
        # in float64 and shifted so the best logit is 0: a tiny temperature (1e-39, 5e-324, which is 0 as a
        # float32) gives -inf for the rest instead of inf - inf = nan, i.e. the argmax (ties shared), its limit
        logits = (logits.double() - logits.max()) / p.temperature
        if p.top_k > 0:
            logits = _top_k(logits, p.top_k)
        if p.top_p < 1.0:
            logits = _top_p(logits, p.top_p)
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Logit bias and penalties: everything that does not depend on temperature."""
        p = self.params
        logits = logits.float().clone()
        vocab = logits.shape[-1]
        if p.logit_bias:
            ids = torch.tensor([i for i in p.logit_bias if 0 <= i < vocab], dtype=torch.long)
            if len(ids):
                logits[ids] += torch.tensor([p.logit_bias[int(i)] for i in ids], dtype=logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self._prompt_ids) | set(self._output_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            if len(seen):
                vals = logits[seen]
                logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self._output_ids:
            counts = torch.bincount(torch.tensor(self._output_ids, dtype=torch.long), minlength=vocab)[:vocab]
            logits -= p.frequency_penalty * counts.to(logits.dtype)
            logits -= p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token_id`` and the ``k`` most likely tokens, from the raw ``logits [vocab]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logprobs[token_id])
    if k <= 0:
        return chosen, []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return chosen, [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p`` (at least one)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # drop a token when the mass *before* it already reaches top_p
    drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
