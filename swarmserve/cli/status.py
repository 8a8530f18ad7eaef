"""``swarmserve status``: a table of blocks × servers read from the DHT; exit code 1 when a block has no
ONLINE server. ``render_status`` is pure, so the table is tested without a swarm."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from swarmserve.cli.common import DEFAULT_MODEL, subcommand


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "status", "blocks × servers of a swarm; exit code 1 when a block is not served")
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddr(s) of DHT peers")
    p.add_argument(
        "--model",
        default=None,
        help=f"local path or 🤗 id: gives the block count and DHT prefix (default: {DEFAULT_MODEL}, "
        "what `swarmserve up` serves by default)",
    )
    p.add_argument("--dht-prefix", default=None, help="DHT namespace (default: the model's basename)")
    p.add_argument("--num-blocks", type=int, default=None, help="the model's block count (without --model)")
    p.add_argument("--json", action="store_true", help="print the swarm state as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, rest: list[str]) -> int:
    from hivemind.dht import DHT

    from swarm_client.config import default_dht_prefix, parse_initial_peers
    from swarm_client.dht_records import fetch_block_records, spans_from_records
    from swarm_client.model_source import ModelNotFoundError
    from swarmserve.launcher import model_num_blocks

    model = args.model
    if model is None and (args.dht_prefix is None or args.num_blocks is None):
        model = DEFAULT_MODEL  # what a plain `swarmserve up` serves
    num_blocks = args.num_blocks
    if num_blocks is None:
        try:
            num_blocks = model_num_blocks(model)
        except (ModelNotFoundError, OSError) as exc:
            print(f"swarmserve status: {exc}; give --model, or --dht-prefix and --num-blocks", file=sys.stderr)
            return 2
    prefix = args.dht_prefix or default_dht_prefix(model)
    dht = DHT(initial_peers=parse_initial_peers(args.initial_peers), client_mode=True, start=True)
    try:
        spans = spans_from_records(fetch_block_records(dht, prefix, num_blocks))
    finally:
        dht.shutdown()
    text, missing = render_status(prefix, num_blocks, spans, as_json=args.json)
    print(text, flush=True)
    return 1 if missing else 0


def reachability_label(announced: object) -> str:
    """How the swarm reaches a server as it announced it (``Reachability``), or "not checked" (a server started
    with ``--no-reachability-check``, or older than the check)."""
    return str(getattr(announced, "value", announced)) if announced else "not checked"


def adapter_lines(spans: list, names: list[str]) -> list[str]:
    """One line per LoRA adapter announced (``--adapters``): the servers holding it."""
    holders: dict[str, list[str]] = {}
    for span, name in zip(spans, names, strict=True):
        for adapter in span.server_info.adapters:
            holders.setdefault(adapter, []).append(f"{name} ({span.start}:{span.end})")
    return [f"adapter {adapter!r}: {', '.join(held)}" for adapter, held in sorted(holders.items())]


def quant_label(info: object) -> str:
    """The weight quantization a server announced (``none``, ``int8``, ``nf4``; worker/quant.py)."""
    return str(getattr(info, "quant", None) or "none")


def render_status(prefix: str, num_blocks: int, spans: Mapping[str, Any], *, as_json: bool = False) -> tuple[str, list]:
    """The swarm as a table (one row per server, one column per block) plus coverage; also the missing
    blocks. ``spans``: peer id → ``RemoteSpanInfo``. Servers are named by their full peer id (as the
    workers' ready lines, ``swarmserve up`` and /v1/swarm print it) or their ``--public-name``."""
    from swarm_client.dht_records import ServerState
    from swarm_client.routing import coverage, format_blocks, missing_blocks

    missing = missing_blocks(spans, num_blocks)
    per_block = coverage(spans, num_blocks)
    ordered = sorted(spans.values(), key=lambda s: (s.start, s.end, s.peer_id))
    if as_json:
        payload = {
            "dht_prefix": prefix,
            "num_blocks": num_blocks,
            "missing_blocks": missing,
            "servers": [
                {
                    "peer_id": s.peer_id,
                    "start": s.start,
                    "end": s.end,
                    "state": ServerState(s.state).name,
                    "throughput": s.server_info.throughput,
                    "cache_tokens_left": s.server_info.cache_tokens_left,
                    "public_name": s.server_info.public_name,
                    "reachability": reachability_label(s.server_info.reachability),
                    "quant": quant_label(s.server_info),
                    "adapters": list(s.server_info.adapters),
                }
                for s in ordered
            ],
            "blocks": per_block,
        }
        return json.dumps(payload, indent=2), missing

    names = [s.server_info.public_name or s.peer_id for s in ordered]
    width = max([len("server"), *map(len, names)])
    lines = [f"swarm {prefix!r}: {num_blocks} blocks, {len(ordered)} server(s)"]
    head = f"{'server':<{width}} {'blocks':>9}  {'state':<7} {'quant':<5} {'reachability':<12} {'throughput':>12}"
    lines.append(f"{head} {'cache left':>10}  map")
    pad = width + 64  # where the map column starts
    ruler = "".join(str(b // 10 % 10) if b % 10 == 0 else " " for b in range(num_blocks))
    lines += [f"{'':<{pad}}{ruler}".rstrip(), f"{'':<{pad}}{''.join(str(b % 10) for b in range(num_blocks))}"]
    for s, name in zip(ordered, names, strict=True):
        state = ServerState(s.state)
        mark = {ServerState.ONLINE: "█", ServerState.JOINING: "j"}.get(state, "x")
        row = "".join(mark if s.start <= b < s.end else "·" for b in range(num_blocks))
        lines.append(
            f"{name:<{width}} {f'{s.start}:{s.end}':>9}  {state.name:<7} {quant_label(s.server_info):<5} "
            f"{reachability_label(s.server_info.reachability):<12} "
            f"{s.server_info.throughput:>8.1f} t/s {s.server_info.cache_tokens_left:>10}  {row}"
        )
    counts = "".join(str(min(len(p), 9)) if p else "!" for p in per_block)
    lines.append(f"{'servers per block (ONLINE)':<{pad}}{counts}")
    lines += adapter_lines(ordered, names)
    if missing:
        lines.append(f"NOT COVERED: {format_blocks(missing)} (no ONLINE server); requests will get 503")
    else:
        lines.append("fully covered: every block has an ONLINE server")
    return "\n".join(lines), missing
