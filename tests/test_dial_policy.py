"""Where a reachability checker may dial, and who may have a check now (worker/dial_policy.py,
worker/check_limits.py): pure decisions, no processes. tests/test_reachability_policy.py aims real checks."""

from __future__ import annotations

import ipaddress

from hivemind.utils.multiaddr import Multiaddr

from worker.check_limits import CheckLimiter
from worker.dial_policy import choose_dial, dialable, local_networks, resolve_hosts
from worker.reachability_service import parse_caller_maddrs

ip = ipaddress.ip_address
LAN = ipaddress.ip_network("10.1.0.0/24")
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
NETS = [LAN, LOOPBACK, ipaddress.ip_network("::1/128")]
REMOTE = [ip("203.0.113.9")]  # a caller on the internet (documentation range: treat as seen elsewhere)
PUBLIC_CALLER = [ip("8.8.4.4")]


def test_a_remote_caller_cannot_aim_the_checker_at_private_or_local_addresses() -> None:
    for target in ("127.0.0.1", "127.0.0.2", "10.1.0.5", "10.99.0.1", "192.168.1.1", "169.254.169.254", "::1"):
        assert not dialable(ip(target), PUBLIC_CALLER, NETS), target
    for target in ("0.0.0.0", "224.0.0.1", "255.255.255.255", "fe80::1"):
        assert not dialable(ip(target), PUBLIC_CALLER, NETS), target


def test_public_addresses_and_the_callers_own_address_are_dialable() -> None:
    assert dialable(ip("8.8.8.8"), PUBLIC_CALLER, NETS)
    assert dialable(ip("11.231.0.7"), PUBLIC_CALLER, NETS)  # the relay lab's "public" side
    assert dialable(ip("8.8.4.4"), PUBLIC_CALLER, NETS)
    assert dialable(ip("192.168.7.7"), [ip("192.168.7.7")], NETS)  # its observed address, routed private


def test_shared_private_networks_only_with_the_caller_in_them() -> None:
    on_lan = [ip("10.1.0.9")]
    assert dialable(ip("10.1.0.5"), on_lan, NETS)  # a LAN swarm checks its members
    assert not dialable(ip("10.99.0.1"), on_lan, NETS)  # a network the checker is not on
    assert not dialable(ip("127.0.0.1"), on_lan, NETS)  # loopback: only for a caller on loopback
    assert dialable(ip("127.0.0.1"), [ip("127.0.0.1")], NETS)
    assert not dialable(ip("10.1.0.5"), [ip("127.0.0.1")], NETS)  # a local caller cannot aim at the LAN
    assert not dialable(ip("169.254.0.5"), [ip("169.254.0.9")], [ipaddress.ip_network("169.254.0.0/16")])


def test_one_address_is_chosen_the_observed_one_first() -> None:
    m = Multiaddr
    candidates = [
        (m("/ip4/127.0.0.1/tcp/1"), ip("127.0.0.1")),
        (m("/ip4/8.8.8.8/tcp/2"), ip("8.8.8.8")),
        (m("/ip4/8.8.4.4/tcp/3"), ip("8.8.4.4")),
    ]
    assert str(choose_dial(candidates, PUBLIC_CALLER, NETS)) == "/ip4/8.8.4.4/tcp/3"
    assert str(choose_dial(candidates, REMOTE, NETS)) == "/ip4/8.8.8.8/tcp/2"
    assert choose_dial(candidates[:1], REMOTE, NETS) is None
    assert str(choose_dial(candidates[:1], [ip("127.0.0.1")], NETS)) == "/ip4/127.0.0.1/tcp/1"


def test_local_networks_include_loopback() -> None:
    assert any(ip("127.0.0.1") in net for net in local_networks())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sybil_ids_on_one_host_share_its_budget() -> None:
    clock = Clock()
    limits = CheckLimiter(per_peer_interval=10, host_burst=3, host_refill=5, host_concurrent=2, clock=clock)
    admitted = []
    for i in range(20):
        if limits.admit(f"sybil{i}", "192.0.2.7") is None:
            admitted.append(i)
            limits.done(f"sybil{i}", "192.0.2.7")
    assert admitted == [0, 1, 2]
    assert limits.admit("sybil9", "192.0.2.7").startswith("rate_limited: your address")
    assert limits.admit("newcomer", "198.51.100.1") is None  # another host is not held up
    clock.now += 5  # one check's worth of refill
    assert limits.admit("sybil10", "192.0.2.7") is None
    assert limits.admit("sybil11", "192.0.2.7").startswith("rate_limited")


def test_per_peer_interval_and_concurrency() -> None:
    clock = Clock()
    limits = CheckLimiter(per_peer_interval=10, host_burst=10, host_concurrent=2, max_concurrent=3, clock=clock)
    assert limits.admit("a", "h1") is None
    assert limits.admit("a", "h1").startswith("already_checking")
    assert limits.admit("b", "h1") is None
    assert limits.admit("c", "h1").startswith("busy: 2 checks from your address")
    assert limits.admit("d", "h2") is None
    assert limits.admit("e", "h3").startswith("busy: 3 checks")
    limits.done("a", "h1")
    assert limits.admit("a", "h1").startswith("rate_limited: one check per 10 s")
    clock.now += 10
    assert limits.admit("a", "h1") is None


async def test_a_circuit_is_judged_by_its_relays_address() -> None:
    relay, me = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"
    public = parse_caller_maddrs([f"/ip4/11.231.0.1/tcp/5/p2p/{relay}/p2p-circuit"], me)
    lan = parse_caller_maddrs([f"/ip4/10.1.0.1/tcp/5/p2p/{relay}/p2p-circuit"], me)
    assert choose_dial(await resolve_hosts(public, dns=False), PUBLIC_CALLER, NETS) is not None
    assert choose_dial(await resolve_hosts(lan, dns=False), [ip("10.1.0.100")], NETS) is not None
    assert choose_dial(await resolve_hosts(lan, dns=False), PUBLIC_CALLER, NETS) is None


async def test_dns_names_are_judged_by_the_address_they_resolve_to() -> None:
    (resolved,) = await resolve_hosts([Multiaddr("/dns4/localhost/tcp/7")])
    assert str(resolved[0]) == "/ip4/127.0.0.1/tcp/7"
    assert choose_dial([resolved], PUBLIC_CALLER, NETS) is None
    assert await resolve_hosts([Multiaddr("/dns4/localhost/tcp/7")], dns=False) == []
