"""Session KV-cache affinity: follow-up requests resume the caches their conversation left on the servers.

Three layers, cheapest first:

- the store (``gateway/sessions.py``): prefix lookup, claiming, expiry — the same tests against
  ``InMemoryAffinityStore`` and ``RedisAffinityStore`` on a real ``redis-server`` started here;
- the engine over ``ResumableLocal`` (an in-process model whose detached sessions are kept in a dict, as the
  workers keep them): cached-token accounting, a resumed session lost mid-request, concurrent requests;
- ``slow``: a real swarm (DHT + 2 workers over a tiny Llama), ``SwarmBackend`` behind real uvicorn, the
  OpenAI SDK, Redis shared by two gateway replicas, Redis killed and restarted, a server that expires the
  session. "Only the new tokens were sent" is read off the workers' own ``tokens_processed`` counters.

Every reused answer is compared with the same request served without reuse (a gateway with affinity off):
identical text. Redis: ``redis-server`` from PATH on a free port; else ``REDIS_URL``; else those tests skip.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from gateway.backend import SessionSnapshot
from gateway.local_backend import LocalBackend, LocalSession
from gateway.sessions import (
    AffinityStore,
    InMemoryAffinityStore,
    RedisAffinityStore,
    common_prefix,
    prefix_hashes,
    worth_taking,
)
from swarm_client.errors import SessionLost, SessionNotFoundError
from tests.gateway_fixtures import Gateway, start_gateway

MAX_TOKENS = 12
QUESTIONS = [
    "Tell me about the swarm.",
    "Which server holds the first blocks?",
    "And what happens when one of them leaves?",
    "How long are caches kept?",
    "Can another gateway continue this chat?",
    "Thanks, summarize it please.",
]


# ------------------------------------------------------------------------------------------------- redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway ``redis-server`` (no persistence) that tests can kill and restart on the same port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> RedisServer:
        import redis

        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]  # nothing survives a kill: a restart starts empty
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if shutil.which("redis-server"):
        server = RedisServer().start()
        try:
            yield server.url
        finally:
            server.kill()
    elif os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
    else:
        pytest.skip("no redis-server on PATH and no REDIS_URL")


# ------------------------------------------------------------------------------------------ store: units


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
    store = RedisAffinityStore(f"redis://127.0.0.1:{_free_port()}/0", namespace="down", retry_interval_s=0.2)
    tokens = list(range(40))
    with caplog.at_level(logging.WARNING, logger="gateway.sessions"):
        for _ in range(5):
            assert await store.claim(tokens) is None
            assert await store.claim(tokens, "key") is None
            assert not store.available
        await asyncio.sleep(0.3)
        assert await store.claim(tokens) is None  # retried after the interval, still down: no new log line
    await store.aclose()
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1


# -------------------------------------------------------------------------------- engine over a local model


class _KeptSession:
    """A ``LocalSession`` that can be detached (kept in the backend's dict) and resumed."""

    def __init__(self, owner: ResumableLocal, local: LocalSession, resumed: bool):
        self.owner = owner
        self.local = local
        self.resumed = resumed
        self.steps = 0

    @property
    def position(self) -> int:
        return self.local.position

    @property
    def token_ids(self) -> list[int]:
        return self.local.token_ids

    def step(self, token_ids: list[int]) -> torch.Tensor:
        self.steps += 1
        if self.resumed and self.owner.lose_resumed_at_step == self.steps:
            self.owner.losses += 1
            raise SessionLost("injected: a server of the resumed session is gone")
        if self.resumed and self.owner.hold_resumed is not None:
            self.owner.hold_resumed.wait(60)
        with self.owner.lock:
            self.owner.tokens_processed += len(token_ids)
        return self.local.step(token_ids)

    def rollback(self, position: int) -> None:
        self.local.rollback(position)

    def detach(self) -> SessionSnapshot:
        sid = uuid.uuid4().hex
        with self.owner.lock:
            self.owner.kept[sid] = self.local
        return SessionSnapshot({"sid": sid}, list(self.local.token_ids))

    def close(self) -> None:
        self.local.close()


class ResumableLocal:
    """``LocalBackend`` with ``supports_resume``: what a worker does with ``--session-ttl``, in a dict."""

    supports_resume = True

    def __init__(self, path: str):
        self.inner = LocalBackend(path)
        self.model_id = self.inner.model_id
        self.tokenizer = self.inner.tokenizer
        self.max_context = self.inner.max_context
        self.generation_config = self.inner.generation_config
        self.kept: dict[str, LocalSession] = {}
        self.lock = threading.Lock()
        self.tokens_processed = 0
        self.lose_resumed_at_step: int | None = None
        self.losses = 0
        #: when set, a resumed session's steps wait for this event (to hold a claimed record in use)
        self.hold_resumed: threading.Event | None = None
        self.opened = 0

    def open_session(
        self, max_length: int, session_id: str | None = None, resume: SessionSnapshot | None = None
    ) -> _KeptSession:
        with self.lock:
            self.opened += 1
        if resume is None:
            return _KeptSession(self, self.inner.open_session(max_length, session_id), resumed=False)
        with self.lock:
            local = self.kept.pop(resume.state["sid"], None)
        if local is None:
            raise SessionNotFoundError("evicted")
        assert local.token_ids[: len(resume.token_ids)] == resume.token_ids
        local.rollback(len(resume.token_ids))
        return _KeptSession(self, local, resumed=True)

    def evict_all(self) -> None:
        with self.lock:
            kept, self.kept = list(self.kept.values()), {}
        for local in kept:
            local.close()

    def swarm_state(self) -> dict:
        return self.inner.swarm_state()

    def close(self) -> None:
        self.evict_all()
        self.inner.close()


class BatchingResumableLocal(ResumableLocal):
    """The same with ``step_many`` (the swarm backend's contract: one result or exception per session), so
    the engine gathers concurrent decode steps into one call (gateway/decode_batch.py)."""

    def step_many(self, sessions, token_ids):
        results = []
        for session, ids in zip(sessions, token_ids, strict=True):
            try:
                results.append(session.step(ids))
            except Exception as e:
                results.append(e)
        return results

    @staticmethod
    def step_group(session):
        return None


@pytest.fixture(scope="module", params=[ResumableLocal, BatchingResumableLocal], ids=["per-choice", "batched"])
def local_pair(request, tiny_llama: str) -> Iterator[tuple[Gateway, Gateway]]:
    """The same backend behind a gateway with affinity (in-memory store) and one without; decode steps
    taken per choice or gathered across choices."""
    torch.set_num_threads(1)
    backend = request.param(tiny_llama)
    reuse = start_gateway(backend, replica_id="local")
    plain = start_gateway(backend, affinity=False)
    yield reuse, plain
    reuse.server.stop()
    plain.server.stop()
    backend.close()


def _chat(gw: Gateway, messages: list[dict], **kw: Any) -> tuple[str, Any]:
    r = gw.client().chat.completions.create(
        model=gw.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kw
    )
    return r.choices[0].message.content or "", r.usage


def _conversation(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"[{tag}] You answer questions about swarms."}]


def test_local_follow_up_turns_reuse_the_cache(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    backend: ResumableLocal = reuse.backend
    messages = _conversation("local-chat")
    previous_prompt = 0
    for turn, question in enumerate(QUESTIONS[:4]):
        messages.append({"role": "user", "content": question})
        before = backend.tokens_processed
        text, usage = _chat(reuse, messages)
        sent = backend.tokens_processed - before
        cached = usage.prompt_tokens_details.cached_tokens
        assert sent == usage.prompt_tokens - cached + usage.completion_tokens - 1
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= previous_prompt, (turn, cached, previous_prompt)
        assert text == _chat(plain, messages)[0]
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": text})


def test_local_streaming_usage_reports_cached_tokens(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, _ = local_pair
    messages = _conversation("local-stream") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = _chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    stream = reuse.client().chat.completions.create(
        model=reuse.model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    assert text == _chat(local_pair[1], messages)[0]


def test_local_resumed_session_lost_mid_request_restarts_transparently(
    local_pair: tuple[Gateway, Gateway],
) -> None:
    reuse, plain = local_pair
    backend: ResumableLocal = reuse.backend
    messages = _conversation("local-lost") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = _chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    backend.lose_resumed_at_step = 2  # the prefill succeeds, then the servers lose the session
    try:
        text, usage = _chat(reuse, messages)
    finally:
        backend.lose_resumed_at_step = None
    assert backend.losses == 1, "the session was not lost mid-request: the test proves nothing"
    decoder = reuse.server.app.state.engine.decoder
    assert (decoder is not None and decoder.items > 0) == isinstance(backend, BatchingResumableLocal)
    assert usage.completion_tokens > 1
    assert text == _chat(plain, messages)[0]
    assert usage.prompt_tokens_details.cached_tokens == 0  # rebuilt from scratch: nothing was reused
    # the rebuilt session was written back: the next turn reuses it
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[2]}]
    assert _chat(reuse, messages)[1].prompt_tokens_details.cached_tokens > 0


def test_local_evicted_cache_falls_back_to_a_full_prefill(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    messages = _conversation("local-evicted") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = _chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    reuse.backend.evict_all()
    text, usage = _chat(reuse, messages)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert text == _chat(plain, messages)[0]


def test_local_concurrent_turns_fork_instead_of_sharing(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    messages = _conversation("local-concurrent") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = _chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    expected = _chat(plain, messages)[0]
    backend: ResumableLocal = reuse.backend
    results: list[tuple[str, Any]] = []
    threads = [threading.Thread(target=lambda: results.append(_chat(reuse, messages))) for _ in range(3)]
    # whoever claims the record holds its session until the other two have opened theirs, so all three
    # really are concurrent (otherwise a turn that starts after the claimant finished may reuse legitimately)
    backend.hold_resumed, opened_before = threading.Event(), backend.opened
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while backend.opened < opened_before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        backend.hold_resumed.set()
        backend.hold_resumed = None
    for t in threads:
        t.join(60)
    assert [text for text, _ in results] == [expected] * 3
    assert sum(u.prompt_tokens_details.cached_tokens > 0 for _, u in results) == 1


def test_local_n_choices_only_choice_0_reuses(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    messages = _conversation("local-n") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = _chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    kw = dict(model=reuse.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, n=2)
    r = reuse.client().chat.completions.create(**kw)
    ref = plain.client().chat.completions.create(**kw)
    assert [c.message.content for c in r.choices] == [c.message.content for c in ref.choices]
    assert 0 < r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_local_sessions_too_short_to_find_are_not_kept(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, _ = local_pair
    backend: ResumableLocal = reuse.backend
    client = reuse.client()
    before = len(backend.kept)
    client.completions.create(model=reuse.model, prompt="Hi", max_tokens=3, temperature=0)
    assert len(backend.kept) == before  # under one 16-token block: no prompt could ever find it
    client.completions.create(model=reuse.model, prompt="Hi", max_tokens=3, temperature=0, user="short")
    assert len(backend.kept) == before + 1  # a keyed session is found by its key


# --------------------------------------------------------------------------------------- the real swarm

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
    from tests.swarm_fixtures import Swarm

    s = Swarm(tiny_llama)
    try:
        fast = ("--throughput", "1000")  # skips the startup benchmark; deterministic routing
        procs = [s.add_worker(*fast, blocks=span, wait=False) for span in SPANS]
        procs.append(
            s.add_worker(*fast, "--dht-prefix", EVICT_PREFIX, "--session-ttl", "1", blocks="0:4", wait=False)
        )
        for proc in procs:  # started together: their startups overlap
            line = proc.wait_for("swarmserve worker ready:")
            proc.peer_id = line.split(" as peer ", 1)[1].split(";", 1)[0]
        yield AffinitySwarm(s, procs[:2], procs[2])
    finally:
        s.close()


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    """A Redis these tests may kill and restart (the kill test needs to own the process)."""
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not on PATH: cannot kill and restart Redis")
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def replicas(affinity_swarm: Any, tiny_llama: str, own_redis: RedisServer) -> Iterator[dict[str, Gateway]]:
    """Two gateway replicas (own uvicorn, own ``SwarmBackend``) on one Redis; a reference without reuse.
    Their clients deal sessions into pipeline groups as the CLI does ("auto"), resumed sessions included."""
    from gateway.swarm_backend import SwarmBackend

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
def test_six_turn_chat_sends_only_new_tokens(
    replicas: dict[str, Gateway], affinity_swarm: AffinitySwarm
) -> None:
    gw, ref = replicas["a"], replicas["ref"]
    messages = _conversation("swarm-chat")
    previous_prompt = 0
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        before = _tokens_processed(gw, affinity_swarm)
        text, usage = _chat(gw, messages)
        after = _tokens_processed(gw, affinity_swarm)
        cached = usage.prompt_tokens_details.cached_tokens
        new_tokens = usage.prompt_tokens - cached + usage.completion_tokens - 1
        # every worker holds a span of every token: each processed exactly the tokens that were sent
        assert [a - b for a, b in zip(after, before, strict=True)] == [new_tokens] * len(SPANS), (turn, usage)
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= previous_prompt, (turn, cached, previous_prompt)
        assert text == _chat(ref, messages)[0], f"turn {turn + 1} differs from the answer without reuse"
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": text})
    groups = set(gw.server.app.state.engine.decoder._groups)
    assert groups and None not in groups  # fresh and resumed sessions alike were dealt into pipeline groups


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replicas_on_one_redis_continue_each_others_sessions(replicas: dict[str, Gateway]) -> None:
    messages = _conversation("swarm-replicas")
    for turn, question in enumerate(QUESTIONS[:4]):
        gw = replicas["ab"[turn % 2]]
        messages.append({"role": "user", "content": question})
        text, usage = _chat(gw, messages, user="conversation-r")
        if turn:
            assert usage.prompt_tokens_details.cached_tokens > 0, f"replica {gw.server.url} did not reuse"
        assert text == _chat(replicas["ref"], messages)[0]
        messages.append({"role": "assistant", "content": text})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_redis_outage_degrades_to_no_reuse_and_recovers(
    replicas: dict[str, Gateway], own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gw, ref = replicas["a"], replicas["ref"]
    messages = _conversation("swarm-redis-outage")
    headers = {"X-Session-Id": "outage-" + uuid.uuid4().hex}

    def turn(question: str) -> int:
        messages.append({"role": "user", "content": question})
        text, usage = _chat(gw, messages, extra_headers=headers)
        assert text == _chat(ref, messages)[0]
        messages.append({"role": "assistant", "content": text})
        return usage.prompt_tokens_details.cached_tokens

    assert turn(QUESTIONS[0]) == 0
    assert turn(QUESTIONS[1]) > 0
    own_redis.kill()
    with caplog.at_level(logging.WARNING, logger="gateway.sessions"):
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
    from gateway.swarm_backend import SwarmBackend

    worker = affinity_swarm.evicting
    peers = [affinity_swarm.swarm.initial_peers]
    backend = SwarmBackend(tiny_llama, peers, dht_prefix=EVICT_PREFIX, update_period=1.0)
    gw, ref = start_gateway(backend, replica_id="evict"), start_gateway(backend, affinity=False)
    try:
        messages = _conversation("swarm-evict") + [{"role": "user", "content": QUESTIONS[0]}]
        first, _ = _chat(gw, messages)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
        deadline = time.monotonic() + 30
        while backend.server_info(worker.peer_id)["sessions_detached"] and time.monotonic() < deadline:
            time.sleep(0.2)  # the worker expires detached sessions older than its TTL
        assert backend.server_info(worker.peer_id)["sessions_detached"] == 0
        text, usage = _chat(gw, messages)
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert text == _chat(ref, messages)[0]
    finally:
        gw.server.stop()
        ref.server.stop()
        backend.close()
