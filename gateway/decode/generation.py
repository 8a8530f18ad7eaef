"""A request's choices, running: ``Generation`` interleaves their deltas as they come (``_merge``), stops
them at the request's deadline (a 504), and closes every session however the request ends.

``Engine.start`` (gateway/decode/engine.py) makes one once every choice's session is open; the request handlers
iterate it (streaming) or ``collect()`` it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import anyio

from gateway.decode.choices import ChoiceResult, ChoiceSpec, Delta
from gateway.decode.session_handle import SessionHandle
from gateway.errors import GatewayTimeoutError

#: runs one choice on its open session, yielding its deltas (``Engine.run_choice``)
RunChoice = Callable[[ChoiceSpec, SessionHandle], AsyncIterator[Delta]]

__all__ = ["Generation"]


class Generation:
    """The choices of one request, running. Iterate it for deltas as they come (choices interleaved), or
    ``collect()`` the results; ``aclose()`` (idempotent) releases every session, started or not."""

    def __init__(
        self, run_choice: RunChoice, specs: list[ChoiceSpec], handles: list[SessionHandle], deadline: float | None
    ):
        self._run_choice = run_choice
        self.specs = specs
        self._handles = handles
        self._deadline = deadline
        self._iter: AsyncGenerator[Delta, None] | None = None

    @property
    def handles(self) -> list[SessionHandle]:
        """The choices' session handles, in choice order (gateway/api/route_info.py reads choice 0's route)."""
        return self._handles

    def __aiter__(self) -> AsyncGenerator[Delta, None]:
        if self._iter is None:
            gens = [self._run_choice(s, h) for s, h in zip(self.specs, self._handles, strict=True)]
            self._iter = _merge(gens, self._deadline)
        return self._iter

    async def collect(self) -> list[ChoiceResult]:
        results = {s.index: ChoiceResult(s.index) for s in self.specs}
        try:
            async for delta in self:
                results[delta.index].add(delta)
        finally:
            await self.aclose()
        return [results[s.index] for s in self.specs]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._iter is not None:
                await self._iter.aclose()
            for h in self._handles:
                await h.aclose()


async def _merge(gens: list[AsyncGenerator[Delta, None]], deadline: float | None) -> AsyncGenerator[Delta, None]:
    """Interleave async iterators as their items come; past ``deadline`` raise a 504. Closing this generator
    cancels the ones still running and waits until each has cleaned up."""

    async def next_of(g: AsyncGenerator[Delta, None]) -> Delta:
        return await g.__anext__()

    loop = asyncio.get_running_loop()
    pending: dict[asyncio.Future[Delta], AsyncGenerator[Delta, None]] = {}
    for g in gens:
        pending[asyncio.ensure_future(next_of(g))] = g
    try:
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise GatewayTimeoutError("The request ran past the server's request timeout.")
            for fut in done:
                g = pending.pop(fut)
                try:
                    delta = fut.result()
                except StopAsyncIteration:
                    continue
                yield delta
                pending[asyncio.ensure_future(next_of(g))] = g
    finally:
        for fut in pending:
            fut.cancel()
        with anyio.CancelScope(shield=True):
            if pending:
                await asyncio.wait(pending)
            for fut in pending:
                if not fut.cancelled():
                    fut.exception()
            for g in gens:
                await g.aclose()
