"""Waiting for room in a full swarm, first come first served.

When no server has room for another session (``SwarmBusyError``), a request does not fail at once nor
retry blindly: it takes a ticket and waits its turn. The head of the line retries whenever one of this
gateway's sessions ends (room may have opened) and every ``POLL_S`` seconds (other clients free room too);
the others wait behind it, so a request that just arrived cannot take the room freed for one that has been
waiting. Past ``timeout_s`` a waiting request gets the ``SwarmBusyError`` (a 503 with ``Retry-After``).
While anyone waits, new requests queue behind them instead of trying first.

Reservations: servers grow a session's cache as it fills, so a request of ``n`` long choices opens fine
and only runs out of room mid-generation — taking everyone else's sessions down with it. A request that
states its ``Need`` (``NEED``, set by the request handler: ``n × (prompt + max_tokens)`` token slots and
the swarm's whole cache) is let in only while the reservations of this gateway's running requests leave
room for it, and holds its reservation until all its sessions are closed; one that does not fit waits in
the same line (or, past ``timeout_s``, gets the 503). With nothing of ours running, a request is always
tried: the swarm's own answer (room or ``SwarmBusyError``) decides, as before.

Replicas: with a ``board`` (``gateway/decode/shared_reservations.py``: Redis), the reservations counted are
every replica's, not only this gateway's: each admission check reads the others' sum (at most every
``SYNC_S``), and this replica's own total is published whenever it changes and every ``SYNC_S`` while it
holds any, so a replica that dies stops holding its share within the board's time to live.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.decode.shared_reservations import RedisReservations
from swarm_client.errors import SwarmBusyError

__all__ = ["NEED", "CapacityQueue", "Need"]

T = TypeVar("T")

#: how often the head of the line retries when nothing of ours ended
POLL_S = 0.5
#: how old the other replicas' reservations may be when a request is checked against them, and how often
#: this replica's own total is published while it holds any
SYNC_S = 0.5


@dataclass(frozen=True)
class Need:
    """What one request will hold at most: ``tokens`` KV-cache slots (the sum over its choices), against a
    swarm of ``capacity()`` slots (None: unknown, nothing is reserved)."""

    tokens: int
    capacity: Callable[[], int | None]


#: the request being admitted states its need here (a context variable: ``Engine.start`` calls ``admit``
#: without it); None: no reservation
NEED: ContextVar[Need | None] = ContextVar("swarmserve_admission_need", default=None)


class CapacityQueue:
    def __init__(self, timeout_s: float, board: RedisReservations | None = None):
        self.timeout_s = timeout_s
        #: the replicas' shared reservations (None: one gateway, only its own count)
        self.board = board
        #: the other replicas' reserved token slots, as last read, and when (loop time); what we published last
        self._others = 0
        self._synced_at = float("-inf")
        self._published = 0
        self._heartbeat: asyncio.Task | None = None
        self._line: deque[int] = deque()
        self._tickets = itertools.count()
        self._changed: asyncio.Condition | None = None
        self._wakeups: set[asyncio.Task] = set()  # strong references until they ran
        #: (the sessions a running request opened, the token slots it reserved)
        self._held: list[tuple[list[Any], int]] = []

    @property
    def reserved_tokens(self) -> int:
        """Token slots this gateway's running requests reserved (their sessions not all closed yet)."""
        self._held = [(handles, tokens) for handles, tokens in self._held if not all(map(_closed, handles))]
        return sum(tokens for _, tokens in self._held)

    @property
    def others_reserved_tokens(self) -> int:
        """Token slots the other replicas' running requests reserved, as last read from the board."""
        return self._others

    async def _sync(self, *, force: bool = False) -> None:
        """Publish this replica's reservations and read the others' when they changed or are older than
        ``SYNC_S``; keep them fresh on the board while any are held."""
        if self.board is None:
            return
        loop = asyncio.get_running_loop()
        mine = self.reserved_tokens
        if force or mine != self._published or loop.time() - self._synced_at >= SYNC_S:
            self._published, self._synced_at = mine, loop.time()
            self._others = await self.board.publish(mine)
        if mine and (self._heartbeat is None or self._heartbeat.done()):
            self._heartbeat = loop.create_task(self._keep_published())

    async def _keep_published(self) -> None:
        """While this replica holds reservations, renew its entry (its sessions may run for minutes)."""
        while True:
            await asyncio.sleep(SYNC_S)
            if not self.reserved_tokens and not self._published:
                return
            await self._sync(force=True)

    def _fits(self, need: Need | None) -> bool:
        reserved = self.reserved_tokens + self._others
        if need is None or reserved == 0:
            return True
        capacity = need.capacity()
        return capacity is None or reserved + need.tokens <= capacity

    async def _held_now(self, result: T, need: Need | None) -> T:
        """``result``, its sessions holding ``need``'s reservation (published to the other replicas)."""
        if need is not None and isinstance(result, list):
            self._held.append((list(result), need.tokens))
            await self._sync()
        return result

    @property
    def waiting(self) -> int:
        """Requests waiting for room now."""
        return len(self._line)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the event loop that uses it
            self._changed = asyncio.Condition()
        return self._changed

    async def admit(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``'s result (a list of sessions holds ``NEED``'s reservation until they are all closed);
        while it raises ``SwarmBusyError`` or the reservations leave no room for ``NEED``, wait in line."""
        need = NEED.get()
        await self._sync()
        if not self._line and self._fits(need):
            try:
                return await self._held_now(await attempt(), need)
            except SwarmBusyError as e:
                if self.timeout_s <= 0:
                    raise
                error = e
        else:
            error = self._no_room(need)
            if self.timeout_s <= 0:
                raise error
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        ticket = next(self._tickets)
        self._line.append(ticket)
        changed = self._condition()
        try:
            while True:
                await self._sync()
                if self._line[0] == ticket and self._fits(need):
                    try:
                        return await self._held_now(await attempt(), need)
                    except SwarmBusyError as e:
                        error = e
                elif self._line[0] == ticket:
                    error = self._no_room(need)
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

    def _no_room(self, need: Need | None) -> SwarmBusyError:
        if need is None or self._fits(need):
            return SwarmBusyError("requests are already waiting for room in the swarm")
        others = f" ({self._others} of them on other gateway replicas)" if self._others else ""
        return SwarmBusyError(
            f"this request needs {need.tokens} KV-cache token slots; requests running now reserve "
            f"{self.reserved_tokens + self._others}{others} of the swarm's {need.capacity()}"
        )

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def released(self) -> None:
        """One of this gateway's sessions ended: whoever waits may find room now (here, and on the other
        replicas once the smaller total is published)."""
        if self._line:
            self._soon(self._notify())
        if self.board is not None and self.reserved_tokens != self._published:
            self._soon(self._sync())

    def _soon(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._wakeups.add(task)
        task.add_done_callback(self._wakeups.discard)

    async def aclose(self) -> None:
        """Take this replica's entry off the board (its reservations end with it)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.board is not None:
            if self._published:
                await self.board.publish(0)
            await self.board.aclose()


def _closed(handle: Any) -> bool:
    """Whether a session handle (``gateway/decode/session_handle.py``) is closed: its reservation ends then."""
    return bool(getattr(handle, "closed", True))
