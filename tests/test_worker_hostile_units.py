"""The worker's defences against hostile peers, without processes: capabilities, resume and push checks,
one broken step in a batch, the transport's message cap, the upload budget, per-step token cap.

tests/test_hostile_peers.py runs the same attacks against real worker processes.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import P2P

from swarm_client import capabilities, protocol
from swarm_client.errors import (
    InvalidInputError,
    ServerBusyError,
    SessionAccessError,
    SessionNotFoundError,
    error_from_wire,
    error_to_wire,
)
from swarm_client.families import CacheLayout
from swarmserve.cli import worker as worker_cli
from tests.test_batching import make_sessions, runner_and_layout  # noqa: F401
from worker import message_cap, uploads
from worker.batcher import StepBatcher
from worker.cache import CacheManager
from worker.compute import StepItem
from worker.wire import HandlerLimits, WireChecks


def caches() -> CacheManager:
    return CacheManager(10_000, 1, CacheLayout(num_kv_heads=1, head_dim=4), torch.float32, "cpu", 60.0)


def test_tokens_are_hmacs_of_the_session_id_under_the_process_secret(monkeypatch) -> None:
    monkeypatch.delenv(capabilities.SECRET_ENV, raising=False)
    a, b = capabilities.resume_token("s1"), capabilities.resume_token("s2")
    assert a != b and a == capabilities.resume_token("s1") and len(a) == 64
    assert capabilities.push_token("s1") not in (a, b)  # a push token does not resume
    monkeypatch.setenv(capabilities.SECRET_ENV, "shared by every gateway replica")
    shared = capabilities.resume_token("s1")
    assert shared != a and shared == capabilities.resume_token("s1")
    digest = capabilities.token_digest(shared)
    assert capabilities.token_matches(shared, digest)
    for wrong in (a, None, 7, "", "x" * 129, shared.upper()):
        assert not capabilities.token_matches(wrong, digest)
    assert not capabilities.token_matches(shared, None)


def test_only_the_token_holder_resumes_a_detached_session() -> None:
    m = caches()
    cache = m.open("victim", 1, 16, owner="gateway-A")
    cache.resume_digest = capabilities.token_digest("secret-token")
    m.release("victim", keep=True)
    for owner, token in (("attacker", None), ("attacker", "guess"), ("gateway-A", None), ("gateway-A", "guess")):
        with pytest.raises(SessionAccessError, match="opened by another client"):
            m.resume("victim", owner, resume_token=token)
    assert not m.sessions["victim"].attached
    # another replica of the same gateway (another peer id, the same secret) may
    assert m.resume("victim", "gateway-B", resume_token="secret-token").attached
    # without a token (an old client), only the peer that opened it
    m.open("plain", 1, 16, owner="P")
    m.release("plain", keep=True)
    with pytest.raises(SessionAccessError):
        m.resume("plain", "Q")
    assert m.resume("plain", "P").attached


def test_a_refused_session_is_a_lost_one_for_recovery() -> None:
    error = error_from_wire(error_to_wire(SessionAccessError("no")))
    assert type(error) is SessionAccessError and isinstance(error, SessionNotFoundError)


def test_one_broken_step_fails_only_its_own_session(runner_and_layout) -> None:  # noqa: F811
    runner, layout, _ = runner_and_layout
    sessions = make_sessions(runner, layout, [3, 4, 5, 6], [1] * 4)
    reference = make_sessions(runner, layout, [3, 4, 5, 6], [1] * 4)
    sessions[2].kv = sessions[2].kv[:1]  # as if freed mid-step: its rows cannot run
    executor = ThreadPoolExecutor(max_workers=1)
    batcher = StepBatcher(runner, executor)
    token = torch.randn(1, 1, 64)

    async def run_all():
        return await asyncio.gather(
            *(batcher.submit(StepItem(c, token, c.position)) for c in sessions), return_exceptions=True
        )

    try:
        outs = asyncio.run(run_all())
    finally:
        executor.shutdown()
    assert batcher.max_batch_seen > 1 and batcher.isolated_failures >= 1
    assert isinstance(outs[2], Exception)
    for i in (0, 1, 3):
        expected = runner.inference_step(reference[i], token, reference[i].position)
        torch.testing.assert_close(outs[i], expected, atol=1e-4, rtol=0)
        assert sessions[i].position == reference[i].position


def test_steps_past_the_token_cap_and_bad_compressions_are_refused() -> None:
    checks = SimpleNamespace(limits=HandlerLimits(max_step_tokens=16))
    WireChecks._check_step_size(checks, torch.zeros(2, 8, 4))
    with pytest.raises(InvalidInputError, match="17 tokens .* limit of 16 per step; split"):
        WireChecks._check_step_size(checks, torch.zeros(1, 17, 4))
    with pytest.raises(InvalidInputError, match="limit of 16"):
        WireChecks._check_step_size(checks, torch.zeros(3, 6, 4))
    WireChecks._check_compression_out({"compression_out": "float16"})
    for bad in ("bogus", None, ["none"], 3):
        with pytest.raises(InvalidInputError, match="compression_out must be one of"):
            WireChecks._check_compression_out({"compression_out": bad})


def framed(length: int, body: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
    reader.feed_eof()
    return reader


def test_message_cap_refuses_on_the_header_and_bounds_concurrent_reads() -> None:
    async def scenario() -> None:
        cap = message_cap.MessageCap(max_message_bytes=1000, max_receiving_bytes=1500)
        assert await cap.receive(framed(5, b"hello")) == b"hello"
        huge = framed(2**40, b"\0" * 10)  # announces 1 TiB, sends 10 bytes: nothing beyond the header is read
        with pytest.raises(message_cap.MessageTooLargeError, match="exceeds the cap of 1000"):
            await cap.receive(huge)
        assert len(huge._buffer) == 10
        slow = asyncio.StreamReader()
        slow.feed_data((900).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 100)
        pending = asyncio.create_task(cap.receive(slow))  # 900 bytes in flight, 100 of them here
        await asyncio.sleep(0)
        assert cap.receiving == 900
        with pytest.raises(message_cap.MessageTooLargeError, match="900 in flight"):
            await cap.receive(framed(700, b"\0" * 700))
        slow.feed_data(b"\0" * 800)
        assert len(await pending) == 900 and cap.receiving == 0 and cap.refused == 2

    asyncio.run(scenario())


def test_message_cap_installs_once_and_only_raises_limits() -> None:
    original = P2P.receive_raw_data
    try:
        message_cap._cap = None
        cap = message_cap.install_message_cap(2**20, 2**22)
        assert P2P.receive_raw_data == cap.receive
        assert message_cap.install_message_cap(2**10, 2**30) is cap
        assert (cap.max_message_bytes, cap.max_receiving_bytes) == (2**20, 2**30)
    finally:
        P2P.receive_raw_data = original
        message_cap._cap = None


def test_upload_budget_is_shared_and_given_back() -> None:
    budget = uploads.UploadBudget(max_bytes=100)
    with budget.hold() as first:
        first.add(60)
        with pytest.raises(ServerBusyError) as refused, budget.hold() as second:
            second.add(30)
            second.add(30)
        assert refused.value.details == {"reason": "uploads"} and budget.held == 60
    assert budget.held == 0 and budget.refused == 1
    with budget.hold() as again:
        again.add(100)


def test_cli_defaults_match_the_modules() -> None:
    assert worker_cli.MAX_STEP_TOKENS == protocol.MAX_STEP_TOKENS
    assert worker_cli.MAX_MESSAGE_BYTES == message_cap.DEFAULT_MAX_MESSAGE_BYTES
    assert worker_cli.MAX_UPLOAD_BYTES == uploads.DEFAULT_UPLOAD_BUDGET == HandlerLimits().max_upload_bytes
    # every message our own clients send fits the cap
    assert protocol.MAX_STEP_BYTES * 4 <= message_cap.DEFAULT_MAX_MESSAGE_BYTES


def test_early_pushes_are_bounded_and_delivered_only_with_the_clients_authorization(monkeypatch) -> None:
    """A push that comes before its session opened here is held (worker/early_pushes.py): at most MAX_HELD
    steps of at most MAX_HELD_BYTES each, for HOLD_SECONDS; delivered when the session opens only if the
    client authorized that very step under the push key the session was opened with."""
    from worker import early_pushes
    from worker.push import ServerPush

    now = [1000.0]
    monkeypatch.setattr(early_pushes.time, "monotonic", lambda: now[0])
    handler = ServerPush()
    handler.early_pushes = early_pushes.EarlyPushes()
    handler.caches, handler._inboxes = caches(), {}
    handler.pushes_held = handler.pushes_refused = handler.pushes_dropped = 0
    handler.limits = HandlerLimits()
    step = torch.zeros(1, 1, 8)

    def push(session_id: str, step_id: str, auth: str | None, tensor: torch.Tensor = step, position: int = 0) -> bool:
        meta = {"session_id": session_id, "step_id": step_id, "position": position, "seq": 1}
        if auth is not None:
            meta["push_auth"] = auth
        return handler.accept_push(protocol.make_request([tensor], **meta), meta)

    def auth(step_id: str, position: int = 0) -> str:
        return capabilities.push_auth("later", step_id, position, 1)

    assert push("later", "s1", auth("s1")) and push("later", "s2", "0" * 64)  # held: nothing to check them against
    assert push("later", "s6", auth("s6"), position=3)  # authorized for position 0, pushed at 3
    assert push("later", "s7", capabilities.push_token("later"))  # the raw key is not an authorization
    assert handler.pushes_held == 4
    with pytest.raises(SessionAccessError):
        push("later", "s3", None)  # no authorization: never held
    with pytest.raises(SessionAccessError):
        push("x" * 300, "s4", auth("s4"))  # an absurd session id: not held
    big = torch.zeros(1, 1, early_pushes.MAX_HELD_BYTES // 4 + 1)
    with pytest.raises(SessionAccessError):
        push("later", "s5", auth("s5"), big)  # larger than any push a client sends
    for i in range(early_pushes.MAX_HELD):  # a flood of pushes for sessions that never open: bounded
        try:
            push(f"never-{i}", "f", "0" * 64)
        except SessionAccessError:
            break
    assert len(handler.early_pushes) == early_pushes.MAX_HELD
    with pytest.raises(SessionAccessError):
        push("another", "f", "0" * 64)

    inbox: asyncio.Queue = asyncio.Queue(8)
    handler.deliver_early("later", inbox, capabilities.push_key(capabilities.push_token("later")))
    assert inbox.qsize() == 1 and inbox.get_nowait()[1][1]["step_id"] == "s1"  # the forged ones are refused
    assert handler.pushes_refused == 3
    now[0] += early_pushes.HOLD_SECONDS + 0.1  # the flood expires
    assert handler.early_pushes.take("never-0") == [] and len(handler.early_pushes) == 0
