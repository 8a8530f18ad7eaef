"""Bundled steps (``rpc_steps``): a real worker keeps bundled sessions alive and exact, and a bundle can
neither step another peer's session nor take the server down with garbage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm_client import AutoDistributedModelForCausalLM, protocol, runtime
from swarm_client.errors import InvalidInputError, SessionNotFoundError, error_from_wire
from swarm_client.sequence_manager import ClientConfig, SequenceManager
from swarm_client.step_bundles import StepBundler
from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow

IDLE = 3.0  # the worker's --idle-timeout


@pytest.fixture(scope="module")
def setup(tiny_llama):
    with swarm(tiny_llama, ["0:4"], "--idle-timeout", str(IDLE)) as s:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=[s.initial_peers], step_bundles=True
        )
        yield s, model
        model.shutdown()


def decode(model, ids: torch.Tensor, new_tokens: int, pause: float = 0.0) -> tuple[list[int], object]:
    """Greedy tokens through ``model``'s swarm, sleeping ``pause`` seconds between steps."""
    with torch.no_grad(), model.blocks.inference_session(max_length=64) as session:
        out = session.step(model.head.embed(ids))
        tokens: list[int] = []
        for _ in range(new_tokens):
            token = model.head.final(out[:, -1:]).argmax(-1)
            tokens.append(int(token))
            time.sleep(pause)
            out = session.step(model.head.embed(token))
        return tokens, session


def expected(local_llama, ids: torch.Tensor, new_tokens: int) -> list[int]:
    return local_llama.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()


def other_peer(model) -> SequenceManager:
    """Another client (its own DHT node, so its own peer id)."""
    cfg = model.manager.config
    manager = SequenceManager(ClientConfig(initial_peers=cfg.initial_peers, dht_prefix=cfg.dht_prefix, num_blocks=4))
    runtime.run(manager.update(force=True))
    return manager


def test_bundled_steps_keep_a_session_alive_past_the_idle_timeout(setup, local_llama):
    """Bundled steps never pass the session's own stream; the server must not close it as idle."""
    s, model = setup
    peer = s.workers[0].peer_id
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(1))
    tokens, session = decode(model, ids, 6, pause=0.9)  # 5.4 s > IDLE of steps over the bundle stream only
    assert tokens == expected(local_llama, ids, 6)
    assert session.failovers == 0  # not lost and silently replayed elsewhere: there is nowhere else
    bundler = model.manager.step_bundler(peer)
    assert bundler is not None and bundler.steps_sent >= 6


def test_a_bundle_cannot_step_another_peers_session(setup, local_llama):
    s, model = setup
    peer = s.workers[0].peer_id
    ids = torch.randint(0, 1000, (1, 4), generator=torch.Generator().manual_seed(2))
    intruder = other_peer(model)
    try:
        with torch.no_grad(), model.blocks.inference_session(max_length=64) as session:
            out = session.step(model.head.embed(ids))
            victim = session._hops[0].session_id

            async def intrude():
                inbox: asyncio.Queue = asyncio.Queue()
                bundler = StepBundler(intruder, peer)
                try:
                    hidden = protocol.serialize(torch.zeros(1, 1, model.config.hidden_size))
                    bundler.submit(inbox, hidden, {"session_id": victim, "position": 0})
                    return await asyncio.wait_for(inbox.get(), 30)
                finally:
                    await bundler.close()

            tensors, answer = runtime.run(intrude())
            assert tensors == []
            assert isinstance(error_from_wire(answer["error"]), SessionNotFoundError), answer
            # the victim's cache was not touched: its greedy continuation is still exact
            tokens = []
            for _ in range(5):
                token = model.head.final(out[:, -1:]).argmax(-1)
                tokens.append(int(token))
                out = session.step(model.head.embed(token))
        assert tokens == expected(local_llama, ids, 5)
    finally:
        intruder.shutdown()


def test_garbage_bundles_get_typed_errors_and_the_stream_keeps_serving(setup):
    s, model = setup
    peer = s.workers[0].peer_id
    hidden = protocol.serialize(torch.zeros(1, 1, model.config.hidden_size))
    bad_dtype = runtime_pb2.Tensor(buffer=b"\0" * 16, size=[1, 1, 4], dtype="float33")

    def bundle(bundle_id: int, tensors: list, steps) -> runtime_pb2.ExpertRequest:
        return runtime_pb2.ExpertRequest(
            tensors=tensors, metadata=protocol.pack_metadata({"bundle_id": bundle_id, "steps": steps})
        )

    garbage = {
        0: (bundle(0, [hidden], "not a list"), InvalidInputError, "'steps' must be a list"),
        1: (bundle(1, [hidden], [{"session_id": "a"}, {"session_id": "b"}]), InvalidInputError, "one tensor"),
        2: (bundle(2, [bad_dtype], [{"session_id": "a"}]), InvalidInputError, "dtype"),
        3: (bundle(3, [hidden] * 2, [{"session_id": "x"}, 7]), InvalidInputError, "one dict per step"),
    }
    unknown = bundle(4, [hidden], [{"session_id": "nobody", "position": 0}])

    async def send_all() -> list[dict]:
        stub = await model.manager.stub(peer)

        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            for request, _, _ in garbage.values():
                yield request
            yield unknown

        answers = []
        async for response in await stub.rpc_steps(requests()):
            answers.append(protocol.unpack_metadata(response.metadata))
        return answers

    answers = {a["bundle_id"]: a for a in runtime.run(asyncio.wait_for(send_all(), 60))}
    assert sorted(answers) == [0, 1, 2, 3, 4]  # every bundle answered, the garbage did not end the stream
    for bundle_id, (_, error_type, match) in garbage.items():
        error = error_from_wire(answers[bundle_id]["error"])
        assert isinstance(error, error_type) and match in str(error), (bundle_id, answers[bundle_id])
    (step,) = answers[4]["steps"]
    assert isinstance(error_from_wire(step["error"]), SessionNotFoundError)
    assert runtime.run(model.manager.info(peer))["accepting"]
