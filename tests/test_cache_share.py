"""Per-holder shares of a worker's cache and who is evicted for whom (worker/cache_policy.py, the eviction
in worker/cache.py): pure decisions and the cache manager, no processes. tests/test_cache_squat.py runs the
audit's squat against a real worker."""

from __future__ import annotations

import ipaddress

import pytest
import torch

from swarm_client.errors import (
    CacheExhaustedError,
    ServerBusyError,
    SessionEvictedError,
    error_from_wire,
    error_to_wire,
)
from swarm_client.families import CacheLayout
from worker.cache import CacheManager
from worker.cache_policy import Holding, choose_victims, holder_of, idle_limit


def holdings(holder: str, count: int, slots: int = 64, idle: float = 10.0, prefix: str = "") -> list[Holding]:
    return [Holding(f"{prefix or holder}-{i}", holder, slots, idle + i) for i in range(count)]


def test_victims_come_from_the_holder_over_its_share_most_idle_first() -> None:
    squat = holdings("squatter", 10)  # 640 slots of 1000: over a 250 share
    other = holdings("gateway", 2)
    victims = choose_victims(squat + other, "newcomer", asking=64, needed=100, share=250, min_idle=1.0)
    assert victims == ["squatter-9", "squatter-8"]  # two sessions free 128 >= 100, the idlest first


def test_nobody_is_evicted_for_a_holder_past_its_share_or_within_shares() -> None:
    squat = holdings("squatter", 10)
    assert choose_victims(squat, "squatter", 64, 64, 250, 1.0) == []  # never for itself
    assert choose_victims(squat + holdings("big", 4), "big", 64, 64, 250, 1.0) == []  # 256 + 64 > its share
    fair = holdings("a", 3) + holdings("b", 3)  # 192 each: within a 250 share
    assert choose_victims(fair, "c", 64, 64, 250, 1.0) == []


def test_stepping_and_freshly_used_sessions_are_not_evicted() -> None:
    squat = [Holding(f"s{i}", "squatter", 64, 0.5) for i in range(8)] + [Holding("busy", "squatter", 64, 99, True)]
    assert choose_victims(squat, "newcomer", 64, 64, 250, min_idle=1.0) == []
    assert choose_victims(squat, "newcomer", 64, 64, 250, min_idle=0.1) == ["s0"]


def test_only_while_the_victims_holder_stays_over_its_share() -> None:
    squat = holdings("squatter", 5)  # 320, share 250: one session's worth is over
    assert choose_victims(squat, "newcomer", 64, 64, 250, 1.0) == ["squatter-4"]
    assert choose_victims(squat, "newcomer", 64, 192, 250, 1.0) == []  # would need to go under its share


def test_holders_are_addresses_except_on_loopback() -> None:
    ip = ipaddress.ip_address
    assert holder_of("QmA", [ip("203.0.113.4")]) == "ip:203.0.113.4"
    assert holder_of("QmA", [ip("127.0.0.1")]) == "peer:QmA"
    assert holder_of("QmA", []) == "peer:QmA"  # relayed, or not found


def test_idle_limit_is_shorter_under_pressure() -> None:
    assert idle_limit(300, 30, free=500, total=1000, pressure_free=0.1) == 300
    assert idle_limit(300, 30, free=99, total=1000, pressure_free=0.1) == 30
    assert idle_limit(10, 30, free=0, total=1000, pressure_free=0.1) == 10


def manager(tokens: int = 1024, share: float = 0.25) -> CacheManager:
    layout = CacheLayout(num_kv_heads=1, head_dim=4)
    return CacheManager(tokens, 1, layout, torch.float32, "cpu", 0.0, 1024, 4096, share, evict_idle_after=0.0)


def test_a_squatter_is_evicted_for_a_newcomer_and_told_so() -> None:
    caches = manager()
    squat = [caches.open(f"s{i}", 1, 64, owner="sq", holder="peer:sq") for i in range(16)]  # the whole cache
    assert caches.tokens_left == 0
    with pytest.raises(ServerBusyError):  # the squatter itself gets no more
        caches.open("s-more", 1, 64, owner="sq", holder="peer:sq")
    fresh = caches.open("mine", 1, 64, owner="me", holder="peer:me")
    assert fresh.capacity == 64 and caches.evictions == 1
    (victim,) = [c for c in squat if c.evicted]
    with pytest.raises(SessionEvictedError) as caught:
        caches.check_not_evicted(victim)
    assert isinstance(caught.value, CacheExhaustedError)  # a client treats it as a full server: no ban
    assert type(error_from_wire(error_to_wire(caught.value))) is SessionEvictedError
    # the evicted id, opened again by its client, is not freed by the old stream's release
    again = caches.open(victim.session_id, 1, 64, owner="me", holder="peer:me")
    caches.release(victim.session_id, keep=False, cache=victim)
    assert caches.sessions[victim.session_id] is again
    assert caches.stats()["sessions_evicted"] == 2


def test_a_locked_session_is_not_evicted_and_share_one_never_evicts() -> None:
    caches = manager(tokens=128)
    a, b = (caches.open(f"s{i}", 1, 64, owner="sq", holder="peer:sq") for i in range(2))
    a.lock._locked = True  # in a step
    b.lock._locked = True
    with pytest.raises(ServerBusyError):
        caches.open("mine", 1, 64, owner="me", holder="peer:me")
    caches = manager(tokens=128, share=1.0)
    for i in range(2):
        caches.open(f"s{i}", 1, 64, owner="sq", holder="peer:sq")
    with pytest.raises(ServerBusyError):
        caches.open("mine", 1, 64, owner="me", holder="peer:me")
