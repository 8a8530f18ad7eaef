"""Bad requests get typed errors and never disturb other sessions; SIGTERM announces OFFLINE."""

from __future__ import annotations

import pytest
import torch

from swarm_client import (
    AutoDistributedModelForCausalLM,
    InvalidInputError,
    LengthExceededError,
    SessionNotFoundError,
    SessionTooLongError,
    runtime,
)
from swarm_client.dht_records import ServerState, fetch_block_records
from swarm_client.routing import RouteHop
from swarm_client.session import _ServerSession
from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tiny_llama):
    with swarm(tiny_llama, ["0:2", "2:4"], "--cache-tokens", "256") as s:
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[s.initial_peers])
        yield s, model
        model.shutdown()


def raw_session(model, peer_id: str, start: int, end: int, session_id: str = "raw") -> _ServerSession:
    return _ServerSession(model.manager, RouteHop(peer_id, start, end), session_id)


def open_raw(model, peer, max_length=16, resume=False, session_id="raw"):
    session = raw_session(model, peer, 0, 2, session_id)
    runtime.run(session.open(max_length, 1, resume=resume, timeout=10))
    return session


def greedy_still_works(model, local):
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model.generate(ids, max_new_tokens=4).tolist() == local.generate(ids, max_new_tokens=4).tolist()


def test_worker_prints_what_it_serves(setup):
    s, _ = setup
    ready = [line for line in s.workers[0].lines if line.startswith("swarmserve worker ready:")][0]
    assert "serving blocks 0:2 of 4" in ready and "llama" in ready and "cache 256 tokens" in ready


def test_step_past_max_length_is_a_typed_error_and_the_session_survives(setup, local_llama):
    s, model = setup
    session = open_raw(model, s.workers[0].peer_id, max_length=4, session_id="too-long")
    try:
        with pytest.raises(LengthExceededError, match="max_length 4"):
            runtime.run(session.step(torch.randn(1, 6, 64), 0, timeout=10))
        out = runtime.run(session.step(torch.randn(1, 2, 64), 0, timeout=10))  # same stream still serves
        assert out.shape == (1, 2, 64)
    finally:
        runtime.run(session.close())
    greedy_still_works(model, local_llama)


def test_wrong_hidden_size_is_rejected(setup, local_llama):
    s, model = setup
    session = open_raw(model, s.workers[0].peer_id, session_id="bad-hidden")
    try:
        with pytest.raises(InvalidInputError, match="hidden size 32"):
            runtime.run(session.step(torch.randn(1, 3, 32), 0, timeout=10))
        with pytest.raises(InvalidInputError, match="NaN"):
            runtime.run(session.step(torch.full((1, 1, 64), float("nan")), 0, timeout=10))
        with pytest.raises(InvalidInputError, match="position"):
            runtime.run(session.step(torch.randn(1, 1, 64), 5, timeout=10))  # gap: nothing cached yet
    finally:
        runtime.run(session.close())
    greedy_still_works(model, local_llama)


def test_unknown_session_is_not_found(setup, local_llama):
    s, model = setup
    with pytest.raises(SessionNotFoundError, match="no-such-session"):
        open_raw(model, s.workers[0].peer_id, resume=True, session_id="no-such-session")
    greedy_still_works(model, local_llama)


def test_too_many_cache_tokens_requested(setup, local_llama):
    s, model = setup
    with pytest.raises(SessionTooLongError, match="256") as e:  # typed: no wait makes it fit here
        open_raw(model, s.workers[0].peer_id, max_length=100_000, session_id="huge")
    assert e.value.details == {"cache_tokens_total": 256}
    greedy_still_works(model, local_llama)


def test_client_side_length_check_names_the_numbers(setup):
    _, model = setup
    with (
        model.inference_session(max_length=5) as session,
        pytest.raises(LengthExceededError, match="max_length 5"),
    ):
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]), session=session)


def test_sigterm_announces_offline_and_clients_route_around(setup, local_llama, tiny_llama):
    s, model = setup
    spare = s.add_worker(blocks="0:4")
    victim = s.workers[0]
    runtime.run(model.manager.update(force=True))
    assert victim.stop() == 0
    assert any("announced OFFLINE" in line for line in victim.lines)
    records = fetch_block_records(model.manager.dht, model.manager.config.dht_prefix, 4)
    assert records[0][victim.peer_id].state == ServerState.OFFLINE
    runtime.run(model.manager.update(force=True))
    with model.inference_session(max_length=16) as session:
        model(torch.tensor([[1, 2, 3]]), session=session)
        assert victim.peer_id not in {hop.peer_id for hop in session.route}
        assert spare.peer_id in {hop.peer_id for hop in session.route}
    greedy_still_works(model, local_llama)
