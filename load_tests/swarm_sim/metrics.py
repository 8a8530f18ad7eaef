"""What the swarm serves against what its hardware could serve.

Served: each session decodes one token per round trip, so its rate is at most ``1 / latency`` (RTTs plus
compute along its route); and a server whose sessions need ``L`` block-passes per token in total gives each
of them at most ``throughput / L`` tokens/s (an equal share). A session's rate is the least of these; the
swarm's throughput is their sum.

Bound ("optimum for the same hardware"): ``sum(actual throughput of the live servers) / num_blocks``. Every
token needs ``num_blocks`` block-passes and the swarm performs at most ``sum(throughput)`` block-passes per
second whatever the assignment, so no placement and no routing can exceed it; the served figure above never
does (sum over sessions of rate × blocks ≤ sum over servers of throughput). It ignores memory (which blocks fit
where) and latency, so it is not always reachable.
"""

from __future__ import annotations

from collections import defaultdict

from load_tests.swarm_sim import inputs
from load_tests.swarm_sim.clients import Clients
from load_tests.swarm_sim.swarm import Swarm


def served_throughput(swarm: Swarm, clients: Clients) -> float:
    """Tokens/s the sessions get now (see the module docstring)."""
    passes: dict[str, int] = defaultdict(int)
    active = [c for c in clients.clients if c.route]
    for client in active:
        for hop in client.route:
            passes[hop.peer_id] += hop.length
    total = 0.0
    for client in active:
        rate = 1.0 / clients.latency(client, client.route)
        for hop in client.route:
            server = swarm.servers[hop.peer_id]
            rate = min(rate, server.actual_throughput / passes[hop.peer_id] if server.alive else 0.0)
        total += rate
    return total


def hardware_bound(swarm: Swarm) -> float:
    """``sum(actual throughput of live servers) / num_blocks``: no assignment serves more."""
    return sum(s.actual_throughput for s in swarm.live()) / inputs.NUM_BLOCKS


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
