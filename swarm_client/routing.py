"""Route choice through the swarm: which servers run which blocks (the servers to avoid for a while: ``bans``).

Pure decision code, no I/O: callers pass in the spans they read from the DHT (``dht_records``), the RTTs
they measured and the peers they banned. ``find_route`` is Dijkstra over block boundaries: node ``s``
means "blocks ``[start, s)`` are done"; a server holding ``[a, b)`` offers an edge ``s -> e`` for every
``a <= s < e <= b``, so a route may enter a span mid-way and leave it early, and one failed span can be
replaced by several smaller ones.

Hostile peers: a server's announced throughput is only a claim. ``effective_throughputs`` bounds each claim
by a small multiple of the (low) median claim (one announcement alone cannot win every route) and by what the
client measured of the server's real steps (``step_times``); a trust policy (``trusted``) names the only
peers allowed to serve the first and the last block of the model, whose activations are closest to the text.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from swarm_client.bans import BanList
from swarm_client.dht_records import RemoteSpanInfo, ServerState
from swarm_client.errors import NoRouteError
from swarm_client.route_explain import format_blocks, no_route_error

__all__ = [
    "CACHE_PENALTY",
    "CLAIM_CAP_FACTOR",
    "LOCAL_PEER",
    "BanList",
    "RouteHop",
    "coverage",
    "effective_throughputs",
    "find_route",
    "format_blocks",
    "missing_blocks",
]

CACHE_PENALTY = 1000.0
"""Seconds added to a hop whose server lacks the cache room the session needs: used only as a last resort."""

CLAIM_CAP_FACTOR = 4.0
"""An announced throughput counts for at most this many times the median claim of the ONLINE servers."""

LOCAL_PEER = "local"
"""The pseudo peer of the blocks a client holds itself (``local_span``): a hop of its routes, never a server."""

_MIN_THROUGHPUT = 1e-6  # a server announcing 0 tokens/s is usable, but only when nothing else is
_COST_DIGITS = 9  # costs equal to this many digits count as a tie (float sums of the same terms differ)

# Dijkstra label: (cost rounded to _COST_DIGITS, hops, path), path = ((peer_id, hop_end), ...).
_Label = tuple[float, int, tuple[tuple[str, int], ...]]


@dataclass(frozen=True)
class RouteHop:
    """Run blocks ``[start, end)`` on ``peer_id``."""

    peer_id: str
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def coverage(spans: Mapping[str, RemoteSpanInfo], num_blocks: int) -> list[list[str]]:
    """For each block in ``[0, num_blocks)``, the sorted peer ids of ONLINE servers holding it."""
    per_block: list[list[str]] = [[] for _ in range(num_blocks)]
    for peer_id, span in spans.items():
        if span.state != ServerState.ONLINE:
            continue
        for block in range(max(span.start, 0), min(span.end, num_blocks)):
            per_block[block].append(peer_id)
    for peers in per_block:
        peers.sort()
    return per_block


def missing_blocks(spans: Mapping[str, RemoteSpanInfo], num_blocks: int) -> list[int]:
    """Blocks in ``[0, num_blocks)`` that no ONLINE server holds."""
    return [block for block, peers in enumerate(coverage(spans, num_blocks)) if not peers]


def effective_throughputs(
    spans: Mapping[str, RemoteSpanInfo],
    measured: Mapping[str, float] | None = None,
    cap_factor: float = CLAIM_CAP_FACTOR,
) -> dict[str, float]:
    """The throughput (tokens/s through one block) routing believes of each server.

    A claim is clipped to ``cap_factor`` × the low median claim of the ONLINE servers (of two, the smaller),
    so one server announcing 1e9 tok/s cannot draw every route before anybody measured it; where the client
    measured the server (``measured``, tokens/s per block from real decode steps), the figure is
    ``min(clipped claim, measured)``:
    a server far slower than it claims loses its advantage, and one measured faster keeps its (clipped) claim.
    """
    measured = measured or {}
    claims = [
        span.server_info.throughput
        for span in spans.values()
        if span.state == ServerState.ONLINE and span.server_info.throughput > 0
    ]
    cap = cap_factor * statistics.median_low(claims) if claims else float("inf")
    speeds = {}
    for peer_id, span in spans.items():
        speed = min(span.server_info.throughput, cap)
        if peer_id in measured:
            speed = min(speed, measured[peer_id])
        speeds[peer_id] = speed
    return speeds


def find_route(
    spans: Mapping[str, RemoteSpanInfo],
    start: int,
    end: int,
    *,
    rtt: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
    default_rtt: float = 0.01,
    cache_tokens_needed: int = 0,
    busy: Collection[str] = (),
    load: Mapping[str, float] | None = None,
    throughput: Mapping[str, float] | None = None,
    trusted: Collection[str] = (),
    num_blocks: int | None = None,
    why: Mapping[str, str] | None = None,
    adapter: str | None = None,
) -> list[RouteHop]:
    """Cheapest chain of ONLINE, unbanned servers that runs blocks ``[start, end)`` in order.

    A hop on ``peer`` over ``[s, e)`` costs ``rtt[peer] + (e - s) / throughput × (1 + load)``, where
    ``throughput`` is ``throughput[peer]`` (``effective_throughputs``; default: the announced claims, clipped
    to ``CLAIM_CAP_FACTOR`` × their median), plus
    ``CACHE_PENALTY`` if the server is full for this session: ``cache_tokens_left < cache_tokens_needed``,
    no free session slot announced, or in ``busy`` (it just answered "busy"). ``load`` is how occupied the
    server is — the announced share of its cache in use, plus ``load[peer]`` (the caller's own sessions
    there, which announcements report late) — so sessions spread instead of piling onto the fastest server.
    A server whose whole budget (``cache_tokens_total``) is below ``cache_tokens_needed`` is not eligible.
    Among equally cheap routes the one with fewer hops wins, then the one whose peer ids (and split points)
    sort first. An empty range gives ``[]``.

    Trust policy: with ``trusted`` peer ids (and the model's ``num_blocks``), the hop that runs block 0 and
    the hop that runs block ``num_blocks - 1`` (where ``[start, end)`` holds them) must be on a trusted peer.

    With a LoRA ``adapter``, only servers announcing it (``ServerInfo.adapters``) are eligible.

    Raises ``NoRouteError`` naming the blocks no eligible server holds (in ``missing_blocks``) and, per range
    of them, who holds them and why they are not used (``why``: the reason of each ban, by peer;
    ``route_explain``), or, under a trust policy, the end blocks no eligible trusted server holds.
    """
    if start < 0 or end < start:
        raise ValueError(f"invalid block range [{start}, {end})")
    if start == end:
        return []
    trusted_set = set(trusted)
    if trusted_set and num_blocks is None:
        raise ValueError("a trust policy needs num_blocks (which block is the last one)")
    rtt = rtt or {}
    speeds = effective_throughputs(spans) if throughput is None else throughput
    banned_set = set(banned)
    busy_set, load = set(busy), load or {}
    eligible = [
        span
        for peer_id, span in sorted(spans.items())
        if span.state == ServerState.ONLINE
        and peer_id not in banned_set
        and max(span.start, start) < min(span.end, end)
        and (span.server_info.cache_tokens_total is None or span.server_info.cache_tokens_total >= cache_tokens_needed)
        and (adapter is None or adapter in span.server_info.adapters)
    ]

    def cost_terms(span: RemoteSpanInfo) -> tuple[float, float, float, float]:
        """A hop on ``span`` over ``blocks`` costs ``rtt + blocks / speed * (1 + occupied) (+ penalty)``."""
        info = span.server_info
        occupied = load.get(span.peer_id, 0.0)
        if info.cache_tokens_total:
            occupied += 1.0 - min(info.cache_tokens_left, info.cache_tokens_total) / info.cache_tokens_total
        speed = max(speeds.get(span.peer_id, info.throughput), _MIN_THROUGHPUT)
        full = info.cache_tokens_left < cache_tokens_needed or info.sessions_left == 0 or span.peer_id in busy_set
        return max(rtt.get(span.peer_id, default_rtt), 0.0), speed, 1.0 + occupied, CACHE_PENALTY if full else 0.0

    def allowed(peer_id: str, hop_start: int, hop_end: int) -> bool:
        """The trust policy: only trusted peers run block 0 and the model's last block."""
        ends_touched = hop_start == 0 or hop_end == num_blocks
        return not trusted_set or not ends_touched or peer_id in trusted_set

    if trusted_set:
        _check_trusted_ends(eligible, start, end, trusted_set, num_blocks)

    # each node's spans (those holding block ``node``), in peer-id order, with their cost terms
    covering: dict[int, list[tuple[RemoteSpanInfo, tuple[float, float, float, float]]]] = {}
    for span in eligible:
        terms = cost_terms(span)
        for node in range(max(span.start, start), min(span.end, end)):
            covering.setdefault(node, []).append((span, terms))

    # Labels never tie (the path identifies the route) and strictly grow along an edge (hops + 1), so
    # popping them in order is exact Dijkstra with the tie-breaks built in. A label's path is built only when
    # its cost and hops do not already decide against it.
    best: dict[int, _Label] = {start: (0.0, 0, ())}
    heap: list[tuple[_Label, float, int]] = [((0.0, 0, ()), 0.0, start)]
    settled: set[int] = set()
    while heap:
        label, cost, node = heapq.heappop(heap)
        if node in settled or label != best[node]:
            continue
        settled.add(node)
        if node == end:
            return _hops_from_path(label[2], start)
        hops = label[1] + 1
        for span, (rtt_s, speed, busy_factor, penalty) in covering.get(node, ()):
            for hop_end in range(node + 1, min(span.end, end) + 1):
                if hop_end in settled or not allowed(span.peer_id, node, hop_end):
                    continue
                hop_cost = rtt_s + (hop_end - node) / speed * busy_factor
                if penalty:
                    hop_cost += penalty
                new_cost = cost + hop_cost
                rounded = round(new_cost, _COST_DIGITS)
                known = best.get(hop_end)
                if known is not None and (rounded, hops) > known[:2]:
                    continue
                new_label = (rounded, hops, (*label[2], (span.peer_id, hop_end)))
                if known is None or new_label < known:
                    best[hop_end] = new_label
                    heapq.heappush(heap, (new_label, new_cost, hop_end))

    raise no_route_error(spans, start, end, eligible, banned_set, why, cache_tokens_needed, adapter)


def _check_trusted_ends(
    eligible: list[RemoteSpanInfo], start: int, end: int, trusted: set[str], num_blocks: int | None
) -> None:
    """NoRouteError when no eligible trusted server holds block 0 or the last block (where in range)."""
    ends = sorted({block for block in (0, (num_blocks or 0) - 1) if start <= block < end})
    held = {block for block in ends for span in eligible if span.peer_id in trusted and span.start <= block < span.end}
    missing = [block for block in ends if block not in held]
    if missing:
        shown = ", ".join(sorted(trusted)[:5]) + (", ..." if len(trusted) > 5 else "")
        raise NoRouteError(
            f"no route through blocks [{start}, {end}): the trust policy lets only trusted peers ({shown}) serve "
            f"the first and the last block, and none of them that is ONLINE and unbanned holds "
            f"{format_blocks(missing)}; start a server you trust on those blocks, or add its peer id to "
            f"trusted_peers (--trusted-peers, SWARMSERVE_TRUSTED_PEERS)",
            missing_blocks=missing,
        )


def _hops_from_path(path: tuple[tuple[str, int], ...], start: int) -> list[RouteHop]:
    hops: list[RouteHop] = []
    hop_start = start
    for peer_id, hop_end in path:
        hops.append(RouteHop(peer_id, hop_start, hop_end))
        hop_start = hop_end
    return hops
