"""Why a block range has no usable server: the text of ``NoRouteError`` (``routing.find_route``).

An operator reading a 503 should learn, per unserved block range, whether nobody serves it at all, or who does
and why the client will not use them: banned (with the reason recorded at the ban, e.g. a ping that never came
back from a server announcing an address behind NAT), not ONLINE, or too small for the session.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from swarm_client.dht_records import RemoteSpanInfo, ServerState
from swarm_client.errors import NoRouteError

__all__ = ["describe_holder", "format_blocks", "no_route_error"]

#: holders named per unserved range (the rest are counted)
MAX_NAMED = 3


def format_blocks(blocks: Iterable[int]) -> str:
    """Compact, human-readable block list: ``"block 3"``, ``"blocks 3..5"``, ``"blocks 0, 3..5, 8..9"``."""
    ordered = sorted(set(blocks))
    if not ordered:
        return "no blocks"
    ranges: list[tuple[int, int]] = []
    first = last = ordered[0]
    for block in ordered[1:]:
        if block == last + 1:
            last = block
            continue
        ranges.append((first, last))
        first = last = block
    ranges.append((first, last))
    parts = [str(a) if a == b else f"{a}..{b}" for a, b in ranges]
    noun = "block" if len(ordered) == 1 else "blocks"
    return f"{noun} {', '.join(parts)}"


def describe_holder(
    span: RemoteSpanInfo,
    banned: Collection[str],
    why: Mapping[str, str],
    cache_tokens_needed: int = 0,
    adapter: str | None = None,
) -> str:
    """Why the server of ``span`` is not used: ``"peer X is banned: <reason>"``, ``"... is JOINING"``..."""
    info = span.server_info
    if span.peer_id in banned:
        state = f"is banned: {why.get(span.peer_id) or 'it failed recently'}"
    elif span.state != ServerState.ONLINE:
        state = f"is {span.state.name}"
    elif adapter is not None and adapter not in info.adapters:
        held = ", ".join(info.adapters) or "none"
        state = f"does not hold adapter {adapter!r} (it holds: {held})"
    elif info.cache_tokens_total is not None and info.cache_tokens_total < cache_tokens_needed:
        state = f"cannot hold a session of {cache_tokens_needed} tokens (its cache: {info.cache_tokens_total})"
    else:
        state = "is excluded"
    return f"peer {span.peer_id} {state}"


def _runs(blocks: list[int], holders_of: Mapping[int, tuple[str, ...]]) -> list[tuple[int, int]]:
    """``blocks`` (sorted) cut into maximal runs ``[a, b)`` of consecutive blocks with the same holders."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][1] == block and holders_of[runs[-1][0]] == holders_of[block]:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs


def no_route_error(
    spans: Mapping[str, RemoteSpanInfo],
    start: int,
    end: int,
    eligible: list[RemoteSpanInfo],
    banned: Collection[str],
    why: Mapping[str, str] | None = None,
    cache_tokens_needed: int = 0,
    adapter: str | None = None,
) -> NoRouteError:
    """The error for a failed route over ``[start, end)``: the blocks no ``eligible`` server holds and, per
    range of them, who else holds them and why each is not used (``why``: reasons of bans, by peer)."""
    why = why or {}
    held = set()
    for span in eligible:
        held.update(range(max(span.start, start), min(span.end, end)))
    missing = [block for block in range(start, end) if block not in held]
    if not missing:  # unreachable with mid-span entry, kept so the error never lies
        return NoRouteError(
            f"no route through blocks [{start}, {end}) although every block is held by an eligible server",
            missing_blocks=[],
        )
    holders_of = {block: tuple(sorted(p for p, s in spans.items() if s.start <= block < s.end)) for block in missing}
    parts = []
    for a, b in _runs(missing, holders_of):
        blocks = format_blocks(range(a, b))
        holders = holders_of[a]
        if not holders:
            parts.append(f"{blocks}: no server announces them")
            continue
        named = [describe_holder(spans[p], banned, why, cache_tokens_needed, adapter) for p in holders[:MAX_NAMED]]
        more = f"; and {len(holders) - MAX_NAMED} more" if len(holders) > MAX_NAMED else ""
        verb = "has" if b - a == 1 else "have"
        parts.append(f"{blocks} {verb} no usable server: {'; '.join(named)}{more}")
    holders = {p for peers in holders_of.values() for p in peers}
    num_banned = sum(1 for p in holders if p in banned)
    num_not_online = sum(1 for p in holders if p not in banned and spans[p].state != ServerState.ONLINE)
    counts = f" ({num_banned} banned, {num_not_online} not ONLINE)" if num_banned or num_not_online else ""
    with_adapter = f" with adapter {adapter!r}" if adapter is not None else ""
    return NoRouteError(
        f"no route through blocks [{start}, {end}){with_adapter}: no ONLINE, unbanned server holds "
        f"{format_blocks(missing)}{with_adapter}{counts} — " + " | ".join(parts),
        missing_blocks=missing,
        adapter=adapter,
    )
