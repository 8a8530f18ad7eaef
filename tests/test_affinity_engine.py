"""Session KV-cache affinity, the engine over ``ResumableLocal`` (an in-process model whose detached sessions
are kept in a dict, as the workers keep them): follow-up requests resume the caches their conversation left;
cached-token accounting, a resumed session lost mid-request, concurrent requests.

Every reused answer is compared with the same request served without reuse (a gateway with affinity off):
identical text. The store is in test_affinity_store.py, the real swarm in test_affinity_swarm.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gateway.backends.base import SessionSnapshot
from gateway.backends.local import LocalBackend, LocalSession
from swarm_client.errors import SessionLost, SessionNotFoundError
from tests.gateway_fixtures import QUESTIONS, Gateway, chat, collect_stream, conversation, start_gateway

MAX_TOKENS = 12  # chat()'s default


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
        if self.owner.hold_steps is not None:
            self.owner.hold_steps.wait(60)
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
        #: when set, every session's steps wait for this event: a claimed record stays in use, and no request
        #: finishes (and leaves a record of its own to claim) before the others have opened
        self.hold_steps: threading.Event | None = None
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
        local.max_length = max(local.max_length, max_length)  # the protocol: a resumed session's cap grows
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
    the engine gathers concurrent decode steps into one call (gateway/decode/batch.py)."""

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


def test_local_follow_up_turns_reuse_the_cache(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    backend: ResumableLocal = reuse.backend
    messages = conversation("local-chat")
    previous_prompt = 0
    for turn, question in enumerate(QUESTIONS[:4]):
        messages.append({"role": "user", "content": question})
        before = backend.tokens_processed
        text, usage = chat(reuse, messages)
        sent = backend.tokens_processed - before
        cached = usage.prompt_tokens_details.cached_tokens
        assert sent == usage.prompt_tokens - cached + usage.completion_tokens - 1
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= previous_prompt, (turn, cached, previous_prompt)
        assert text == chat(plain, messages)[0]
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": text})


def test_local_streaming_usage_reports_cached_tokens(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, _ = local_pair
    messages = conversation("local-stream") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    stream = reuse.client().chat.completions.create(
        model=reuse.model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, _, usage_chunks = collect_stream(stream)
    (usage,) = [c.usage for c in usage_chunks]
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert texts == {0: chat(local_pair[1], messages)[0]}


def test_local_resumed_session_lost_mid_request_restarts_transparently(
    local_pair: tuple[Gateway, Gateway],
) -> None:
    reuse, plain = local_pair
    backend: ResumableLocal = reuse.backend
    messages = conversation("local-lost") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    backend.lose_resumed_at_step = 2  # the prefill succeeds, then the servers lose the session
    try:
        text, usage = chat(reuse, messages)
    finally:
        backend.lose_resumed_at_step = None
    assert backend.losses == 1, "the session was not lost mid-request: the test proves nothing"
    decoder = reuse.server.app.state.engine.decoder
    assert (decoder is not None and decoder.items > 0) == isinstance(backend, BatchingResumableLocal)
    assert usage.completion_tokens > 1
    assert text == chat(plain, messages)[0]
    assert usage.prompt_tokens_details.cached_tokens == 0  # rebuilt from scratch: nothing was reused
    # the rebuilt session was written back: the next turn reuses it
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[2]}]
    assert chat(reuse, messages)[1].prompt_tokens_details.cached_tokens > 0


def test_local_evicted_cache_falls_back_to_a_full_prefill(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    messages = conversation("local-evicted") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    reuse.backend.evict_all()
    text, usage = chat(reuse, messages)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert text == chat(plain, messages)[0]


def test_local_concurrent_turns_fork_instead_of_sharing(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    messages = conversation("local-concurrent") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = chat(reuse, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
    expected = chat(plain, messages)[0]
    backend: ResumableLocal = reuse.backend
    results: list[tuple[str, Any]] = []
    threads = [threading.Thread(target=lambda: results.append(chat(reuse, messages))) for _ in range(3)]
    # no session steps until all three have opened, so all three really are concurrent: otherwise a turn that
    # starts after the claimant finished, or after a fresh turn left its own record, may reuse legitimately
    backend.hold_steps, opened_before = threading.Event(), backend.opened
    try:
        for t in threads:
            t.start()
        # generous: on a loaded 2-core machine a request can take long to reach its session; releasing the
        # claimant before the last request claimed would let that one reuse legitimately (a false failure)
        deadline = time.monotonic() + 300
        while backend.opened < opened_before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        all_concurrent = backend.opened >= opened_before + 3
    finally:
        backend.hold_steps.set()
        backend.hold_steps = None
    for t in threads:
        t.join(300)
    assert all_concurrent, "the three requests never were in flight together"
    assert [text for text, _ in results] == [expected] * 3
    assert sum(u.prompt_tokens_details.cached_tokens > 0 for _, u in results) == 1


def test_local_n_choices_only_choice_0_reuses(local_pair: tuple[Gateway, Gateway]) -> None:
    reuse, plain = local_pair
    messages = conversation("local-n") + [{"role": "user", "content": QUESTIONS[0]}]
    first, _ = chat(reuse, messages)
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


def test_cached_tokens_never_cross_api_keys(tiny_llama: str) -> None:
    """The prompt cache is per API key: key B sending A's conversation neither resumes A's session nor
    learns from ``cached_tokens`` how much of it matched; A still resumes its own."""
    backend = ResumableLocal(tiny_llama)
    gw = start_gateway(backend, replica_id="keys", api_keys=["sk-alice", "sk-bob"])
    try:
        messages = conversation("two-keys") + [{"role": "user", "content": QUESTIONS[0]}]
        alice, bob = gw.client(api_key="sk-alice"), gw.client(api_key="sk-bob")
        kw: dict[str, Any] = dict(model=gw.model, max_tokens=8, temperature=0)
        first = alice.chat.completions.create(messages=messages, **kw).choices[0].message.content
        follow = messages + [{"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}]
        theirs = bob.chat.completions.create(messages=follow, **kw)
        assert theirs.usage.prompt_tokens_details.cached_tokens == 0
        again = bob.chat.completions.create(messages=follow, **kw)  # Bob's own record now exists: it counts
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        mine = alice.chat.completions.create(messages=follow, **kw)
        assert mine.usage.prompt_tokens_details.cached_tokens > 0  # Alice's turn-1 session was not taken
        assert mine.choices[0].message.content == theirs.choices[0].message.content
    finally:
        gw.server.stop()
        backend.close()
