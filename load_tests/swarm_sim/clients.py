"""The clients: each runs inference sessions back to back over a route from the real ``find_route``.

A client reads the swarm every ``UPDATE_PERIOD`` (``swarm_client`` ``update_period``); all clients share one
read per period (``Clients.view``), and clients of one city with the same bans and busy peers share one
``find_route`` call per view: the function is pure, so equal inputs give the equal route it would have
computed for each of them. A hop on a crashed server fails after ``DETECT_SECONDS``; the client bans it with
its own ``BanList`` (simulated ``now``) and routes again. A hop on a slow server times out after
``STEP_TIMEOUT``; ``ban_verdict`` decides whether that bans it. A hop on a server whose cache is full is
refused ("busy") and the client routes again with that peer in ``busy``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from load_tests.swarm_sim import inputs
from load_tests.swarm_sim.events import EventQueue
from load_tests.swarm_sim.swarm import SimServer, Swarm
from swarm_client.bans import BanList, Verdict, ban_verdict
from swarm_client.dht_records import RemoteSpanInfo
from swarm_client.errors import NoRouteError
from swarm_client.routing import RouteHop, coverage, find_route

DETECT_SECONDS = 1.0
STEP_TIMEOUT = 5.0
SESSION_MEAN_S = 120.0
THINK_MEAN_S = 10.0
RETRY_S = 5.0


@dataclass
class SimClient:
    cid: int
    city: str
    bans: BanList = field(default_factory=BanList)
    route: list[RouteHop] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)
    epoch: int = 0  # bumps on each new route: stale session-end events see a different epoch


@dataclass
class ClientStats:
    sessions: int = 0
    route_calls: int = 0
    route_cpu_s: float = 0.0
    no_route: int = 0
    failovers: int = 0
    busy_refusals: int = 0
    slow_bans: int = 0
    slow_kept: int = 0
    latency_ratios: list[float] = field(default_factory=list)


class Clients:
    """Every client, scheduled on ``queue`` over ``swarm``."""

    def __init__(self, queue: EventQueue, swarm: Swarm, rng: random.Random) -> None:
        self.queue, self.swarm, self.rng = queue, swarm, rng
        self.clients: list[SimClient] = []
        self.stats = ClientStats()
        self._view: tuple[int, dict[str, RemoteSpanInfo]] | None = None
        self._routes: dict[tuple, list[RouteHop] | None] = {}
        self._best: dict[tuple, float] = {}
        swarm.on_down, swarm.on_slow = self._server_down, self._server_slow

    def view(self) -> tuple[int, dict[str, RemoteSpanInfo]]:
        bucket = int(self.queue.now / inputs.UPDATE_PERIOD)
        if self._view is None or self._view[0] != bucket:
            self._view = (bucket, self.swarm.dht.spans(self.queue.now))
            self._routes.clear()
            self._best.clear()
        return self._view

    def add(self, start_at: float) -> None:
        client = SimClient(len(self.clients), self.rng.choice(inputs.CITIES))
        self.clients.append(client)
        self.queue.at(start_at, lambda: self._start(client))

    def rtt(self, city: str, peer_id: str) -> float:
        server = self.swarm.servers.get(peer_id)
        return inputs.rtt_seconds(city, server.city) if server else 0.2

    def latency(self, client: SimClient, route: list[RouteHop]) -> float:
        """Seconds per token along ``route`` as it really is: RTTs plus compute at the actual speeds."""
        total = 0.0
        for hop in route:
            server = self.swarm.servers[hop.peer_id]
            total += self.rtt(client.city, hop.peer_id) + hop.length / server.actual_throughput
        return total

    def _find(self, client: SimClient) -> list[RouteHop] | None:
        bucket, spans = self.view()
        banned = frozenset(client.bans.banned(self.queue.now))
        key = (bucket, client.city, banned, frozenset(client.busy))
        if key not in self._routes:
            rtt = {peer: self.rtt(client.city, peer) for peer in spans}
            began = time.process_time()
            try:
                route: list[RouteHop] | None = find_route(
                    spans, 0, inputs.NUM_BLOCKS, rtt=rtt, banned=banned, busy=client.busy,
                    cache_tokens_needed=inputs.SESSION_TOKENS,
                )
            except NoRouteError:
                route = None
            self.stats.route_cpu_s += time.process_time() - began
            self.stats.route_calls += 1
            self._routes[key] = route
        return self._routes[key]

    def _best_latency(self, client: SimClient) -> float:
        """The fastest route in the swarm as it is (``find_route`` over the truth, actual speeds, no bans)."""
        key = (self.view()[0], client.city)
        if key not in self._best:
            truth = self.swarm.truth_spans()
            speeds = {p: self.swarm.servers[p].actual_throughput for p in truth}
            rtt = {p: self.rtt(client.city, p) for p in truth}
            try:
                best = find_route(truth, 0, inputs.NUM_BLOCKS, rtt=rtt, throughput=speeds)
                self._best[key] = self.latency(client, best)
            except NoRouteError:
                self._best[key] = float("nan")
        return self._best[key]

    def _start(self, client: SimClient) -> None:
        """Open a session: route, then join every hop (a dead or full hop fails the attempt)."""
        self._release(client)
        route = self._find(client)
        if route is None:
            self.stats.no_route += 1
            self.queue.after(RETRY_S, lambda: self._start(client))
            return
        for hop in route:
            server = self.swarm.servers[hop.peer_id]
            if not server.alive:
                client.bans.ban(hop.peer_id, self.queue.now, "closed", latency=self.rtt(client.city, hop.peer_id))
                self.stats.failovers += 1
                self.queue.after(DETECT_SECONDS, lambda: self._start(client))
                return
            if (len(server.sessions) + 1) * inputs.SESSION_TOKENS > server.gpu.cache_tokens:
                client.busy.add(hop.peer_id)
                self.stats.busy_refusals += 1
                self.queue.after(0.1, lambda: self._start(client))
                return
        client.busy.clear()
        client.route, client.epoch = route, client.epoch + 1
        for hop in route:
            self.swarm.servers[hop.peer_id].sessions.add(client.cid)
            client.bans.report_success(hop.peer_id)
        self.stats.sessions += 1
        best = self._best_latency(client)
        if best == best and best > 0:
            self.stats.latency_ratios.append(self.latency(client, route) / best)
        epoch = client.epoch
        self.queue.after(self.rng.expovariate(1 / SESSION_MEAN_S), lambda: self._end(client, epoch))

    def _end(self, client: SimClient, epoch: int) -> None:
        if client.epoch == epoch:
            self._release(client)
            self.queue.after(self.rng.expovariate(1 / THINK_MEAN_S), lambda: self._start(client))

    def _release(self, client: SimClient) -> None:
        for hop in client.route:
            self.swarm.servers[hop.peer_id].sessions.discard(client.cid)
        client.route = []
        client.epoch += 1

    def _server_down(self, server: SimServer) -> None:
        for cid in list(server.sessions):
            client = self.clients[cid]
            self._release(client)
            client.bans.ban(server.peer_id, self.queue.now + DETECT_SECONDS, "closed",
                            latency=self.rtt(client.city, server.peer_id))
            self.stats.failovers += 1
            self.queue.after(DETECT_SECONDS, lambda c=client: self._start(c))
        server.sessions.clear()

    def _server_slow(self, server: SimServer) -> None:
        self.queue.after(STEP_TIMEOUT, lambda: self._slow_verdicts(server))

    def _slow_verdicts(self, server: SimServer) -> None:
        spans = self.view()[1]
        holders = dict(enumerate(coverage(spans, inputs.NUM_BLOCKS)))
        for cid in list(server.sessions):
            client = self.clients[cid]
            banned = client.bans.banned(self.queue.now)
            if ban_verdict(server.peer_id, True, holders, banned) is Verdict.KEEP_SLOW:
                self.stats.slow_kept += 1
                continue
            client.bans.ban(server.peer_id, self.queue.now, "slow", latency=self.latency(client, client.route))
            self.stats.slow_bans += 1
            self._release(client)
            self._start(client)
