"""The capacity line's reservations shared by gateway replicas through Redis (issue 39): a replica admits a
big request only while every replica's reservations leave room, a released reservation lets the other
replica's waiting request in, a dead replica's share expires, and a Redis that fails costs no request.

The unit part runs two ``CapacityQueue``s on one real redis-server (the module's own); the swarm part runs two
real uvicorn gateways on one real worker with a small cache and the same Redis, the official ``openai`` SDK as
the client: the big request on one replica, the small one on the other — which must wait its turn, as it
would on one gateway (``tests/test_admission.py``), instead of taking the cache from under the big one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from gateway.decode.capacity_queue import NEED, CapacityQueue, Need
from gateway.decode.shared_reservations import RedisReservations
from swarm_client.errors import SwarmBusyError
from tests.conftest import RedisServer, free_port
from tests.gateway_fixtures import chat_prompt_ids, eos_bias, greedy_without_eos, swarm_gateway, tiny_tokenizer
from tests.swarm_fixtures import swarm
from tests.test_admission import BIG_TOKENS, CACHE_TOKENS, start_big_request

CAPACITY = 1000


@dataclass
class Handle:
    """What the line holds a reservation by: a session handle, closed when its session ends."""

    closed: bool = False


def _queue(url: str, replica: str, *, timeout_s: float = 5.0, ttl_s: float = 10.0) -> CapacityQueue:
    return CapacityQueue(timeout_s, RedisReservations(url, "test-ns", replica, ttl_s=ttl_s))


async def _admit(queue: CapacityQueue, tokens: int) -> list[Handle]:
    """One request of ``tokens`` slots against a swarm of ``CAPACITY``; the swarm itself always has room."""
    NEED.set(Need(tokens, lambda: CAPACITY))

    async def attempt() -> list[Handle]:
        return [Handle()]

    return await queue.admit(attempt)


def _keys(url: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return client.keys("swarmserve:reservations:*")
    finally:
        client.close()


def test_a_big_reservation_on_one_replica_holds_back_the_other(own_redis: RedisServer) -> None:
    async def scenario() -> dict[str, Any]:
        a, b = _queue(own_redis.url, "replica-a"), _queue(own_redis.url, "replica-b")
        big = await _admit(a, 700)
        small = asyncio.create_task(_admit(b, 500))  # 700 + 500 > 1000: waits in b's line
        await asyncio.sleep(1.2)
        waited = not small.done()
        assert b.others_reserved_tokens == 700
        t0 = asyncio.get_running_loop().time()
        big[0].closed = True  # the big request's sessions ended
        a.released()
        held = await asyncio.wait_for(small, 5)
        let_in_s = asyncio.get_running_loop().time() - t0
        seen_by_a = 0
        for _ in range(20):  # a reads b's reservation at its next check
            await a._sync(force=True)
            seen_by_a = a.others_reserved_tokens
            if seen_by_a == 500:
                break
            await asyncio.sleep(0.1)
        held[0].closed = True
        b.released()
        await asyncio.sleep(0.3)
        await a.aclose()
        await b.aclose()
        return {"waited": waited, "let_in_s": let_in_s, "seen_by_a": seen_by_a}

    result = asyncio.run(scenario())
    print(result)
    assert result["waited"], "the small request did not wait for the other replica's big one"
    assert result["let_in_s"] < 2.0  # the release is published at once; b's line polls every 0.5 s
    assert result["seen_by_a"] == 500
    assert _keys(own_redis.url) == []  # nothing is left once no replica holds anything


def test_the_busy_answer_counts_the_other_replicas_and_a_dead_replicas_share_expires(
    own_redis: RedisServer,
) -> None:
    async def scenario() -> tuple[str, float]:
        a = _queue(own_redis.url, "replica-a", ttl_s=1.5)
        b = _queue(own_redis.url, "replica-b", timeout_s=0.6)
        await _admit(a, 700)
        with pytest.raises(SwarmBusyError) as busy:
            await _admit(b, 500)
        # replica a dies: nobody renews its entry, nobody takes it off
        assert a._heartbeat is not None
        a._heartbeat.cancel()
        b.timeout_s = 10.0
        t0 = asyncio.get_running_loop().time()
        await _admit(b, 500)
        return str(busy.value), asyncio.get_running_loop().time() - t0

    message, waited = asyncio.run(scenario())
    print(message, f"waited {waited:.2f} s")
    assert "needs 500" in message
    assert "reserve 700 (700 of them on other gateway replicas) of the swarm's 1000" in message
    assert 0.3 < waited < 4.0  # the dead replica's 1.5 s entry ran out (it was renewed up to its death)


def test_a_redis_that_fails_costs_no_request() -> None:
    async def scenario() -> int:
        queue = _queue(f"redis://127.0.0.1:{free_port()}/0", "replica-a", timeout_s=0.5)
        first = await _admit(queue, 900)
        first[0].closed = True
        queue.released()
        second = await _admit(queue, 900)  # its own count still applies
        await queue.aclose()
        return len(second)

    assert asyncio.run(scenario()) == 1


# --------------------------------------------------------------------------------------- two real replicas


@pytest.mark.slow
def test_a_big_request_on_one_replica_is_not_starved_by_the_other(tiny_llama: str, own_redis: RedisServer) -> None:
    """4 × (prompt + 220) ≈ 940 of the worker's 1024 slots on replica a; then a 300-token request on replica b.
    Without shared reservations b's request starts at once and the big one's caches run out mid-generation."""
    settings: dict[str, Any] = {"affinity": False, "busy_queue_timeout_s": 120, "redis_url": own_redis.url}
    with (
        swarm(tiny_llama, ["0:4"], "--cache-tokens", str(CACHE_TOKENS)) as s,
        swarm_gateway(tiny_llama, s.initial_peers, **settings, replica_id="gw-a") as a,
        swarm_gateway(tiny_llama, s.initial_peers, **settings, replica_id="gw-b") as b,
    ):
        thread, big = start_big_request(a.client(max_retries=0, timeout=120), a.model)
        deadline = time.monotonic() + 30
        while a.server.app.state.engine.capacity.reserved_tokens == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the big request holds its reservation
        released: dict[str, float] = {}

        def watch_release() -> None:  # when replica a's reservation ended (its sessions closed)
            while thread.is_alive() and a.server.app.state.engine.capacity.reserved_tokens:
                time.sleep(0.02)
            released["at"] = time.monotonic()

        watcher = threading.Thread(target=watch_release)
        watcher.start()
        small_messages = [{"role": "user", "content": "small"}]
        t0 = time.monotonic()
        stream = b.client(max_retries=0, timeout=120).chat.completions.create(
            model=b.model, messages=small_messages, max_tokens=300, temperature=0, logit_bias=eos_bias(), stream=True
        )
        first_at, parts = None, []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first_at = first_at or time.monotonic()
                parts.append(chunk.choices[0].delta.content)
        thread.join(180)
        watcher.join(10)
        assert first_at is not None
        print(
            f"big n=4 x {BIG_TOKENS} on gw-a: {big.get('took', 0):.2f} s; small on gw-b: first token after "
            f"{first_at - t0:.2f} s, {first_at - released['at']:+.2f} s from gw-a's release"
        )
        assert "error" not in big, big.get("error")
        assert [c.finish_reason for c in big["reply"].choices] == ["length"] * 4
        expected, _ = greedy_without_eos(chat_prompt_ids(small_messages, tiny_llama), 300, tiny_llama)
        assert "".join(parts) == tiny_tokenizer().decode(expected, skip_special_tokens=True)
        assert first_at >= released["at"]  # 940 + 311 > 1024: it could only start after the big one
        assert not a.backend.manager.bans.banned() and not b.backend.manager.bans.banned()
