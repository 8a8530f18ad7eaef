"""Session KV-cache affinity, the store (``gateway/affinity/sessions.py``): prefix lookup, claiming, expiry — the
same tests against ``InMemoryAffinityStore`` and ``RedisAffinityStore`` on a real Redis (the ``redis_url``
fixture of tests/conftest.py: ``REDIS_URL``, else ``redis-server`` from PATH; else those cases skip, or fail
under ``SWARMSERVE_REQUIRE=redis``).

The engine over a local model is in test_affinity_engine.py, the real swarm in test_affinity_swarm.py.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest

from gateway.affinity.sessions import (
    AffinityStore,
    InMemoryAffinityStore,
    RedisAffinityStore,
    common_prefix,
    prefix_hashes,
    worth_taking,
)
from tests.conftest import free_port


def test_prefix_hashes_chain_and_common_prefix() -> None:
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    ha, hb = prefix_hashes(a, 16), prefix_hashes(b, 16)
    assert len(ha) == 2 and len(prefix_hashes(a[:15], 16)) == 0
    assert ha == hb  # 40 tokens: blocks [0,16) and [16,32), shared
    assert prefix_hashes(a + [1] * 8, 16)[2] != prefix_hashes(b + [1] * 8, 16)[2]
    assert prefix_hashes(a, 16, b"model-a") != prefix_hashes(a, 16, b"model-b")
    assert common_prefix(a, b) == 32 and common_prefix([], a) == 0
    assert worth_taking(60, 100, 16) and not worth_taking(40, 100, 16) and not worth_taking(10, 12, 16)


@pytest.fixture(params=["memory", "redis"])
async def store_factory(request: pytest.FixtureRequest) -> Any:
    made: list[AffinityStore] = []

    def make(**kw: Any) -> AffinityStore:
        kw.setdefault("namespace", f"test-{uuid.uuid4().hex}")
        kw.setdefault("block_tokens", 16)
        if request.param == "memory":
            store: AffinityStore = InMemoryAffinityStore(**kw)
        else:
            store = RedisAffinityStore(request.getfixturevalue("redis_url"), **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def _save(store: AffinityStore, tokens: list[int], key: str | None = None) -> str:
    claim = await store.claim(tokens, key)
    assert claim is not None
    assert await store.save(claim, {"peer": "p", "tokens": len(tokens)}, tokens, "replica-test")
    return claim.rid


async def test_store_finds_the_longest_cached_prefix(store_factory: Any) -> None:
    store = store_factory()
    shared = list(range(100, 132))  # 32 tokens, e.g. a system prompt
    a = shared + list(range(1000, 1048))  # 80 tokens
    b = shared + list(range(2000, 2048))
    rid_a = await _save(store, a)
    rid_b = await _save(store, b)  # shares 32 of a's 80 tokens: not worth destroying 48 → its own record
    assert rid_a != rid_b
    claim = await store.claim(a + [7, 8, 9])
    assert claim is not None and claim.rid == rid_a and claim.record is not None
    assert claim.common == 80 and claim.record.token_ids == a and claim.record.replica == "replica-test"
    assert claim.record.state == {"peer": "p", "tokens": 80}
    # taken: a concurrent request with the same prompt finds nothing to resume (it forks a fresh session)
    again = await store.claim(a + [7, 8, 9])
    assert again is not None and again.record is None and again.rid not in (rid_a, rid_b)
    # written back with more tokens: found again, and the next turn reuses all of it
    assert await store.save(claim, {"peer": "p"}, a + [7, 8, 9, 10], "replica-test")
    claim = await store.claim(a + [7, 8, 9, 10, 11, 12])
    assert claim is not None and claim.rid == rid_a and claim.common == 84
    # the other branch is still there, found through its own deeper blocks
    claim = await store.claim(b + [5])
    assert claim is not None and claim.rid == rid_b and claim.common == 80


async def test_store_rejects_stale_and_unprofitable_matches(store_factory: Any) -> None:
    store = store_factory()
    first = list(range(200, 264))
    rid = await _save(store, first)
    claim = await store.claim(first)
    assert claim is not None and claim.rid == rid
    # the same record rewritten with tokens that diverge after 16: its deep index entries are now stale
    moved = first[:16] + [1] * 48
    assert await store.save(claim, {}, moved, "r")
    miss = await store.claim(first + [5])  # deep hits point to `rid`, whose tokens no longer match enough
    assert miss is not None and miss.record is None
    # shares 20 of 64 tokens: resuming would destroy 44 cached tokens to save 20 → a fresh session instead
    miss = await store.claim(moved[:20] + [2] * 30)
    assert miss is not None and miss.record is None
    # shares 40 of 64: worth it (the rollback destroys 24)
    hit = await store.claim(moved[:40] + [2] * 30)
    assert hit is not None and hit.rid == rid and hit.common == 40


async def test_store_keyed_sessions_are_private(store_factory: Any) -> None:
    store = store_factory()
    tokens = list(range(300, 340))
    claim = await store.claim(tokens, "user-1")
    assert claim is not None and claim.keyed and claim.record is None
    assert await store.save(claim, {"k": 1}, tokens, "r")
    assert (await store.claim(tokens + [1])).record is None  # not in the prefix index
    other = await store.claim(tokens, "user-2")
    assert other is not None and other.record is None and other.rid != claim.rid
    mine = await store.claim([1, 2, 3], "user-1")  # the key decides, even when little is shared
    assert mine is not None and mine.rid == claim.rid and mine.record is not None and mine.common == 0


async def test_store_concurrent_claims_take_a_record_once(store_factory: Any) -> None:
    store = store_factory()
    tokens = list(range(400, 448))
    await _save(store, tokens)
    claims = await asyncio.gather(*(store.claim(tokens + [i]) for i in range(6)))
    assert sum(c is not None and c.record is not None for c in claims) == 1


async def test_store_records_expire(store_factory: Any) -> None:
    store = store_factory(ttl_s=0.3)
    tokens = list(range(500, 540))
    await _save(store, tokens)
    await _save(store, tokens[:20], key="k")
    await asyncio.sleep(0.7)
    assert (await store.claim(tokens)).record is None
    assert (await store.claim(tokens, "k")).record is None


async def test_redis_store_survives_an_unreachable_redis(caplog: pytest.LogCaptureFixture) -> None:
    store = RedisAffinityStore(f"redis://127.0.0.1:{free_port()}/0", namespace="down", retry_interval_s=0.2)
    tokens = list(range(40))
    with caplog.at_level(logging.WARNING, logger="gateway.affinity.sessions"):
        for _ in range(5):
            assert await store.claim(tokens) is None
            assert await store.claim(tokens, "key") is None
            assert not store.available
        await asyncio.sleep(0.3)
        assert await store.claim(tokens) is None  # retried after the interval, still down: no new log line
    await store.aclose()
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1


async def test_store_owners_never_see_each_others_records(store_factory: Any) -> None:
    """Two API keys (owners) sending the same prompt: neither resumes nor even finds the other's record."""
    store = store_factory()
    tokens = list(range(500, 548))
    claim = await store.claim(tokens, owner="key:a")
    assert claim is not None and claim.record is None
    assert await store.save(claim, {"k": 1}, tokens, "r")
    stranger = await store.claim(tokens + [1], owner="key:b")
    assert stranger is not None and stranger.record is None and stranger.common == 0
    keyed = await store.claim(tokens, "conversation", owner="key:b")
    assert keyed is not None and keyed.record is None
    mine = await store.claim(tokens + [1], owner="key:a")
    assert mine is not None and mine.record is not None and mine.rid == claim.rid
