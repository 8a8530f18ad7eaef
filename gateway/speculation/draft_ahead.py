"""Drafting the next step's guesses while this step is on the wire (for a draft model, whose guesses cost time).

A step with guesses ``d1..dk`` is most often accepted whole, and then the token after them is the served
model's own next token, which a good draft model has usually guessed too (it is ``e1``, its guess after
``dk``). So while the step travels the chain, a thread asks the drafter for ``e1, e2, …`` after
``context + d1..dk``. When the step comes back with exactly ``d1..dk, e1``, the next step's guesses
``e2, …`` are ready: the drafting hid behind the network wait instead of adding to it. Otherwise they are
dropped (the drafter's cache rolls back to what still agrees on its next call), and the guesses are drafted
as before. Either way the guesses are only guesses: the output is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

from gateway.speculation.drafting import Drafter

logger = logging.getLogger(__name__)


class LookAhead:
    """One choice's drafts-in-advance: at most one in flight; the drafter is only used by one thread at a time
    (``take`` and ``close`` wait for, or cancel, what is running before the drafter is used again)."""

    def __init__(self, drafter: Drafter, executor: Executor):
        self.drafter = drafter
        self.executor = executor
        self._assumed: list[int] = []
        self._future: Future[list[int]] | None = None
        #: steps whose guesses were ready / drafted in advance in vain (for the benchmark and tests)
        self.hits = 0
        self.misses = 0

    def start(self, context: Sequence[int], drafts: Sequence[int], count: int) -> None:
        """Draft ``count`` guesses for the step after the one that feeds ``drafts`` after ``context``, assuming
        that step keeps every guess and yields the drafter's own next guess after them."""
        if count < 1 or not drafts:
            return
        self._assumed = [*context, *drafts]
        self._future = self.executor.submit(self.drafter.propose, list(self._assumed), count + 1)

    def take(self, context: Sequence[int], k: int) -> list[int] | None:
        """Up to ``k`` guesses drafted in advance for ``context``, or None (none ready: draft them now)."""
        future, assumed = self._future, self._assumed
        self._future, self._assumed = None, []
        if future is None or future.cancel():  # cancelled before it ran: the drafter was never touched
            return None
        try:
            ahead = future.result()
        except Exception:
            logger.debug("drafting ahead failed; drafting now instead", exc_info=True)
            return None
        n = len(assumed)
        if len(ahead) >= 2 and len(context) == n + 1 and context[n] == ahead[0] and list(context[:n]) == assumed:
            self.hits += 1
            return ahead[1 : 1 + k]
        self.misses += 1
        return None

    def close(self, then: Callable[[], None]) -> None:
        """Drop what is in flight, then run ``then`` (closing the drafter): at once, or when the running draft
        ends (never blocks the caller, which may be the event loop)."""
        future, self._future = self._future, None
        if future is None or future.cancel() or future.done():
            then()
        else:
            future.add_done_callback(lambda _: then())
