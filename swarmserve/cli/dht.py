"""``swarmserve dht``: a bootstrap DHT node; prints its multiaddrs as ``initial_peers: <maddr>`` lines.

Also home of ``--public-ip`` / ``--announce-maddrs`` (shared with ``swarmserve worker``): what a node behind
NAT or in a container tells the swarm to dial instead of the addresses it listens on."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import threading

from swarmserve.cli.common import add_listen_flags, stop_on_signals, subcommand
from swarmserve.launcher import DHT_READY


def add_announce_flags(p: argparse.ArgumentParser) -> None:
    """``--public-ip`` and ``--announce-maddrs``: the addresses other peers are told to dial."""
    p.add_argument(
        "--public-ip",
        default=None,
        help="announce /ip4/IP/tcp/PORT (PORT = --port, which must then be fixed, not 0): the address peers "
        "reach this node at, e.g. a router's public IP forwarding PORT here, or the Docker host's address",
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="announce exactly these multiaddrs (each with an explicit port), e.g. /dns4/host.example/tcp/31330",
    )


def announced_maddrs(public_ip: str | None, port: int, maddrs: list[str]) -> list[str]:
    """The multiaddrs to announce (empty: hivemind announces the addresses it listens on).

    Raises ``ValueError`` with what to change for a bad IP, ``--public-ip`` without a fixed port, or a
    multiaddr without an explicit port."""
    from hivemind.utils.multiaddr import Multiaddr

    out = []
    for text in maddrs:
        try:
            maddr = Multiaddr(text)
        except Exception as exc:  # multiaddr raises several types for malformed text
            raise ValueError(f"--announce-maddrs {text!r} is not a multiaddr: {exc}") from None
        protocols = {proto.name for proto in maddr.protocols()}
        if not protocols & {"tcp", "udp"} or maddr.value_for_protocol("tcp" if "tcp" in protocols else "udp") == "0":
            raise ValueError(f"--announce-maddrs {text}: needs an explicit, non-zero port (e.g. .../tcp/31330)")
        out.append(text)
    if public_ip:
        try:
            ip = ipaddress.ip_address(public_ip)
        except ValueError:
            raise ValueError(f"--public-ip {public_ip!r} is not an IP address") from None
        if not port:
            raise ValueError(
                "--public-ip needs a fixed --port (the port forwarded to this machine), not 0 (a random port "
                "nobody forwards)"
            )
        out.append(f"/ip{ip.version}/{ip}/tcp/{port}")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "dht", "run a bootstrap DHT node and print its multiaddr")
    add_listen_flags(p, "the DHT node", 0)
    add_announce_flags(p)
    p.add_argument("--initial-peers", nargs="*", default=[], help="multiaddr(s) of other DHT peers to join")
    p.add_argument("--model", default=None, help="check records of this model's blocks (its DHT prefix)")
    p.add_argument("--dht-prefix", default=None, help="check records under this prefix")
    p.add_argument("--identity-path", default=None, help="peer id key file (made if missing)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        announce = announced_maddrs(args.public_ip, args.port, args.announce_maddrs)
    except ValueError as exc:
        raise SystemExit(f"swarmserve dht: {exc}") from None

    from hivemind.dht import DHT

    from swarm_client.config import default_dht_prefix, parse_initial_peers
    from swarm_client.dht_records import record_validators

    prefix = args.dht_prefix or (default_dht_prefix(args.model) if args.model else None)
    identity = {"identity_path": args.identity_path} if args.identity_path else {}
    # the DHT forks its process first: that child must keep the default signal handlers
    dht = DHT(
        initial_peers=parse_initial_peers(args.initial_peers),
        host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
        announce_maddrs=announce or None,
        start=True,
        record_validators=record_validators(prefix),  # signatures always; the schema once we know the keys
        **identity,
    )
    if announce:
        print(f"swarmserve dht: listening on {args.host}:{args.port}, announcing {' '.join(announce)}", flush=True)
    with stop_on_signals() as stop:
        asyncio.run(_serve(dht, stop))
        dht.shutdown()
    return 0


async def _serve(dht, stop: threading.Event) -> None:
    """Answer newcomers' reachability checks (worker/reachability_service.py) until ``stop``; the ready
    lines come once the RPC is served, so a worker started on them can be checked at once."""
    from worker.reachability_service import ReachabilityService

    service = ReachabilityService()
    await service.add_p2p_handlers(await dht.replicate_p2p())
    try:
        for maddr in dht.get_visible_maddrs():
            print(f"{DHT_READY} {maddr}", flush=True)
        while not stop.is_set():
            await asyncio.sleep(0.2)
    finally:
        await service.close()
