"""``swarmserve dht``: a bootstrap DHT node; prints its multiaddrs as ``initial_peers: <maddr>`` lines."""

from __future__ import annotations

import argparse

from swarmserve.cli.common import add_listen_flags, stop_on_signals, subcommand
from swarmserve.launcher import DHT_READY


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "dht", "run a bootstrap DHT node and print its multiaddr")
    add_listen_flags(p, "the DHT node", 0)
    p.add_argument("--initial-peers", nargs="*", default=[], help="multiaddr(s) of other DHT peers to join")
    p.add_argument("--model", default=None, help="check records of this model's blocks (its DHT prefix)")
    p.add_argument("--dht-prefix", default=None, help="check records under this prefix")
    p.add_argument("--identity-path", default=None, help="peer id key file (made if missing)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, rest: list[str]) -> int:
    from hivemind.dht import DHT

    from swarm_client.config import default_dht_prefix, parse_initial_peers
    from swarm_client.dht_records import record_validators

    prefix = args.dht_prefix or (default_dht_prefix(args.model) if args.model else None)
    identity = {"identity_path": args.identity_path} if args.identity_path else {}
    # the DHT forks its process first: that child must keep the default signal handlers
    dht = DHT(
        initial_peers=parse_initial_peers(args.initial_peers),
        host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
        start=True,
        record_validators=record_validators(prefix),  # signatures always; the schema once we know the keys
        **identity,
    )
    with stop_on_signals() as stop:
        for maddr in dht.get_visible_maddrs():
            print(f"{DHT_READY} {maddr}", flush=True)
        stop.wait()
        dht.shutdown()
    return 0
