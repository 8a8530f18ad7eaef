"""Getting a span served despite failing servers: routing with bans and retries, replacements, spot checks.

The session's bookkeeping (which hop sits where, its history, counters) stays in ``session``; the functions
here find and open servers for one span and say whether a server's output is suspect. A replacement is
replayed the span's input history *at position 0 of its new sessions*, so the step continues at the right
position — the bug that breaks Petals' failover.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from swarm_client import protocol
from swarm_client.errors import (
    CacheExhaustedError,
    InvalidInputError,
    LengthExceededError,
    NoRouteError,
    PeerError,
    RemoteError,
    SessionLost,
    SessionNotFoundError,
    SessionTooLongError,
    SwarmBusyError,
)
from swarm_client.history import HistoryBuffer
from swarm_client.lora import adapter_field
from swarm_client.peer_calls import call_stream
from swarm_client.routing import LOCAL_PEER, RouteHop, find_route
from swarm_client.sequence_manager import SequenceManager
from swarm_client.server_session import _ServerSession, close_all

#: errors that are the caller's fault: never retried on another server
CALLER_ERRORS = (InvalidInputError, LengthExceededError)

#: opens one server session per hop (all or none), as ``InferenceSession._open_hops`` does
OpenHops = Callable[[list[RouteHop]], Awaitable[list[_ServerSession]]]


#: how often a client whose every candidate server is full tries again, while it waits for room
BUSY_POLL = 0.25


def all_busy(manager: SequenceManager, start: int, end: int, adapter: str | None = None) -> bool:
    """No route over ``[start, end)`` (with ``adapter``) avoids the servers that just said they are full."""
    try:
        find_route(manager.spans, start, end, **manager.route_options(exclude=manager.busy_peers(), adapter=adapter))
    except NoRouteError:
        return True
    return False


async def wait_for_room(
    manager: SequenceManager,
    error: CacheExhaustedError | SessionTooLongError,
    start: int,
    end: int,
    give_up_at: float,
    adapter: str | None = None,
) -> None:
    """A server of ``[start, end)`` is full (busy, or its cache ran out under a replayed session) or too
    small: route around it at once when another can take the session, else wait a little for room — up to
    ``give_up_at``, then ``SwarmBusyError`` (or the ``SessionTooLongError`` itself: waiting never makes a
    session fit a smaller cache). Never a ban."""
    if error.peer_id:
        manager.mark_busy(error.peer_id, str(error))
    if not all_busy(manager, start, end, adapter):
        return
    if isinstance(error, SessionTooLongError):
        raise error
    if time.monotonic() + BUSY_POLL > give_up_at:
        raise SwarmBusyError(
            f"every server that holds blocks {start}:{end} is full right now ({error}); retry in a few seconds",
            retry_after=manager.config.busy_mark,
        ) from error
    await asyncio.sleep(BUSY_POLL)


async def open_span(
    manager: SequenceManager, start: int, end: int, cache_tokens: int, open_hops: OpenHops, adapter: str | None = None
) -> list[_ServerSession]:
    """Route ``[start, end)`` and open streams, banning servers that fail until the failover deadline; a
    full server is routed around (``wait_for_room``), for ``busy_wait`` seconds at most; blocks without a
    usable server are looked for again for ``route_wait`` seconds, then ``NoRouteError`` says why."""
    now, config = time.monotonic(), manager.config
    deadline, busy_deadline = now + config.failover_deadline, now + config.busy_wait
    route_deadline = now + min(config.route_wait, config.failover_deadline)
    while True:
        try:
            hops = await manager.make_route(start, end, cache_tokens_needed=cache_tokens, adapter=adapter)
            return await open_hops(hops)
        except CALLER_ERRORS:
            raise
        except NoRouteError:
            if time.monotonic() + 0.5 > route_deadline:
                raise
            await asyncio.sleep(0.5)
        except (CacheExhaustedError, SessionTooLongError) as e:  # full (ServerBusyError too), not faulty
            await wait_for_room(manager, e, start, end, busy_deadline, adapter)
        except (PeerError, RemoteError) as e:
            if getattr(e, "peer_id", None):
                manager.fault(e.peer_id, e)
            if time.monotonic() > deadline:
                raise


async def replay_into(session: _ServerSession, inputs: torch.Tensor, timeout: float) -> torch.Tensor:
    """Feed a span's history ``inputs [batch, length, hidden]`` to a new server session from position 0, in
    steps no longer than one step may be (``protocol.step_tokens``: a server refuses a longer one, as it would
    the prefill that built this history), and return the span's outputs for all of it."""
    size = protocol.step_tokens(inputs)
    outputs = [
        await session.step(inputs[:, start : start + size], start, timeout) for start in range(0, inputs.shape[1], size)
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


async def replace_span(
    manager: SequenceManager,
    failed: RouteHop,
    replay_input: torch.Tensor | None,
    error: Exception,
    deadline: float,
    cache_tokens: int,
    open_hops: OpenHops,
    adapter: str | None = None,
) -> tuple[list[_ServerSession], list[HistoryBuffer]]:
    """Route ``failed``'s span anew and replay ``replay_input`` (the span's inputs so far) into the new hops.

    Servers that fail meanwhile are banned; past ``deadline`` this raises ``SessionLost``. Returns the new
    server sessions and their histories.
    """
    config = manager.config
    busy_deadline = time.monotonic() + config.busy_wait
    while True:
        if time.monotonic() > deadline:
            raise SessionLost(
                f"could not replace server {failed.peer_id} for blocks {failed.start}:{failed.end} "
                f"within {config.failover_deadline:.0f}s (last error: {error})"
            )
        sessions: list[_ServerSession] = []
        try:
            hops = await manager.make_route(failed.start, failed.end, cache_tokens_needed=cache_tokens, adapter=adapter)
            sessions = await open_hops(hops)
            histories: list[HistoryBuffer] = []
            replay = replay_input
            for session in sessions:
                history = HistoryBuffer()
                if replay is not None:
                    history.write(0, replay)
                    replay = await replay_into(session, replay, config.step_timeout)
                histories.append(history)
            return sessions, histories
        except CALLER_ERRORS:
            raise
        except NoRouteError as e:
            error = e
            if time.monotonic() + 0.5 > deadline:
                raise
            await asyncio.sleep(0.5)
        except (CacheExhaustedError, SessionTooLongError) as e:  # full (ServerBusyError too), not faulty
            error = e
            await close_all(sessions)
            await wait_for_room(manager, e, failed.start, failed.end, min(deadline, busy_deadline), adapter)
        except (PeerError, RemoteError) as e:
            error = e
            await close_all(sessions)
            if getattr(e, "peer_id", None):
                manager.fault(e.peer_id, e)
            await asyncio.sleep(0.1)


@dataclass(frozen=True)
class SpotCheck:
    """One step of ``hop`` recomputed by ``checkers``: ``difference`` is the relative distance between them."""

    hop: RouteHop
    checkers: list[RouteHop]
    difference: float

    def disagreement(self) -> PeerError:
        """The checked server's fault, to raise when ``difference`` is past the tolerance."""
        return PeerError(
            f"spot check: server {self.hop.peer_id} disagrees with {[c.peer_id for c in self.checkers]} on "
            f"blocks {self.hop.start}:{self.hop.end} (relative difference {self.difference:.3g})",
            self.hop.peer_id,
        )


class PendingSpotCheck:
    """A spot check under way: ``checkers`` recompute ``hop``'s step while the hop computes it itself, so on
    separate machines a check costs the client little more than the step's own wait."""

    def __init__(
        self,
        manager: SequenceManager,
        hop: RouteHop,
        checkers: list[RouteHop],
        full: torch.Tensor,
        length: int,
        adapter: str | None = None,
    ):
        self.hop = hop
        self.checkers = checkers
        self._task = asyncio.create_task(_reference(manager, checkers, full, length, adapter))

    async def result(self, out: torch.Tensor, timeout: float) -> SpotCheck | None:
        """How far ``out`` (the hop's answer) is from the checkers'; None when the checkers failed or took
        more than ``timeout`` seconds longer than the hop (a stalling checker must not stall the session)."""
        try:
            reference = await asyncio.wait_for(self._task, timeout)
        except TimeoutError:
            return None
        if reference is None:
            return None
        reference = reference.to(out.dtype)
        difference = float((out - reference).norm() / reference.norm().clamp_min(1e-6))
        return SpotCheck(self.hop, self.checkers, difference)

    def cancel(self) -> None:
        self._task.cancel()


async def _reference(
    manager: SequenceManager, checkers: list[RouteHop], full: torch.Tensor, length: int, adapter: str | None = None
) -> torch.Tensor | None:
    """The checkers' output for the last ``length`` positions of ``full``; None if a checker failed or sent
    something malformed (a broken checker proves nothing about the checked step)."""
    reference = full
    try:
        for checker in checkers:
            (reference,) = await call_stream(
                manager,
                checker.peer_id,
                "rpc_forward",
                [reference],
                start_block=checker.start,
                end_block=checker.end,
                **adapter_field(adapter),
            )
    except (PeerError, RemoteError, ValueError):
        return None
    if reference.shape != full.shape or not torch.isfinite(reference).all():
        return None
    return reference[:, -length:]


def start_spot_check(
    manager: SequenceManager,
    hop: RouteHop,
    history: HistoryBuffer,
    x: torch.Tensor,
    position: int,
    adapter: str | None = None,
) -> PendingSpotCheck | None:
    """With probability ``spot_check_rate``, start recomputing ``hop``'s step (input ``x`` at ``position``) on
    other servers holding the same blocks: a stateless forward over the hop's whole input history, running
    while the hop computes. None when no check runs (not drawn, unknown history, nobody else holds them)."""
    rate = manager.config.spot_check_rate
    if rate <= 0 or random.random() >= rate or history.unknown:
        return None
    # only peers that answered their last ping: one banned for going silent has its RTT dropped, and a step
    # would wait ``spot_check_wait`` for a frozen checker each time its ban ran out
    unmeasured = [peer for peer in manager.spans if peer not in manager.rtt]
    # a checker with other weights (int8 vs full precision) differs by more than rounding: only like is
    # compared with like, or an honest server would be banned for its neighbour's quantization
    checked = manager.spans.get(hop.peer_id)
    quant = checked.server_info.quant if checked is not None else None
    unlike = [peer for peer, span in manager.spans.items() if span.server_info.quant != quant]
    try:
        # the checker sees the hop's inputs: the trust policy applies to it as to the hop itself
        options = manager.route_options(exclude=[hop.peer_id, *unmeasured, *unlike], adapter=adapter)
        checkers = find_route(manager.spans, hop.start, hop.end, **options)
    except NoRouteError:
        return None  # nobody else holds these blocks: nothing to compare with
    prefix = history.read(position)
    full = x if prefix is None else torch.cat([prefix, x], 1)
    return PendingSpotCheck(manager, hop, checkers, full, x.shape[1], adapter)


def check_trusted_resume(manager: SequenceManager, hops: list[dict]) -> None:
    """A session to resume must obey this client's trust policy (it may come from another replica's snapshot):
    else ``SessionNotFoundError``, and the caller starts a fresh session on a route that does."""
    trusted = set(manager.trusted_peers)
    last = manager.config.num_blocks
    for hop in hops if trusted else ():
        if (hop["start"] == 0 or hop["end"] == last) and hop["peer_id"] not in {*trusted, LOCAL_PEER}:
            raise SessionNotFoundError(
                f"the session's server {hop['peer_id']} (blocks {hop['start']}:{hop['end']}) is not a trusted peer"
            )
