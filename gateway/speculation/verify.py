"""Speculative decoding at the head: several tokens for one trip along the chain, exactly.

A trip through the swarm costs at least one pass along the chain of servers, however fast their GPUs
are. A drafter (gateway/speculation/drafting.py: prompt lookup, or a small local model) guesses the next tokens; the
step that feeds the last sampled token also feeds the ``k`` guesses, so the servers compute them as one
short prefill and the head gets the logits of every position. ``verify`` then samples each position in
order with the choice's own ``Sampler`` and keeps the guesses as long as each equals what was sampled;
the first sample that differs (or the one after the last guess) is the next token. The servers are
rolled back past the rejected guesses (the next step overwrites their caches from there).

Why this is exact: every token comes out of the same ``Sampler`` call on the same logits as plain
decoding would make, in the same order, so greedy output is identical and a seeded run draws the same
random numbers. For a drafter that proposes one token (a point mass ``q``), accepting the guess ``d``
exactly when the sample equals it is the standard rejection-sampling rule: it is accepted with
probability ``p(d) = min(1, p(d) / q(d))``, and otherwise the token is distributed as ``p`` without ``d``,
renormalised, which is ``norm(max(0, p − q))``. Drafters here draft greedily, so the rule applies as is.

How many guesses (``SpeculationPlanner``): a step of ``1 + k`` tokens is worth it when the tokens it is
expected to yield, ``(1 − α^(k+1)) / (1 − α)`` for a per-guess acceptance rate ``α``, outweigh its cost
relative to a one-token step, the drafter's own time for ``k`` guesses included (a draft model's are not
free: one that costs more than it saves turns itself off). ``α`` is measured per choice (a decaying count,
starting from a prior); the cost of a longer step is measured by the engine (``StepCosts``): on a CPU
server each extra token costs compute, on a GPU or over a fast network almost nothing, and the planner picks
``k`` accordingly, down to 0 (plain decoding) where guessing does not pay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from gateway.backends.base import DecodeSession
    from gateway.speculation.drafting import Drafter

logger = logging.getLogger(__name__)

__all__ = [
    "DRAFTERS",
    "ChoiceSpeculator",
    "MAX_DRAFT_TOKENS",
    "SPECULATION_MODES",
    "SpeculationPlanner",
    "SpeculationStats",
    "SpeculationMode",
    "StepCosts",
    "expected_tokens",
    "verify",
]

SpeculationMode = Literal["auto", "off", "prompt_lookup", "draft_model"]
#: ``auto``: the gateway's default (a draft model when one is loaded, else prompt lookup); ``off``: none
SPECULATION_MODES: tuple[str, ...] = ("auto", "off", "prompt_lookup", "draft_model")
DRAFTERS: tuple[str, ...] = ("prompt_lookup", "draft_model")
#: the most guesses one step may carry (the gateway's ``--max-draft-tokens`` is at most this)
MAX_DRAFT_TOKENS = 16

T = TypeVar("T")


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    sample: Callable[[torch.Tensor], tuple[int, T]],
    stop: Callable[[int], bool],
) -> list[tuple[int, T]]:
    """The tokens one speculative step yields: ``logits [1 + len(drafts), vocab]`` are the step's positions
    (the last sampled token, then each guess); ``sample(row)`` samples (and records) one token the way
    plain decoding does. Guesses are kept while each equals its position's sample; the list ends with the
    first sample that is not a kept guess. ``stop(token)`` (EOS, a finished grammar) ends it early: what
    would follow is never used.

    Constraints hold by the same rule: ``sample`` masks each row with the choice's grammar at the state the
    tokens before it left (and advances it by the token it returns), so a guess the grammar forbids there
    can never equal the sample, and the token that completes the grammar is always the last of the list —
    what the caller must end the choice on, not on the grammar's state after the whole list."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(
            f"{logits.shape[0]} positions of logits for {len(drafts)} guesses (expected {len(drafts) + 1})"
        )
    out: list[tuple[int, T]] = []
    for i in range(len(drafts) + 1):
        token, extra = sample(logits[i])
        out.append((token, extra))
        if i == len(drafts) or token != drafts[i] or stop(token):
            break
    return out


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step with ``k`` guesses yields on average when each guess is accepted with probability
    ``alpha`` (independently, up to the first miss): ``1 + α + … + α^k``."""
    return float(sum(alpha**i for i in range(k + 1)))


class StepCosts:
    """How long a decode step takes by the tokens it feeds, learnt from the engine's steps (thread-safe).

    ``base``: a one-token step; ``per_token``: what each further token adds. Both are moving averages that
    each step moves by ``DECAY``; ``per_token`` starts at ``PRIOR_PER_TOKEN`` of a one-token step (a fresh
    gateway tries a few guesses, then knows) and one observation counts at most ``MAX_PER_TOKEN`` steps per
    token (a first call of a new shape can be slow for reasons that will not repeat)."""

    PRIOR_PER_TOKEN = 0.05
    MAX_PER_TOKEN = 2.0
    DECAY = 0.1
    #: after this many steps with guesses and none without, ``base`` is stale (see ``wants_one_token_step``)
    REFRESH_BASE_AFTER = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.base: float | None = None
        self.per_token: float | None = None
        self._since_base = 0

    def wants_one_token_step(self) -> bool:
        """No one-token step measured yet, or none for ``REFRESH_BASE_AFTER`` steps: on a gateway where every
        choice guesses (a draft model) nothing else would measure it, and without it a draft model's own time
        could not be weighed against a trip."""
        with self._lock:
            return self.base is None or self._since_base >= self.REFRESH_BASE_AFTER

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds <= 0:
            return
        with self._lock:
            self._since_base = 0 if tokens == 1 else self._since_base + 1
            if tokens == 1:
                self.base = seconds if self.base is None else self.base + self.DECAY * (seconds - self.base)
            elif self.base is not None:
                extra = min(max(0.0, (seconds - self.base) / (tokens - 1)), self.MAX_PER_TOKEN * self.base)
                known = self.per_token if self.per_token is not None else self.PRIOR_PER_TOKEN * self.base
                self.per_token = known + self.DECAY * (extra - known)

    def relative_cost(self, k: int) -> float:
        """The cost of a step with ``k`` guesses, as a multiple of a one-token step."""
        with self._lock:
            base, per_token = self.base, self.per_token
        if base is None or per_token is None or base <= 0:
            return 1.0 + self.PRIOR_PER_TOKEN * k
        return 1.0 + k * per_token / base


@dataclass
class SpeculationStats:
    """One choice's speculation so far (its usage reports these)."""

    drafter: str
    #: guesses sent along with a step
    drafted: int = 0
    #: guesses kept (each is an output token that cost no trip of its own)
    accepted: int = 0
    #: steps that carried guesses
    steps: int = 0
    #: steps whose guesses were drafted while the step before travelled (gateway/speculation/draft_ahead.py)
    drafted_ahead: int = 0


class SpeculationPlanner:
    """Picks how many guesses each of one choice's steps carries and keeps its acceptance rate."""

    #: prior acceptance: ``PRIOR_ACCEPTED`` of ``PRIOR_TRIALS`` guesses; older evidence decays by ``DECAY``
    PRIOR_ACCEPTED = 1.0
    PRIOR_TRIALS = 2.0
    DECAY = 0.9
    #: after this many steps without guesses, one step carries one guess again: the text may have turned
    #: repetitive (a quoted passage, a list), and an estimate never tested again would never recover
    EXPLORE_EVERY = 16
    #: a drafter taking more per guess (a draft model, not prompt lookup) is weighed against a measured
    #: one-token step (``StepCosts.wants_one_token_step``)
    COSTLY_GUESS_S = 0.001

    def __init__(self, drafter_name: str, costs: StepCosts, max_draft: int):
        if not 1 <= max_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft must be in [1, {MAX_DRAFT_TOKENS}], got {max_draft}")
        self.costs = costs
        self.max_draft = max_draft
        self.stats = SpeculationStats(drafter_name)
        self._accepted = self.PRIOR_ACCEPTED
        self._trials = self.PRIOR_TRIALS
        self._plain_steps = 0
        #: what the drafter takes per guess (a moving average; a draft model's guesses are not free)
        self.draft_seconds_per_guess = 0.0

    @property
    def acceptance(self) -> float:
        """The current estimate of the chance that a guess is accepted."""
        return self._accepted / self._trials

    def guesses(self, room: int) -> int:
        """How many guesses to ask for when ``room`` more tokens may follow the one being fed: the ``k`` that
        maximises expected tokens per unit of step cost (0: plain decoding pays best)."""
        limit = min(self.max_draft, room)
        if self.draft_seconds_per_guess > self.COSTLY_GUESS_S and self.costs.wants_one_token_step():
            return 0  # guesses that cost time are weighed against a one-token step: measure one first
        alpha = min(self.acceptance, 0.99)
        base = self.costs.base
        drafting = self.draft_seconds_per_guess / base if base else 0.0  # per guess, in one-token steps
        best, best_rate = 0, 1.0
        for k in range(1, limit + 1):
            rate = expected_tokens(alpha, k) / (self.costs.relative_cost(k) + k * drafting)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and limit > 0:
            self._plain_steps += 1
            if self._plain_steps >= self.EXPLORE_EVERY:
                self._plain_steps = 0
                return 1
        return best

    def observe_drafting(self, guesses: int, seconds: float) -> None:
        """The drafter took ``seconds`` to propose ``guesses`` (the planner weighs it against the step's gain)."""
        if guesses > 0:
            per_guess = seconds / guesses
            known = self.draft_seconds_per_guess
            self.draft_seconds_per_guess = per_guess if not known else known + 0.2 * (per_guess - known)

    def observe(self, drafted: int, accepted: int) -> None:
        """A step carried ``drafted`` guesses of which the first ``accepted`` were kept."""
        if drafted <= 0:
            return
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.steps += 1
        trials = accepted + (1 if accepted < drafted else 0)  # the guesses after the first miss were not tried
        self._accepted = self.DECAY * self._accepted + accepted
        self._trials = self.DECAY * self._trials + trials


class ChoiceSpeculator:
    """One choice's speculation: its drafter, its planner, and the text so far (prompt + emitted tokens)."""

    def __init__(
        self,
        drafter: Drafter,
        costs: StepCosts,
        max_draft: int,
        prompt_ids: Sequence[int],
        max_tokens: int,
        ahead: Executor | None = None,
        admit: Callable[[Sequence[int]], int] | None = None,
    ):
        """``ahead``: where to draft the next step's guesses while a step is on the wire
        (gateway/speculation/draft_ahead.py; for drafters whose guesses cost time). ``admit(guesses)``: how many
        of them the choice's constraint (a grammar) would let its sampler produce in order
        (``Sampler.allowed_prefix``); the rest are not sent, since ``verify`` could never keep them."""
        from gateway.speculation.draft_ahead import LookAhead

        self.drafter = drafter
        self.look_ahead = LookAhead(drafter, ahead) if ahead is not None else None
        self.costs = costs
        self.planner = SpeculationPlanner(drafter.name, costs, max_draft)
        self.context = list(prompt_ids)
        #: tokens the choice may still emit
        self.room = max_tokens
        self.admit = admit
        self._failed = False

    @property
    def stats(self) -> SpeculationStats:
        return self.planner.stats

    def emitted(self, tokens: Sequence[int]) -> None:
        """Tokens the choice emitted (each sampled, the last not yet fed to the servers)."""
        self.context.extend(tokens)
        self.room -= len(tokens)

    def prime(self) -> None:
        """Let the drafter read the prompt (index it, or run it through a draft model) ahead of the first
        decode step: a long prompt's work then happens beside the prefill, in a thread of the choice's own,
        not in the batch thread every choice's decode step waits on."""
        if self._failed:
            return
        try:
            self.drafter.propose(self.context, 0)
        except Exception:
            logger.exception("the %s drafter failed; this choice decodes without guesses", self.drafter.name)
            self._failed = True

    def drafts(self) -> list[int]:
        """The guesses to send with the next step (feeding the last emitted token): as many as pay, never
        more than the choice may still emit after that token. A drafter that fails is not asked again."""
        k = 0 if self._failed else self.planner.guesses(self.room - 1)
        started = time.perf_counter()
        ready = self.look_ahead.take(self.context, k) if self.look_ahead is not None else None
        if k <= 0:
            return []
        try:
            drafts = ready if ready else [int(t) for t in self.drafter.propose(self.context, k)][:k]
            self.stats.drafted_ahead += bool(ready)
        except Exception:
            logger.exception("the %s drafter failed; this choice decodes without guesses", self.drafter.name)
            self._failed = True
            return []
        self.planner.observe_drafting(len(drafts), time.perf_counter() - started)  # only what the step waited
        if self.admit is not None and drafts:
            drafts = drafts[: self.admit(drafts)]
        if self.look_ahead is not None:
            self.look_ahead.start(self.context, drafts, min(k, self.room - len(drafts) - 2))
        return drafts

    def settle(
        self,
        session: DecodeSession,
        drafts: Sequence[int],
        logits: torch.Tensor,
        sample: Callable[[torch.Tensor], tuple[int, T]],
        stop: Callable[[int], bool],
        seconds: float,
    ) -> list[tuple[int, T]]:
        """After a step that fed the last token and ``drafts``: the tokens it yields (``verify``), the
        session rolled back past the rejected guesses, the step's cost and acceptance recorded."""
        self.costs.observe(1 + len(drafts), seconds)
        if not drafts:
            return [sample(logits)]
        out = verify(logits, drafts, sample, stop)
        accepted = sum(1 for i, (token, _) in enumerate(out) if i < len(drafts) and token == drafts[i])
        unused = len(drafts) + 1 - len(out)  # fed positions past the last kept token
        if unused:
            session.rollback(session.position - unused)
        self.planner.observe(len(drafts), accepted)
        return out

    def close(self) -> None:
        if self.look_ahead is not None:
            self.look_ahead.close(self.drafter.close)
        else:
            self.drafter.close()
