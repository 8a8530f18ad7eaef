"""One scenario: a swarm of ``servers`` grows for a minute, ``clients`` run sessions over it under churn, and
at 40 % of the run every server holding the middle block crashes at once (a hole); the result is a dict of
the report's figures."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from load_tests.swarm_sim import inputs
from load_tests.swarm_sim.clients import Clients
from load_tests.swarm_sim.dht import SimDHT
from load_tests.swarm_sim.events import EventQueue
from load_tests.swarm_sim.metrics import hardware_bound, percentile, served_throughput
from load_tests.swarm_sim.swarm import Swarm
from swarm_client.routing import missing_blocks

WARMUP_S = 60.0
SAMPLE_S = 10.0
LIFETIME_S = 3600.0  # mean server lifetime under churn (half leave gracefully, half crash); joins replace them
SLOW_EVERY_S = 7200.0  # mean time before a server turns slow


@dataclass
class Result:
    servers: int
    clients: int
    minutes: float
    seed: int
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, served, bound
    holes: list[tuple[float, int]] = field(default_factory=list)  # t, missing blocks (truth)
    crash_at: float = 0.0
    crashed: int = 0
    recovered_after: float | None = None
    figures: dict[str, float] = field(default_factory=dict)


def simulate(servers: int, clients: int, minutes: float, seed: int = 0, crash: bool = True,
             rebalance: bool = True) -> Result:
    """Run the scenario; ``rebalance=False`` stops every server's balance loop (a check that tests can fail)."""
    wall = time.process_time()
    rng = random.Random(seed)
    queue, dht = EventQueue(), SimDHT(inputs.NUM_BLOCKS)
    swarm = Swarm(queue, dht, rng)
    if not rebalance:
        swarm._balance = lambda server: None  # type: ignore[method-assign]
    pool = Clients(queue, swarm, rng)
    result = Result(servers, clients, minutes, seed)
    end = WARMUP_S + minutes * 60.0
    names = iter(f"peer{i:05d}" for i in range(10**6))
    for _ in range(servers):
        queue.at(rng.uniform(0, WARMUP_S), lambda: swarm.start_server(next(names)))
    for _ in range(clients):
        pool.add(rng.uniform(WARMUP_S, WARMUP_S + 30.0))

    def churn() -> None:
        live = swarm.live()
        if live:
            victim = rng.choice(live)
            (swarm.leave if rng.random() < 0.5 else swarm.crash)(victim)
            swarm.start_server(next(names))
        queue.after(rng.expovariate(servers / LIFETIME_S), churn)

    def slow() -> None:
        live = swarm.live()
        if live:
            swarm.slow_down(rng.choice(live))
        queue.after(rng.expovariate(servers / SLOW_EVERY_S), slow)

    def hole() -> None:
        middle = inputs.NUM_BLOCKS // 2
        victims = [s for s in swarm.live() if s.start <= middle < s.end]
        result.crash_at, result.crashed = queue.now, len(victims)
        for victim in victims:
            swarm.crash(victim)
        queue.after(1.0, watch)

    def watch() -> None:
        missing = missing_blocks(swarm.truth_spans(), inputs.NUM_BLOCKS)
        result.holes.append((queue.now, len(missing)))
        if not missing and result.recovered_after is None:
            result.recovered_after = queue.now - result.crash_at
        elif queue.now < end:
            queue.after(2.0, watch)

    def sample() -> None:
        result.samples.append((queue.now, served_throughput(swarm, pool), hardware_bound(swarm)))
        queue.after(SAMPLE_S, sample)

    queue.at(WARMUP_S, churn)
    queue.at(WARMUP_S, slow)
    queue.at(WARMUP_S + 30.0, sample)
    if crash:
        queue.at(WARMUP_S + 0.4 * minutes * 60.0, hole)
    queue.run_until(end)

    steady = [s for s in result.samples if not result.crash_at or s[0] < result.crash_at] or result.samples
    server_seconds = sum(((s.left_at or end) - s.joined_at) for s in swarm.servers.values())
    stats = pool.stats
    read_records = sum(len(r) for r in dht.records(end, count_read=False))
    result.figures = {
        "served_tok_s": sum(s[1] for s in steady) / max(len(steady), 1),
        "bound_tok_s": sum(s[2] for s in steady) / max(len(steady), 1),
        "route_latency_ratio_p50": percentile(stats.latency_ratios, 0.5),
        "route_latency_ratio_p95": percentile(stats.latency_ratios, 0.95),
        "dht_writes_per_server_s": dht.writes / max(server_seconds, 1e-9),
        "dht_keys_per_route_read": float(inputs.NUM_BLOCKS),
        "dht_records_per_route_read": float(read_records),
        "dht_kb_per_route_read": dht.bytes_read / max(dht.reads / inputs.NUM_BLOCKS, 1) / 1000,
        "route_cpu_ms_per_call": 1000 * stats.route_cpu_s / max(stats.route_calls, 1),
        "route_calls": float(stats.route_calls),
        "sessions": float(stats.sessions),
        "no_route": float(stats.no_route),
        "failovers": float(stats.failovers),
        "busy_refusals": float(stats.busy_refusals),
        "slow_bans": float(stats.slow_bans),
        "slow_kept": float(stats.slow_kept),
        "moves": float(swarm.moves),
        "max_missing_blocks": float(max((h[1] for h in result.holes), default=0)),
        "sim_cpu_s": time.process_time() - wall,
        "events": float(queue.processed),
    }
    return result
