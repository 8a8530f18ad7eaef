"""Waiting for room in a full swarm, first come first served.

When no server has room for another session (``SwarmBusyError``), a request does not fail at once nor
retry blindly: it takes a ticket and waits its turn. The head of the line retries whenever one of this
gateway's sessions ends (room may have opened) and every ``POLL_S`` seconds (other clients free room too);
the others wait behind it, so a request that just arrived cannot take the room freed for one that has been
waiting. Past ``timeout_s`` a waiting request gets the ``SwarmBusyError`` (a 503 with ``Retry-After``).
While anyone waits, new requests queue behind them instead of trying first.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from swarm_client.errors import SwarmBusyError

__all__ = ["CapacityQueue"]

T = TypeVar("T")

#: how often the head of the line retries when nothing of ours ended
POLL_S = 0.5


class CapacityQueue:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._line: deque[int] = deque()
        self._tickets = itertools.count()
        self._changed: asyncio.Condition | None = None
        self._wakeups: set[asyncio.Task] = set()  # strong references until they ran

    @property
    def waiting(self) -> int:
        """Requests waiting for room now."""
        return len(self._line)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the event loop that uses it
            self._changed = asyncio.Condition()
        return self._changed

    async def admit(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``'s result; while it raises ``SwarmBusyError``, wait in line and try again."""
        if not self._line:
            try:
                return await attempt()
            except SwarmBusyError as e:
                if self.timeout_s <= 0:
                    raise
                error = e
        else:
            error = SwarmBusyError("requests are already waiting for room in the swarm")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        ticket = next(self._tickets)
        self._line.append(ticket)
        changed = self._condition()
        try:
            while True:
                if self._line[0] == ticket:
                    try:
                        return await attempt()
                    except SwarmBusyError as e:
                        error = e
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise error
                async with changed:
                    try:  # a session ended, the line moved, or the poll interval passed
                        await asyncio.wait_for(changed.wait(), min(POLL_S, remaining))
                    except TimeoutError:
                        pass
        finally:
            self._line.remove(ticket)
            await self._notify()

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def released(self) -> None:
        """One of this gateway's sessions ended: whoever waits may find room now."""
        if self._line:
            task = asyncio.get_running_loop().create_task(self._notify())
            self._wakeups.add(task)
            task.add_done_callback(self._wakeups.discard)
