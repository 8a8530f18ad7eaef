"""The servers: join where ``choose_best_blocks`` says, announce with expiry, move where ``plan_move`` says,
crash, leave, go slow. Every decision is the real worker code's; this module only schedules it.

Reads of the DHT by servers share one snapshot per simulated second (``VIEW_SECONDS``): a server's view is
at most that much staler than a fresh read (the real loop reads on each check).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from load_tests.swarm_sim import inputs
from load_tests.swarm_sim.dht import SimDHT
from load_tests.swarm_sim.events import EventQueue
from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState, spans_from_records
from worker.block_selection import choose_best_blocks
from worker.rebalance import balancing_view, jittered, joining_range, plan_move, retired_ranges, tombstone

VIEW_SECONDS = 1.0


@dataclass
class SimServer:
    peer_id: str
    gpu: inputs.GpuClass
    city: str
    start: int = 0
    end: int = 0
    state: ServerState = ServerState.JOINING
    alive: bool = True
    moving: bool = False
    speed_factor: float = 1.0  # < 1: a slow peer (announces its old throughput, serves less)
    sessions: set[int] = field(default_factory=set)
    joined_at: float = 0.0
    left_at: float | None = None

    @property
    def actual_throughput(self) -> float:
        return self.gpu.throughput * self.speed_factor

    def info(self, state: ServerState | None = None, span: tuple[int, int] | None = None) -> ServerInfo:
        start, end = span or (self.start, self.end)
        left = max(self.gpu.cache_tokens - len(self.sessions) * inputs.SESSION_TOKENS, 0)
        return ServerInfo(
            state=state if state is not None else self.state, start_block=start, end_block=end,
            throughput=self.gpu.throughput, cache_tokens_left=left, cache_tokens_total=self.gpu.cache_tokens,
        )


class Swarm:
    """All servers ever started (``servers``), scheduled on ``queue``, announcing on ``dht``."""

    def __init__(self, queue: EventQueue, dht: SimDHT, rng: random.Random) -> None:
        self.queue, self.dht, self.rng = queue, dht, rng
        self.servers: dict[str, SimServer] = {}
        self.moves = 0
        self.move_log: list[tuple[float, str, tuple[int, int], tuple[int, int]]] = []
        self.on_down: Callable[[SimServer], None] = lambda server: None
        self.on_slow: Callable[[SimServer], None] = lambda server: None
        self._view: tuple[float, list[dict[str, ServerInfo]]] | None = None

    # ------------------------------------------------------------------ reads
    def records(self) -> list[dict[str, ServerInfo]]:
        """A server's read of every block key (shared within ``VIEW_SECONDS``)."""
        bucket = int(self.queue.now / VIEW_SECONDS)
        if self._view is None or self._view[0] != bucket:
            self._view = (bucket, self.dht.records(self.queue.now))
        return self._view[1]

    def live(self) -> list[SimServer]:
        return [s for s in self.servers.values() if s.alive]

    def truth_spans(self) -> dict[str, RemoteSpanInfo]:
        """The swarm as it is (not as announced): live ONLINE servers with their actual spans."""
        return {
            s.peer_id: RemoteSpanInfo(s.peer_id, s.start, s.end, s.info())
            for s in self.servers.values()
            if s.alive and s.state == ServerState.ONLINE
        }

    # ------------------------------------------------------------------ lifecycle
    def start_server(self, peer_id: str) -> SimServer:
        """A new server: pick its GPU class and city, choose its blocks from a fresh read, load, go ONLINE."""
        gpu = self.rng.choices(inputs.GPU_CLASSES, weights=[g.share for g in inputs.GPU_CLASSES])[0]
        server = SimServer(peer_id, gpu, self.rng.choice(inputs.CITIES), joined_at=self.queue.now)
        self.servers[peer_id] = server

        server.start, server.end = choose_best_blocks(gpu.blocks, spans_from_records(self.records()), inputs.NUM_BLOCKS)
        self._announce(server)
        self.queue.after(gpu.blocks * inputs.LOAD_SECONDS_PER_BLOCK, lambda: self._go_online(server))
        return server

    def _go_online(self, server: SimServer) -> None:
        if not server.alive:
            return
        server.state = ServerState.ONLINE
        self._announce(server)
        self.queue.after(inputs.UPDATE_PERIOD, lambda: self._announce_loop(server))
        self.queue.after(jittered(inputs.REBALANCE_PERIOD, self.rng), lambda: self._balance(server))

    def _announce(self, server: SimServer, state: ServerState | None = None, blocks: tuple[int, int] | None = None,
                  info: ServerInfo | None = None, expiration: float = inputs.EXPIRATION) -> None:
        info = info or server.info(state)
        lo, hi = blocks or (server.start, server.end)
        for block in range(lo, hi):
            self.dht.store(block, server.peer_id, info, self.queue.now + expiration)

    def _announce_loop(self, server: SimServer) -> None:
        if server.alive:
            self._announce(server)
            self.queue.after(inputs.UPDATE_PERIOD, lambda: self._announce_loop(server))

    def _balance(self, server: SimServer) -> None:
        """``worker.server._balance_loop``: plan, wait a random part of a period, plan again, move."""
        if not server.alive:
            return
        period = inputs.REBALANCE_PERIOD
        if not server.moving and self._plan(server) is not None:
            self.queue.after(self.rng.uniform(0.0, period), lambda: self._maybe_move(server))
            return
        self.queue.after(jittered(period, self.rng), lambda: self._balance(server))

    def _plan(self, server: SimServer) -> tuple[int, int] | None:
        return plan_move(server.peer_id, balancing_view(self.records()), inputs.NUM_BLOCKS)

    def _maybe_move(self, server: SimServer) -> None:
        if not server.alive:
            return
        self._view = None  # a fresh read, as the real second plan does
        target = self._plan(server)
        if target is None:
            self.queue.after(jittered(inputs.REBALANCE_PERIOD, self.rng), lambda: self._balance(server))
            return
        old = (server.start, server.end)
        server.moving = True
        joining = joining_range(old, target)
        if joining is not None:
            self._announce(server, ServerState.JOINING, blocks=joining, info=server.info(ServerState.JOINING, target))
        self._view = None
        load = (target[1] - target[0]) * inputs.LOAD_SECONDS_PER_BLOCK
        self.queue.after(load, lambda: self._finish_move(server, old, target))

    def _finish_move(self, server: SimServer, old: tuple[int, int], new: tuple[int, int]) -> None:
        if not server.alive:
            return
        server.start, server.end, server.moving = new[0], new[1], False
        self._announce(server, ServerState.ONLINE)
        gone = tombstone(server.info(ServerState.ONLINE))
        for blocks in retired_ranges(old, new):
            self._announce(server, ServerState.OFFLINE, blocks=blocks, info=gone,
                           expiration=inputs.TOMBSTONE_EXPIRATION)
        self.moves += 1
        self.move_log.append((self.queue.now, server.peer_id, old, new))
        self.queue.after(jittered(inputs.REBALANCE_PERIOD, self.rng), lambda: self._balance(server))

    def crash(self, server: SimServer) -> None:
        """Gone without a word: its records stay until they expire."""
        if server.alive:
            server.alive, server.left_at = False, self.queue.now
            self.on_down(server)

    def leave(self, server: SimServer) -> None:
        """A graceful stop: OFFLINE records (``worker.server``: expiration max(expiration, 30 s)), then gone."""
        if server.alive:
            self._announce(server, ServerState.OFFLINE, expiration=inputs.TOMBSTONE_EXPIRATION)
            self.crash(server)

    def slow_down(self, server: SimServer, factor: float = 0.1) -> None:
        """The peer keeps announcing its old throughput but serves ``factor`` of it (a throttled GPU)."""
        if server.alive and server.speed_factor == 1.0:
            server.speed_factor = factor
            self.on_slow(server)
