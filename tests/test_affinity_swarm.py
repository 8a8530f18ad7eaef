"""Session KV-cache affinity over a real swarm (``slow``): DHT + 2 workers over a tiny Llama,
``SwarmBackend`` behind real uvicorn, the OpenAI SDK, Redis shared by two gateway replicas, Redis killed and
restarted (the ``own_redis`` fixture of tests/conftest.py), a server that expires the session. "Only the new
tokens were sent" is read off the workers' own ``tokens_processed`` counters.

Every reused answer is compared with the same request served without reuse (a gateway with affinity off):
identical text.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import RedisServer
from tests.gateway_fixtures import QUESTIONS, Gateway, chat, conversation, start_gateway

SPANS = ["0:2", "2:4"]
#: the expiry test's own swarm: one worker under another DHT prefix (same DHT) that keeps sessions 1 s only
EVICT_PREFIX = "tiny-evict"


@dataclass
class AffinitySwarm:
    swarm: Any
    workers: list[Any]  # blocks 0:2 and 2:4, default session TTL
    evicting: Any  # blocks 0:4 under EVICT_PREFIX, --session-ttl 1


@pytest.fixture(scope="module")
def affinity_swarm(tiny_llama: str) -> Iterator[AffinitySwarm]:
    from swarmserve.processes import wait_ready
    from tests.swarm_fixtures import Swarm

    s = Swarm(tiny_llama)
    try:
        fast = ("--throughput", "1000")  # skips the startup benchmark; deterministic routing
        procs = [s.add_worker(*fast, blocks=span, wait=False) for span in SPANS]
        procs.append(s.add_worker(*fast, "--dht-prefix", EVICT_PREFIX, "--session-ttl", "1", blocks="0:4", wait=False))
        wait_ready(procs, timeout=120)  # started together: their startups overlap; each reads its peer id
        yield AffinitySwarm(s, procs[:2], procs[2])
    finally:
        s.close()


@pytest.fixture(scope="module")
def replicas(affinity_swarm: Any, tiny_llama: str, own_redis: RedisServer) -> Iterator[dict[str, Gateway]]:
    """Two gateway replicas (own uvicorn, own ``SwarmBackend``) on one Redis; a reference without reuse.
    Their clients deal sessions into pipeline groups as the CLI does ("auto"), resumed sessions included."""
    from gateway.backends.swarm import SwarmBackend

    peers = [affinity_swarm.swarm.initial_peers]
    backends = [SwarmBackend(tiny_llama, peers, update_period=1.0, pipeline_groups="auto") for _ in range(2)]
    gws = {
        "a": start_gateway(backends[0], redis_url=own_redis.url, replica_id="replica-a"),
        "b": start_gateway(backends[1], redis_url=own_redis.url, replica_id="replica-b"),
        "ref": start_gateway(backends[0], affinity=False),
    }
    yield gws
    for gw in gws.values():
        gw.server.stop()
    for backend in backends:
        backend.close()


def _tokens_processed(gw: Gateway, swarm: AffinitySwarm) -> list[int]:
    return [gw.backend.server_info(w.peer_id)["tokens_processed"] for w in swarm.workers]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_six_turn_chat_sends_only_new_tokens(replicas: dict[str, Gateway], affinity_swarm: AffinitySwarm) -> None:
    gw, ref = replicas["a"], replicas["ref"]
    messages = conversation("swarm-chat")
    previous_prompt = 0
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        before = _tokens_processed(gw, affinity_swarm)
        text, usage = chat(gw, messages)
        after = _tokens_processed(gw, affinity_swarm)
        cached = usage.prompt_tokens_details.cached_tokens
        details = usage.completion_tokens_details  # speculative decoding: rejected guesses were sent too
        rejected = details.rejected_prediction_tokens if details is not None else 0
        new_tokens = usage.prompt_tokens - cached + usage.completion_tokens - 1 + rejected
        # every worker holds a span of every token: each processed exactly the tokens that were sent
        assert [a - b for a, b in zip(after, before, strict=True)] == [new_tokens] * len(SPANS), (turn, usage)
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= previous_prompt, (turn, cached, previous_prompt)
        assert text == chat(ref, messages)[0], f"turn {turn + 1} differs from the answer without reuse"
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": text})
    groups = set(gw.server.app.state.engine.decoder._groups)
    assert groups and None not in groups  # fresh and resumed sessions alike were dealt into pipeline groups


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replicas_on_one_redis_continue_each_others_sessions(replicas: dict[str, Gateway]) -> None:
    messages = conversation("swarm-replicas")
    for turn, question in enumerate(QUESTIONS[:4]):
        gw = replicas["ab"[turn % 2]]
        messages.append({"role": "user", "content": question})
        text, usage = chat(gw, messages, user="conversation-r")
        if turn:
            assert usage.prompt_tokens_details.cached_tokens > 0, f"replica {gw.server.url} did not reuse"
        assert text == chat(replicas["ref"], messages)[0]
        messages.append({"role": "assistant", "content": text})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_redis_outage_degrades_to_no_reuse_and_recovers(
    replicas: dict[str, Gateway], own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gw, ref = replicas["a"], replicas["ref"]
    messages = conversation("swarm-redis-outage")
    headers = {"X-Session-Id": "outage-" + uuid.uuid4().hex}

    def turn(question: str) -> int:
        messages.append({"role": "user", "content": question})
        text, usage = chat(gw, messages, extra_headers=headers)
        assert text == chat(ref, messages)[0]
        messages.append({"role": "assistant", "content": text})
        return usage.prompt_tokens_details.cached_tokens

    assert turn(QUESTIONS[0]) == 0
    assert turn(QUESTIONS[1]) > 0
    own_redis.kill()
    with caplog.at_level(logging.WARNING, logger="gateway.affinity.sessions"):
        assert turn(QUESTIONS[2]) == 0
        assert turn(QUESTIONS[3]) == 0
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1  # logged once, not per request
    own_redis.start()
    time.sleep(1.5)  # the store skips Redis for retry_interval_s (1 s) after a failure
    assert turn(QUESTIONS[4]) == 0  # the restarted Redis is empty
    assert turn(QUESTIONS[5]) > 0  # reuse resumes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_expired_server_cache_is_re_prefilled(affinity_swarm: AffinitySwarm, tiny_llama: str) -> None:
    """The worker of its own swarm (own DHT prefix on the same DHT) keeps finished sessions for 1 s only."""
    from gateway.backends.swarm import SwarmBackend

    worker = affinity_swarm.evicting
    peers = [affinity_swarm.swarm.initial_peers]
    backend = SwarmBackend(tiny_llama, peers, dht_prefix=EVICT_PREFIX, update_period=1.0)
    gw, ref = start_gateway(backend, replica_id="evict"), start_gateway(backend, affinity=False)
    try:
        messages = conversation("swarm-evict") + [{"role": "user", "content": QUESTIONS[0]}]
        first, _ = chat(gw, messages)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
        deadline = time.monotonic() + 30
        while backend.server_info(worker.peer_id)["sessions_detached"] and time.monotonic() < deadline:
            time.sleep(0.2)  # the worker expires detached sessions older than its TTL
        assert backend.server_info(worker.peer_id)["sessions_detached"] == 0
        text, usage = chat(gw, messages)
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert text == chat(ref, messages)[0]
    finally:
        gw.server.stop()
        ref.server.stop()
        backend.close()
