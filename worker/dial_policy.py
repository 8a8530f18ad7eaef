"""Where a reachability checker may dial on a stranger's behalf: pure decisions, plus the two lookups they need.

``rpc_check_reachability`` is unauthenticated, so without a policy it is a port scanner aimed wherever the
caller likes (the checker's loopback, its LAN, link-local services). The checker therefore dials only:

- public (globally routable) addresses;
- the caller's own observed address: the IP its libp2p connection came from (``observed_ips``);
- private addresses of a network the checker itself is on (an interface address there, ``local_networks``)
  *and* the caller is observed in — a LAN swarm checks its members, a remote caller cannot aim the checker at
  its LAN. Loopback is such a network: dialable only for a caller observed on loopback (a process on the
  checker's own machine, which could dial those ports itself).

Never: link-local, multicast, unspecified or reserved addresses (except as the caller's observed address), and
DNS names until resolved (``resolve_hosts``) — the rule applies to the address actually dialed. Circuit checks
apply it to the relay's address. ``choose_dial`` picks ONE address per check, so one check is at most one dial.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Sequence

import psutil
from hivemind.utils.multiaddr import Multiaddr

__all__ = ["IPAddress", "IPNetwork", "choose_dial", "dialable", "local_networks", "observed_ips", "resolve_hosts"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IP_PROTOCOLS = ("ip4", "ip6")
DNS_PROTOCOLS = ("dns", "dns4", "dns6")
#: one DNS name's lookup may take this long; at most this many names are looked up per check
DNS_TIMEOUT = 2.0
MAX_DNS_NAMES = 2


def host_of(maddr: Multiaddr) -> tuple[str, str]:
    """``(protocol, value)`` of a maddr's first part: ``("ip4", "1.2.3.4")``, ``("dns4", "host")``."""
    first = maddr.protocols()[0].name
    return first, maddr.value_for_protocol(first)


def ip_of(maddr: Multiaddr) -> IPAddress | None:
    """The maddr's literal IP, or None (a DNS name, or something else)."""
    name, value = host_of(maddr)
    return ipaddress.ip_address(value) if name in IP_PROTOCOLS else None


def dialable(ip: IPAddress, observed: Iterable[IPAddress], networks: Iterable[IPNetwork]) -> bool:
    """Whether a checker whose interfaces are on ``networks`` may dial ``ip`` for a caller seen at ``observed``."""
    observed = [o for o in observed if o.version == ip.version]
    if ip in observed and not (ip.is_unspecified or ip.is_multicast):
        return True
    if ip.is_global and not ip.is_multicast:
        return True
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return False
    return any(ip in net and any(o in net for o in observed) for net in networks if net.version == ip.version)


def choose_dial(
    candidates: Sequence[tuple[Multiaddr, IPAddress]],
    observed: Sequence[IPAddress],
    networks: Sequence[IPNetwork],
) -> Multiaddr | None:
    """The one address to dial, or None if the policy allows none: the caller's observed IP first (what the
    swarm saw it at), then public addresses, then shared private ones, each in the caller's order."""
    allowed = [(m, ip) for m, ip in candidates if dialable(ip, observed, networks)]
    if not allowed:
        return None
    rank = {True: 0, False: 1}
    return min(allowed, key=lambda pair: (rank[pair[1] in observed], rank[pair[1].is_global]))[0]


def local_networks() -> list[IPNetwork]:
    """The networks of this machine's interface addresses (loopback included), from their netmasks."""
    networks: list[IPNetwork] = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6) or not address.netmask:
                continue
            try:
                net = ipaddress.ip_interface(f"{address.address.split('%')[0]}/{address.netmask}").network
            except ValueError:
                continue
            if net not in networks:
                networks.append(net)
    return networks


async def observed_ips(p2p, peer) -> list[IPAddress]:
    """The IPs ``peer``'s direct connections to ``p2p`` come from, as the p2p daemon sees them (a relayed
    connection has no observed IP: the address it shows is the relay's)."""
    found: list[IPAddress] = []
    for info in await p2p._client.list_peers():  # noqa: SLF001 - hivemind exposes no public call for it
        if info.peer_id != peer:
            continue
        for addr in info.addrs:
            if "p2p-circuit" in str(addr):
                continue
            try:
                ip = ip_of(Multiaddr(str(addr)))
            except Exception:  # an address we cannot read is not an observation
                continue
            if ip is not None and ip not in found:
                found.append(ip)
    return found


async def resolve_hosts(maddrs: Sequence[Multiaddr], dns: bool = True) -> list[tuple[Multiaddr, IPAddress]]:
    """Each maddr with the IP it would be dialed at: literal IPs as they are; DNS names (the first
    ``MAX_DNS_NAMES``; none without ``dns``) looked up here and rewritten to that IP, so the policy judges what
    is dialed and the dialer cannot resolve the name elsewhere. Names not resolved in ``DNS_TIMEOUT`` are dropped."""
    out: list[tuple[Multiaddr, IPAddress]] = []
    names = 0
    loop = asyncio.get_running_loop()
    for maddr in maddrs:
        proto, host = host_of(maddr)
        if proto in IP_PROTOCOLS:
            out.append((maddr, ipaddress.ip_address(host)))
            continue
        if not dns or proto not in DNS_PROTOCOLS or names >= MAX_DNS_NAMES:
            continue
        names += 1
        family = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6}.get(proto, socket.AF_UNSPEC)
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, None, family=family), DNS_TIMEOUT)
        except Exception:  # no such name, no resolver, too slow
            continue
        for info in infos[:1]:
            ip = ipaddress.ip_address(info[4][0].split("%")[0])
            rest = str(maddr).split(f"/{proto}/{host}", 1)[1]
            out.append((Multiaddr(f"/ip{ip.version}/{ip}{rest}"), ip))
    return out
