"""A hostile peer of our own against real worker processes, while a victim generates next to it.

Two servers (blocks 0:2 and 2:4) and a victim client that pushes server to server. The attacker is another
client peer (its own DHT node, so its own peer id) that knows what a server in the victim's chain would
learn — the victim's session ids — and tries: forged and garbage pushes, a push flood, an inbox flood
(sending without reading), an oversized step, resuming the victim's detached session, a raw message
announcing a gigabyte, and concurrent uploads past the server's budget. Each is refused with a typed error
(or, for the raw message, its stream dropped unread); the victim's greedy tokens equal the local 🤗 model's,
its resumed session goes on, the workers' memory stays bounded (figures printed) and they keep serving.

The Sybil with an inflated throughput claim is tests/test_measured_throughput.py (routing's side).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import psutil
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from swarm_client import AutoDistributedModelForCausalLM, capabilities, protocol, runtime
from swarm_client.errors import (
    InvalidInputError,
    ServerBusyError,
    error_from_wire,
)
from swarm_client.sequence_manager import ClientConfig, SequenceManager
from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow

HIDDEN = 64
TENSOR_LIMIT = 2**20  # --max-tensor-bytes
UPLOAD_BUDGET = 2 * 2**20  # --max-upload-bytes
MESSAGE_CAP = 4 * 2**20  # --max-message-bytes
NEW_TOKENS = 24
INFERENCE = protocol.BlockRPC._get_handle_name(None, "rpc_inference")


@pytest.fixture(scope="module")
def chain(tiny_llama):
    flags = [
        "--max-tensor-bytes", str(TENSOR_LIMIT), "--max-upload-bytes", str(UPLOAD_BUDGET),
        "--max-message-bytes", str(MESSAGE_CAP), "--session-ttl", "120",
    ]  # fmt: skip
    with swarm(tiny_llama, ["0:2", "2:4"], *flags) as s:
        yield s


def rss(worker) -> int:
    return psutil.Process(worker.popen.pid).memory_info().rss


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def hidden_tensor(tokens: int, hidden: int = HIDDEN) -> runtime_pb2.Tensor:
    return protocol.serialize(torch.randn(1, tokens, hidden))


def request(*tensors: runtime_pb2.Tensor, **metadata) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(tensors=list(tensors), metadata=protocol.pack_metadata(metadata))


async def answers(
    stub_call, messages: list[runtime_pb2.ExpertRequest], count: int, timeout: float = 30, end: bool = False
) -> list[dict]:
    """Send ``messages`` on a stream, read ``count`` answers' metadata (fewer if the stream ends);
    ``end``: end our side once sent (else keep it open while the server answers)."""

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for message in messages:
            yield message
        if not end:
            await asyncio.sleep(timeout)

    got: list[dict] = []

    async def read() -> None:
        async for response in await stub_call(requests()):
            got.append(protocol.unpack_metadata(response.metadata))
            if len(got) >= count:
                return

    with contextlib.suppress(TimeoutError, ConnectionError):
        await asyncio.wait_for(read(), timeout)
    return got


def authorized(tensor: runtime_pb2.Tensor, session_id: str, step_id, position: int = 0, seq: int = 10**6, **extra):
    """A push carrying the client's authorization of exactly this step, as a chain member is given it."""
    auth = capabilities.push_auth(session_id, step_id, position, seq) if isinstance(step_id, str) else "0" * 64
    return request(tensor, session_id=session_id, step_id=step_id, position=position, seq=seq, push_auth=auth, **extra)


def code(answer: dict) -> str:
    return type(error_from_wire(answer["error"])).__name__ if "error" in answer else "ok"


class Victim:
    """A pushing client generating greedily one token at a time, so attacks can run between its steps."""

    def __init__(self, model, ids: torch.Tensor, max_length: int = 64, keep_on_close: bool = True):
        self.model, self.ids = model, ids
        self._context = model.inference_session(max_length=max_length, keep_on_close=keep_on_close)
        self.session = self._context.__enter__()
        self.tokens = ids
        self.logits = model(ids, session=self.session).logits

    def advance(self, steps: int = 1) -> None:
        for _ in range(steps):
            if self.tokens.shape[1] - self.ids.shape[1] >= NEW_TOKENS:
                return
            next_token = self.logits[:, -1].argmax(-1, keepdim=True)
            self.tokens = torch.cat([self.tokens, next_token], 1)
            self.logits = self.model(next_token, session=self.session).logits

    def server_sessions(self) -> dict[str, str]:
        """peer id → the victim's session id there (what the servers of its chain learn)."""
        return {hop["peer_id"]: hop["server_session_id"] for hop in self.session.export_state()["hops"]}

    def finish(self) -> dict:
        self.advance(NEW_TOKENS)
        state = self.session.export_state()
        self._context.__exit__(None, None, None)
        return state


@pytest.fixture()
def parties(chain, tiny_llama):
    model = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=[chain.initial_peers], push=True, spot_check_rate=0.0
    )
    cfg = model.manager.config
    attacker = SequenceManager(ClientConfig(initial_peers=cfg.initial_peers, dht_prefix=cfg.dht_prefix, num_blocks=4))
    try:
        yield model, attacker
    finally:
        attacker.shutdown()
        model.shutdown()


def test_hostile_peer_against_a_pushing_victim(chain, parties, local_llama) -> None:
    model, attacker = parties
    first, last = (w.peer_id for w in chain.workers)
    ids = torch.randint(0, local_llama.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    reference = local_llama.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    memory_before = {w.peer_id: rss(w) for w in chain.workers}
    victim = Victim(model, ids)
    victim.advance(2)
    sessions = victim.server_sessions()
    assert set(sessions) == {first, last}
    target = sessions[last]
    stub = runtime.run(attacker.stub(last))
    push = hidden_tensor(1)

    # 1. forged pushes: the victim's session id alone (no authorization, a made-up one, the authorization of
    # another position, the session's push key itself, which no server is ever given) steers nothing
    key = capabilities.push_token(target)
    forged = [
        request(push, session_id=target, step_id="f1", position=0, seq=10**6),
        request(push, session_id=target, step_id="f2", position=0, seq=10**6, push_auth="0" * 64),
        request(push, session_id=target, step_id="f3", position=0, seq=10**6,
                push_auth=capabilities.push_auth(target, "f3", 5, 10**6)),
        request(push, session_id=target, step_id="f4", position=0, seq=10**6, push_auth=key),
    ]  # fmt: skip
    got = runtime.run(answers(stub.rpc_push, forged, 4, end=True))
    assert [code(a) for a in got] == ["SessionAccessError"] * 4, got
    victim.advance(2)

    # 2. garbage from a server the victim asked to push (a chain member gone bad): refused or dropped
    garbage = [
        authorized(push, target, "g1", compression_out="bogus"),
        authorized(push, target, "g2" * 40),
        authorized(push, target, ["x"]),
        runtime_pb2.ExpertRequest(tensors=[push], metadata=b"\xc1\xff"),
    ]
    for _ in range(3):  # no answer at all (the connection cut under load, seen once): the refusals are stateless
        got = runtime.run(answers(stub.rpc_push, garbage, 4, end=True))
        if got:
            break
    assert [code(a) for a in got] == ["InvalidInputError"] * 4, got
    # wrong shape, authorized: taken into the inbox, dropped inside the step's handling
    wrong = [authorized(hidden_tensor(1, HIDDEN - 1), target, f"w{i}") for i in range(3)]
    got = runtime.run(answers(stub.rpc_push, wrong, 1, end=True))
    assert got == [{"accepted": 3}], got
    victim.advance(2)
    # an old authorized step pushed again (or a push that arrives after the step was redone elsewhere): its
    # seq is not newer than what the session ran, so it is dropped — run, it would roll the victim's cache
    # back to position 1 and its next step would be refused ("position … must be an int in [0, 1]")
    stale = [authorized(hidden_tensor(1), target, "old", position=0, seq=2)]
    got = runtime.run(answers(stub.rpc_push, stale, 1, end=True))
    assert got == [{"accepted": 1}], got
    assert victim.session.step_seq > 2
    victim.advance(2)

    # 3. a push flood into the victim's inbox: bounded, the excess dropped (the client's own copy follows)
    before = runtime.run(model.manager.info(last))
    flood = [authorized(hidden_tensor(1, HIDDEN - 1), target, f"p{i}") for i in range(600)]
    (summary,) = runtime.run(answers(stub.rpc_push, flood, 1, end=True))
    dropped = runtime.run(model.manager.info(last))["pushes_dropped"] - before["pushes_dropped"]
    print(f"push flood: {summary['accepted']} of 600 taken into the victim's inbox, {dropped} dropped when it was full")
    assert summary["accepted"] + dropped == 600
    victim.advance(2)

    # 4. an oversized step on the attacker's own session: a typed refusal, the stream still serves
    stub_first = runtime.run(attacker.stub(first))
    opened = {"open": {"session_id": "attacker-own", "max_length": 4096, "batch_size": 1}}
    messages = [
        request(**opened),
        request(hidden_tensor(protocol.MAX_STEP_TOKENS + 1), position=0),
        request(hidden_tensor(8), position=0),
        request(close={"keep": False}),
    ]
    got = runtime.run(answers(stub_first.rpc_inference, messages, 3))
    assert code(got[1]) == "InvalidInputError" and "per step" in got[1]["error"]["message"], got
    assert got[2].get("position") == 8, got
    victim.advance(2)

    # 5. an inbox flood: steps sent as fast as the transport takes them, answers never read
    flood_rss = rss(chain.workers[0])
    sent = runtime.run(send_without_reading(attacker, first, seconds=4.0))
    grown = rss(chain.workers[0]) - flood_rss
    print(
        f"inbox flood: the transport took {mib(sent)} in 4 s from a peer that never reads; worker RSS grew {mib(grown)}"
    )
    assert grown < 64 * 2**20
    victim.advance(2)

    # 6. a message announcing 1 GiB: refused on its header, its stream dropped unread
    assert runtime.run(oversized_raw_message(attacker, first, 2**30)), "the server kept reading a 1 GiB message"
    refusal = "a stream message of 1073741824 bytes exceeds the cap of 4194304"
    assert any(refusal in line for line in chain.workers[0].lines), chain.workers[0].lines[-20:]

    # 7. uploads past the server's budget: the last one is busy (typed, with its reason), the others finish
    for _ in range(3):  # a stream cut with no answer at all (the attacker's connection reset under load): try again
        reasons = runtime.run(concurrent_uploads(attacker, first))
        if "stream ended" not in reasons:
            break
        print(f"concurrent uploads: a stream ended with no answer ({reasons}); trying the scenario again")
    assert reasons[:2] == ["ok", "ok"] and reasons[2] == "uploads", reasons

    # the victim: every token equal to the local model, then its detached session is its own only
    state = victim.finish()
    assert victim.tokens.tolist() == reference.tolist()
    for peer, session_id in victim.server_sessions().items():
        for spec in ({}, {"resume_token": "0" * 64}, {"resume_token": capabilities.push_token(session_id)}):
            opened = {"open": {"session_id": session_id, "resume": True, "max_length": 64, **spec}}
            for _ in range(3):  # no answer at all (the attacker's connection reset under load): ask again
                got = runtime.run(answers(runtime.run(attacker.stub(peer)).rpc_inference, [request(**opened)], 1))
                if got:
                    break
            assert [code(a) for a in got] == ["SessionAccessError"], (peer, spec, got)
    # ... while the victim resumes it and goes on exactly as the local model does
    more = local_llama.generate(ids, max_new_tokens=NEW_TOKENS + 4, do_sample=False)
    with model.inference_session(resume_state=state) as resumed:
        tokens, logits = victim.tokens, victim.logits
        for _ in range(4):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], 1)
            logits = model(next_token, session=resumed).logits
    assert tokens.tolist() == more.tolist()

    for worker in chain.workers:
        grown = rss(worker) - memory_before[worker.peer_id]
        print(f"worker {worker.peer_id[-6:]}: RSS {mib(rss(worker))}, grew {mib(grown)} over the whole attack")
        assert grown < 200 * 2**20
    assert model.generate(ids, max_new_tokens=4).tolist() == reference[:, : ids.shape[1] + 4].tolist()


async def raw_stream(manager: SequenceManager, peer: str, handler: str = INFERENCE):
    """A bare stream to ``handler`` on ``peer``: we write what we like, as hivemind frames it or not."""
    p2p = await manager.p2p()
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
    return reader, writer


async def send_without_reading(manager: SequenceManager, peer: str, seconds: float) -> int:
    """Open a session and send 1024-token steps for ``seconds``, never reading an answer; the bytes the
    transport took (once the server stops reading, writes block)."""
    reader, writer = await raw_stream(manager, peer)
    step = request(hidden_tensor(protocol.MAX_STEP_TOKENS), position=0)
    sent, deadline = 0, time.monotonic() + seconds
    try:
        await P2P.send_protobuf(request(open={"session_id": "flood", "max_length": 2048, "batch_size": 1}), writer)
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await P2P.send_protobuf(step, writer)
                    sent += step.ByteSize()
    finally:
        writer.close()
    return sent


async def oversized_raw_message(manager: SequenceManager, peer: str, length: int) -> bool:
    """Announce a ``length``-byte message on an inference stream and send a little of it: True if the
    server drops the stream (EOF or reset) instead of reading on."""
    reader, writer = await raw_stream(manager, peer)
    try:
        writer.write(P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        for _ in range(16):
            writer.write(b"\0" * 2**16)
            await writer.drain()
        async with asyncio.timeout(15):
            return await reader.read() == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    finally:
        writer.close()


async def concurrent_uploads(manager: SequenceManager, peer: str) -> list[str]:
    """Three forward uploads of ~1 MiB each: two hold their first 768 KiB while the third comes (budget 2 MiB)."""
    stub = await manager.stub(peer)
    tokens = 4000  # [1, 4000, 64] float32: 1 024 000 bytes, under --max-tensor-bytes, in 256 KiB chunks
    parts = list(split_for_streaming(hidden_tensor(tokens), 2**18))
    chunks = [request(parts[0])] + [runtime_pb2.ExpertRequest(tensors=[part]) for part in parts[1:]]
    held = asyncio.Event()
    sent = [asyncio.Event() for _ in range(2)]

    async def upload(index: int) -> str:
        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            for i, chunk in enumerate(chunks):
                if index < 2 and i == 3:
                    sent[index].set()
                    await held.wait()
                yield chunk

        async for response in await stub.rpc_forward(requests()):
            metadata = protocol.unpack_metadata(response.metadata)
            if "error" not in metadata:
                return "ok"
            error = error_from_wire(metadata["error"])
            assert isinstance(error, ServerBusyError | InvalidInputError), error
            return str(error.details.get("reason", type(error).__name__))
        return "stream ended"

    holders = [asyncio.create_task(upload(i)) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in sent)), 30)
    await asyncio.sleep(0.5)  # their 768 KiB arrive at the server
    third = await asyncio.wait_for(upload(2), 30)
    held.set()
    return [*await asyncio.wait_for(asyncio.gather(*holders), 60), third]
