"""A choice's first token: feeding its prompt to a session (only what a reused session does not hold yet),
scoring the prompt when ``prompt_logprobs`` asks for it, and sampling with the token's logprobs.

These run in the engine's backend threads (``SessionHandle.call``): every call here may block on the swarm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gateway.affinity.sessions import common_prefix
from gateway.backends.base import DecodeSession
from gateway.decode.choices import ChoiceSpec, TokenLogprob
from gateway.decode.sampling import Sampler, top_logprobs

__all__ = ["first_token", "max_length", "prefill", "reusable_prefix", "sample", "score_prompt"]


def max_length(spec: ChoiceSpec) -> int:
    """What the choice needs, never more: servers grow caches on demand, and a reused session's cap is
    raised when a later turn resumes it (a session sized for a 128k context window would be refused by
    every server whose budget is smaller, and would hold nothing more anyway)."""
    return len(spec.prompt_ids) + spec.max_tokens


def reusable_prefix(held: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """Prompt tokens a session holding ``held`` need not be sent: the common prefix, but never the
    whole prompt (its last token is fed again for its logits)."""
    return min(common_prefix(held, prompt_ids), len(prompt_ids) - 1)


def prefill(session: DecodeSession, prompt_ids: list[int]) -> torch.Tensor:
    """Feed what the session does not hold yet; rolls back to the common prefix of a reused session."""
    common = reusable_prefix(session.token_ids, prompt_ids)
    if common < session.position:
        session.rollback(common)
    return session.step(prompt_ids[common:])


def score_prompt(session: DecodeSession, prompt_ids: list[int], k: int) -> tuple[torch.Tensor, list]:
    """Feed the prompt one token at a time to see every position's logits (the protocol only returns the
    last one). Returns the last logits and one TokenLogprob per prompt token."""
    if session.position:
        session.rollback(0)
    scored = [TokenLogprob(prompt_ids[0], None, [])]
    logits = session.step(prompt_ids[:1])
    for token in prompt_ids[1:]:
        chosen, top = top_logprobs(logits, token, k)
        scored.append(TokenLogprob(token, chosen, top))
        logits = session.step([token])
    return logits, scored


def sample(logits: torch.Tensor, sampler: Sampler, k: int | None) -> tuple[int, TokenLogprob | None]:
    token = sampler(logits)
    sampler.observe(token)
    if k is None:
        return token, None
    chosen, top = top_logprobs(logits, token, k)
    return token, TokenLogprob(token, chosen, top)


def first_token(
    session: DecodeSession, spec: ChoiceSpec, sampler: Sampler
) -> tuple[int, TokenLogprob | None, list[TokenLogprob] | None, int]:
    """The first sampled token, its logprob, the prompt's logprobs, and the prompt tokens reused."""
    if spec.prompt_logprobs:
        logits, scored = score_prompt(session, spec.prompt_ids, spec.logprobs or 0)
        cached = 0
    else:
        cached = reusable_prefix(session.token_ids, spec.prompt_ids)
        logits, scored = prefill(session, spec.prompt_ids), None
    token, lp = sample(logits, sampler, spec.logprobs)
    return token, lp, scored, cached
