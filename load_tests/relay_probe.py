"""Can a hivemind peer behind a NAT be reached through a libp2p circuit relay? A reproducible probe.

Root only (tests/netlab.py). ``.venv/bin/python -m load_tests.relay_probe [--watch 75]``: about 2 minutes.
Findings: load_tests/results/relay-findings-2026-12-06.md.

Lab: a public relay R (a plain hivemind peer: every p2pd with ``-relay=1``, hivemind's default, serves the
circuit v2 hop protocol), a public client C, and one NATed peer per configuration below, each behind its own
MASQUERADE router (unsolicited inbound dropped). Each NATed peer bootstraps from R (so it holds an outbound
connection to R from the start) and serves a ``ServicerBase`` with a unary and a stream echo.

The public side uses 11.231.0.0/24, not 10.x: go-libp2p's autorelay builds ``/p2p-circuit`` addresses only
from a relay's *public* addresses (``cleanupAddressSet`` keeps ``manet.IsPublicAddr``), so a relay on an
RFC 1918 bridge can never yield one. Nothing leaves the machine (the lab routes nothing off it).

Daemons are started here, inside their namespaces, with the flags ``hivemind.P2P.create`` would pass for the
named ``P2P.create`` kwargs (``hivemind_flags``), and driven with ``P2P.replicate`` over their unix sockets
(which do not depend on the network namespace). The ``static`` configuration adds ``-relayDiscovery=0``,
which ``P2P.create`` cannot pass. Prints what it sees; writes nothing. "relayed+direct" means DCUtR added a
direct connection (the NATed peer dialled out to the client) beside the relayed one; libp2p then prefers it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from importlib.resources import files
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing.AsyncIterator only

import hivemind.hivemind_cli as cli
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from tests.netlab import NetLab

PUBLIC = "11.231.0"
RELAY_PORT, CLIENT_PORT, NAT_PORT = 31400, 31401, 31402
GOLOG = "error,autorelay=debug,relay=debug,p2p-circuit=debug,autonat=debug,p2p-holepunch=debug"
DIAL_TIMEOUT = 10.0
LOG_WORDS = ("reserving relay slot", "adding new relay", "NAT status", "hole punch", "relayed ", "direct conn")


@dataclass
class Config:
    name: str
    p2p_kwargs: dict  # hivemind.P2P.create kwargs beyond host_maddrs / initial_peers; "{relay}" is filled in
    extra: tuple[str, ...] = ()  # raw p2pd flags P2P.create cannot pass
    forward: bool = False  # port forward on the router + announce the router's address (direct baseline)
    relay: str = "relay"  # which public relay it bootstraps from and trusts


PRIVATE = {"use_auto_relay": True, "trusted_relays": ["{relay}"], "force_reachability": "private"}
CONFIGS = [
    Config("plain", {}),  # hivemind defaults: use_relay=True, use_auto_relay=False
    Config("auto", {"use_auto_relay": True}),
    Config("auto+trusted", {"use_auto_relay": True, "trusted_relays": ["{relay}"]}),
    Config("auto+trusted+private", PRIVATE),
    Config("static", PRIVATE, extra=("-relayDiscovery=0",)),
    Config("static@fresh-relay", PRIVATE, extra=("-relayDiscovery=0",), relay="fresh"),
    Config("forward", {}, forward=True),
]


def fill(kwargs: dict, relay: str) -> dict:
    return {k: [relay if x == "{relay}" else x for x in v] if isinstance(v, list) else v for k, v in kwargs.items()}


def hivemind_flags(
    listen: str,
    *,
    host_maddrs: list[str],
    initial_peers: list[str] = (),
    announce_maddrs: list[str] = (),
    use_auto_relay: bool = False,
    use_relay: bool = True,
    trusted_relays: list[str] = (),
    force_reachability: str | None = None,
    dht_mode: str = "server",
) -> list[str]:
    """p2pd flags as ``P2P.create`` (hivemind 1.1.12) builds them from these kwargs and its other defaults
    (auto_nat, conn_manager, nat_port_map, dht_mode="server", tls), except ``idleTimeout=0``: the daemon is
    driven through ``P2P.replicate``, which opens no persistent connection until a call needs one."""
    kwargs: dict = dict(P2P.DHT_MODE_MAPPING[dht_mode])
    kwargs.update(P2P.FORCE_REACHABILITY_MAPPING.get(force_reachability, {}))
    for param, value in (
        ("bootstrapPeers", initial_peers),
        ("hostAddrs", host_maddrs),
        ("announceAddrs", announce_maddrs),
        ("trustedRelays", trusted_relays),
    ):
        if value:
            kwargs[param] = ",".join(value)
    return P2P._make_process_args(  # noqa: SLF001 - the very formatter P2P.create uses
        str(files(cli) / "p2pd"),
        autoRelay=use_auto_relay,
        autonat=True,
        b=bool(initial_peers),
        connManager=True,
        idleTimeout="0s",
        listen=listen,
        natPortMap=True,
        relay=use_relay,
        relayHopLimit=0,
        tls=True,
        persistentConnMaxMsgSize=4 << 20,
        **kwargs,
    )


class Echo(ServicerBase):
    async def rpc_echo(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=request.tensors)

    async def rpc_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for request in requests:
            yield runtime_pb2.ExpertResponse(tensors=request.tensors)


def payload(size: int) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(uid="x", tensors=[runtime_pb2.Tensor(buffer=os.urandom(size))])


class Node:
    """A p2pd inside a namespace, its log kept, driven through ``P2P.replicate``."""

    def __init__(self, lab: NetLab, ns: str, name: str, flags_kwargs: dict, extra: list[str] = ()) -> None:
        self.name = name
        self.listen = f"/unix/tmp/hivemind-relayprobe-{secrets.token_hex(4)}.sock"
        self.argv = hivemind_flags(self.listen, **flags_kwargs) + list(extra)
        env = {**os.environ, "GOLOG_LOG_LEVEL": GOLOG, "GOLOG_LOG_FMT": "nocolor"}
        self.proc = subprocess.Popen(
            lab.argv(ns, *self.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
        )
        self.log: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.p2p: P2P | None = None
        self.started = 0.0
        self.address = self.full = ""  # public relays: their tcp maddr, and it with /p2p/<id>

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if line.startswith("Peer ID:"):
                self.started = time.monotonic()
                self.ready.set()

    async def start(self) -> P2P:
        if not await asyncio.to_thread(self.ready.wait, 20):
            raise RuntimeError(f"{self.name}: p2pd did not start:\n" + "\n".join(self.log[-25:]))
        self.p2p = await P2P.replicate(Multiaddr(self.listen))
        return self.p2p

    def grep(self, *words: str, limit: int = 6) -> list[str]:
        hits = [line for line in self.log if any(w in line for w in words)]
        return [h[:300] for h in hits[:limit]]

    def close(self) -> None:
        if self.p2p is not None:
            self.p2p._terminate()  # noqa: SLF001 - closes the client only; the daemon is ours to kill
        self.proc.kill()
        self.proc.wait(5)
        path = self.listen.removeprefix("/unix")
        if os.path.exists(path):
            os.unlink(path)


def circuit_maddr(relay_maddr: str, relay: PeerID, target: PeerID) -> Multiaddr:
    """``<relay_maddr>/p2p/<relay>/p2p-circuit/p2p/<target>`` in the binary form go-multiaddr reads.

    hivemind's bundled py-multiaddr encodes a ``/p2p/<id>`` value as a CIDv1 (``01 72`` + multihash), while
    go-multiaddr wants the bare multihash: p2pd answers such bytes with "length greater than remaining number
    of bytes in buffer" (printed below as the ``(b0)`` attempt). Here the ``/p2p`` parts are written by hand."""

    def p2p(peer: PeerID) -> bytes:  # varint code 421 (p2p), one-byte length (peer ids are < 128 bytes), multihash
        mh = peer.to_bytes()
        return b"\xa5\x03" + bytes([len(mh)]) + mh

    return Multiaddr(Multiaddr(relay_maddr).to_bytes() + p2p(relay) + b"\xa2\x02" + p2p(target))  # a2 02: circuit


async def conn_kind(client: P2P, peer: PeerID) -> str:
    """ "relayed", "direct <addr>", both joined by "+" (one per open connection), or "not connected"."""
    addrs = [str(a) for info in await client._client.list_peers() if info.peer_id == peer for a in info.addrs]  # noqa: SLF001
    return "+".join("relayed" if "p2p-circuit" in a else f"direct {a}" for a in addrs) or "not connected"


async def attempt(label: str, coro) -> bool:
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(coro, DIAL_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the error is the finding
        message = " ".join(str(exc).split())[:900]
        print(f"    {label}: FAIL after {time.monotonic() - t0:.1f}s: {type(exc).__name__}: {message}")
        return False
    print(f"    {label}: ok in {time.monotonic() - t0:.2f}s")
    return True


async def dial_tests(client: P2P, nat: Node, relay_maddr: str, relay_id: PeerID) -> bool:
    """(a) by peer id only, (b) by an explicit circuit address; a unary call after each; disconnect between."""
    peer = nat.p2p.peer_id
    stub = Echo.get_stub(client, peer)
    await client._client.disconnect(peer)  # noqa: SLF001 - should the NATed peer have dialled the client
    print(f"    before: {await conn_kind(client, peer)}")
    ok_id = await attempt("(a) connect(peer_id, [])", client._client.connect(peer, []))  # noqa: SLF001
    if ok_id:
        await attempt("(a) unary echo", stub.rpc_echo(payload(64)))
        print(f"    (a) connection: {await conn_kind(client, peer)}")
        await client._client.disconnect(peer)  # noqa: SLF001
        await asyncio.sleep(1)
    naive = Multiaddr(f"{relay_maddr}/p2p/{relay_id}/p2p-circuit/p2p/{peer}")
    await attempt("(b0) connect via Multiaddr(<circuit string>)", client._client.connect(peer, [naive]))  # noqa: SLF001
    circuit = circuit_maddr(relay_maddr, relay_id, peer)
    ok_circ = await attempt(f"(b) connect via {circuit}", client._client.connect(peer, [circuit]))  # noqa: SLF001
    if ok_circ:
        await attempt("(b) unary echo", stub.rpc_echo(payload(64)))
        print(f"    (b) connection: {await conn_kind(client, peer)}")
    return ok_id or ok_circ


async def latency(client: P2P, peer: PeerID, rounds: int = 100) -> dict[str, float]:
    """Median ms of unary echoes (64 B) and of round trips inside one stream (64 B each)."""
    stub = Echo.get_stub(client, peer)
    unary = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await asyncio.wait_for(stub.rpc_echo(payload(64)), DIAL_TIMEOUT)
        unary.append((time.perf_counter() - t0) * 1e3)
    queue: asyncio.Queue = asyncio.Queue()

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (item := await queue.get()) is not None:
            yield item

    stream_rtt = []
    responses = await stub.rpc_stream(requests())
    for _ in range(rounds):
        t0 = time.perf_counter()
        await queue.put(payload(64))
        await asyncio.wait_for(anext(responses), DIAL_TIMEOUT)
        stream_rtt.append((time.perf_counter() - t0) * 1e3)
    await queue.put(None)
    return {"unary_ms": statistics.median(unary), "stream_ms": statistics.median(stream_rtt)}


async def big_payload(client: P2P, peer: PeerID, size: int) -> None:
    stub = Echo.get_stub(client, peer)
    await attempt(f"unary echo of {size >> 10} KiB", stub.rpc_echo(payload(size)))


async def measure(client: P2P, nated: dict[str, Node], reachable: list[str], relays: dict[str, Node]) -> None:
    """Large payloads first (a relay's data limit counts all bytes of a circuit), the most bytes a relay logged
    for one of the peer's circuits (logged as a circuit closes: disconnect first), then latency, re-dialling."""
    print("\n== large payloads, bytes through relays, then latency (median of 100, ms; 64 B each way)")
    for name in reachable:
        peer = nated[name].p2p.peer_id
        print(f"  {name}: {await conn_kind(client, peer)}")
        for size in (100 << 10, 1 << 20, 3 << 20):
            await big_payload(client, peer, size)
        await client._client.disconnect(peer)  # noqa: SLF001
        await asyncio.sleep(1)
        logged = [
            x.split("relayed ")[1] for r in relays.values() for x in r.log if "relayed " in x and f"to {peer}" in x
        ]
        print(
            f"    relays logged circuits to it carrying at most {max((int(x.split()[0]) for x in logged), default=0)} B"
        )
        try:
            lat = await latency(client, peer)
            kind = await conn_kind(client, peer)
            print(f"    {kind:.40s} unary {lat['unary_ms']:.2f}  stream round trip {lat['stream_ms']:.2f}")
        except Exception as exc:  # noqa: BLE001
            print(f"    latency run failed: {type(exc).__name__}: {exc}")


async def start_public(lab: NetLab, extra: int) -> tuple[dict[str, Node], Node]:
    """Relays ``relay`` (hivemind defaults) and ``fresh`` (forced private: its AutoNAT never says public, so only
    the hop service p2pd starts itself runs, with go-libp2p's default limits), ``extra`` plain public DHT peers,
    and the client (a DHT client, so NATed peers do not dial it and hand it a connection)."""
    relays: dict[str, Node] = {}
    for i, (name, kwargs) in enumerate((("relay", {}), ("fresh", {"force_reachability": "private"}))):
        ns = lab.host(name, f"{PUBLIC}.{2 + i}")
        relays[name] = Node(lab, ns, name, {"host_maddrs": [f"/ip4/0.0.0.0/tcp/{RELAY_PORT}"], **kwargs})
        relays[name].address = f"/ip4/{PUBLIC}.{2 + i}/tcp/{RELAY_PORT}"
    for node in relays.values():
        await node.start()
        node.full = f"{node.address}/p2p/{node.p2p.peer_id}"
    boot = [relays["relay"].full]
    for i in range(extra):
        ns = lab.host(f"pub{i}", f"{PUBLIC}.{10 + i}")
        relays[f"pub{i}"] = Node(
            lab, ns, f"pub{i}", {"host_maddrs": [f"/ip4/0.0.0.0/tcp/{RELAY_PORT}"], "initial_peers": boot}
        )
    kwargs = {"host_maddrs": [f"/ip4/0.0.0.0/tcp/{CLIENT_PORT}"], "initial_peers": boot, "dht_mode": "client"}
    client = Node(lab, lab.host("client", f"{PUBLIC}.9"), "client", kwargs)
    for node in [*relays.values(), client]:
        if node.p2p is None:
            await node.start()
    return relays, client


async def start_nated(lab: NetLab, relays: dict[str, Node]) -> dict[str, Node]:
    nated: dict[str, Node] = {}
    for i, cfg in enumerate(CONFIGS):
        router_ip = f"{PUBLIC}.{100 + i}"
        _, home, _ = lab.nat(f"r{i}", router_ip, lan=f"10.{240 + i}.0", forward=[NAT_PORT] if cfg.forward else [])
        relay = relays[cfg.relay].full
        kwargs = {"host_maddrs": [f"/ip4/0.0.0.0/tcp/{NAT_PORT}"], "initial_peers": [relay]}
        kwargs.update(fill(cfg.p2p_kwargs, relay))
        if cfg.forward:
            kwargs["announce_maddrs"] = [f"/ip4/{router_ip}/tcp/{NAT_PORT}"]
        nated[cfg.name] = Node(lab, home, cfg.name, kwargs, cfg.extra)
    for node in nated.values():
        await node.start()
        await Echo().add_p2p_handlers(node.p2p)
    return nated


async def watch_addrs(nated: dict[str, Node], watch: float) -> None:
    print(f"\n== visible maddrs of each NATed peer for {watch:.0f}s (identify, polled every 2s; t from its start)")
    t0, first = time.monotonic(), {}
    while time.monotonic() - t0 < watch and len(first) < len(nated):
        for name, node in nated.items():
            if name not in first and (
                found := [str(m) for m in await node.p2p.get_visible_maddrs(latest=True) if "p2p-circuit" in str(m)]
            ):
                first[name] = time.monotonic() - node.started
                print(f"  t={first[name]:5.1f}s {name}: {found}")
        await asyncio.sleep(2)
    for name, node in nated.items():
        maddrs = [
            str(m).split("/p2p/")[0] + ("/p2p-circuit" if "p2p-circuit" in str(m) else "")
            for m in await node.p2p.get_visible_maddrs(latest=True)
        ]
        when = f"{first[name]:.1f}s" if name in first else "never"
        print(f"  end {name:22s} circuit: {when:6s} {maddrs}")


async def probe(watch: float, extra: int) -> None:
    nodes: list[Node] = []
    with NetLab(subnet=PUBLIC) as lab:
        try:
            relays, client = await start_public(lab, extra)
            nodes += [*relays.values(), client]
            nated = await start_nated(lab, relays)
            nodes += nated.values()
            for name in ("relay", "fresh"):
                print(f"{name} {relays[name].full}")
            print(f"client {client.p2p.peer_id}; {extra} more public peers; NATed peers' p2pd flags:")
            for cfg in CONFIGS:
                print(f"  {cfg.name:22s} {' '.join(nated[cfg.name].argv[1:])}")
            await watch_addrs(nated, watch)

            print("\n== dials from the client (disconnected first)")
            reachable = []
            for cfg in CONFIGS:
                print(f"  {cfg.name}")
                relay = relays[cfg.relay]
                if await dial_tests(client.p2p, nated[cfg.name], relay.address, relay.p2p.peer_id):
                    reachable.append(cfg.name)

            await measure(client.p2p, nated, reachable, relays)
            print("\n== daemon log excerpts")
            for node in nodes:
                if hits := node.grep(*LOG_WORDS, limit=6):
                    print(f"  [{node.name}]\n" + "\n".join(f"    {line}" for line in hits))
        finally:
            for node in nodes:
                node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--watch", type=float, default=75.0, help="seconds to watch the NATed peers' addresses")
    parser.add_argument("--extra", type=int, default=3, help="plain public DHT peers besides the two relays")
    parser.add_argument("--subnet", default=PUBLIC, help="public /24 (10.231.0: relays on RFC 1918 addresses)")
    args = parser.parse_args()
    globals()["PUBLIC"] = args.subnet
    asyncio.run(probe(args.watch, args.extra))


if __name__ == "__main__":
    main()
