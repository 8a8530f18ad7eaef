"""Server-to-server push of activations against real worker processes: same tokens and logits as the local
model, the pushes really carry the steps, and failover still works when a pushed input was wrong or lost."""

from __future__ import annotations

import pytest
import torch

from swarm_client import AutoDistributedModelForCausalLM, runtime
from tests.swarm_fixtures import Swarm
from tests.test_failover import NEW_TOKENS, PROMPT, greedy_with_hook, prefer, reference, worker_by_peer  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain_swarm(tiny_llama):
    """Three servers in a chain (0:1, 1:3, 3:4) and a spare for the middle span."""
    s = Swarm(tiny_llama)
    try:
        for span in ("0:1", "1:3", "3:4", "1:3"):
            s.add_worker(blocks=span)
        yield s
    finally:
        s.close()


def pushing_model(tiny_llama, s: Swarm, **options):
    return AutoDistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=[s.initial_peers], push=True, update_period=0.5, failover_deadline=30, **options
    )


def counters(model, peer_ids) -> dict[str, dict]:
    return {p: runtime.run(model.manager.info(p)) for p in peer_ids}


def test_pushed_chain_matches_local_model(chain_swarm, tiny_llama, local_llama, reference):  # noqa: F811
    model = pushing_model(tiny_llama, chain_swarm)
    try:
        runtime.run(model.manager.update(force=True))
        before = counters(model, [w.peer_id for w in chain_swarm.workers])
        tokens, session = greedy_with_hook(model, lambda step, session: None)
        assert tokens == reference
        route = [h.peer_id for h in session.route]
        assert len(route) == 3
        after = counters(model, route)
        first, middle, last = route
        # the decode steps went server to server: each later server ran pushed copies, the first sent them.
        # A push only counts when it beats the client's own copy, so this looks at all 39 decode steps:
        # a few early ones may lose the race while the push stream opens on a loaded machine.
        assert after[first]["pushes_sent"] > before[first]["pushes_sent"]
        assert after[middle]["pushes_used"] > before[middle]["pushes_used"]
        assert after[last]["pushes_used"] > before[last]["pushes_used"]
        assert after[last]["pushes_sent"] == before[last]["pushes_sent"]  # the end of the chain pushes nowhere
        # the client sends its own copy of a pushed step only when the push's answer is late (push_grace): the
        # servers see far fewer copies than pushed steps they ran
        used = sum(after[p]["pushes_used"] - before[p]["pushes_used"] for p in (middle, last))
        copies = sum(after[p]["copies_after_push"] - before[p]["copies_after_push"] for p in (middle, last))
        assert copies <= used // 2 and model.manager.late_pushes <= used // 2, (copies, used)

        ids = torch.tensor([[5, 9, 2, 77, 31, 8]])
        with torch.no_grad():
            expected = local_llama(ids).logits
            with model.inference_session(max_length=16) as session:
                got = torch.cat([model(ids[:, :3], session=session).logits]
                                + [model(ids[:, i : i + 1], session=session).logits for i in range(3, 6)], 1)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    finally:
        model.shutdown()


def test_sigkill_with_push_keeps_greedy_output(chain_swarm, tiny_llama, reference):  # noqa: F811
    s = chain_swarm
    model = pushing_model(tiny_llama, s)
    killed = {}

    def hook(step, session):
        if step == 12:
            middle = next(h for h in session.route if h.start <= 1 < h.end)
            worker_by_peer(s, middle.peer_id).kill()
            killed["peer"] = middle.peer_id

    try:
        tokens, session = greedy_with_hook(model, hook)
        assert tokens == reference
        assert session.failovers >= 1
        assert killed["peer"] not in {h.peer_id for h in session.route}
    finally:
        model.shutdown()
        s.add_worker(blocks="1:3")


def test_wrong_pushed_activations_are_caught_and_replaced(tiny_llama, reference):  # noqa: F811
    """A server returning (and pushing) subtly wrong activations: the next server already ran the pushed
    copy, but the spot check catches the bad server, the step is redone with a fresh step id, and the
    stale answer is skipped, so not one token changes."""
    s = Swarm(tiny_llama)
    try:
        s.add_worker(blocks="0:2")
        s.add_worker(blocks="2:4")
        bad = s.add_worker("--fault", "noise:3", "--throughput", "1e9", blocks="0:2")
        model = pushing_model(tiny_llama, s, spot_check_rate=1.0)
        try:
            runtime.run(model.manager.update(force=True))
            prefer(model, bad.peer_id)
            tokens, session = greedy_with_hook(model, lambda step, session: None)
            assert tokens == reference
            assert session.spot_check_failures == 1
            assert bad.peer_id not in {h.peer_id for h in session.route}
            last = next(h.peer_id for h in session.route if h.end == 4)
            assert counters(model, [last])[last]["pushes_used"] > 0
        finally:
            model.shutdown()
    finally:
        s.close()


def test_a_server_pushing_other_activations_than_it_answers_is_caught_without_spot_checks(tiny_llama, reference):  # noqa: F811
    """The first server answers the client right but pushes noise to the next one. The next server's answer
    carries the digest of the input it ran, which differs from what the client got: the pusher is banned and
    replaced, the step redone, not one token changes — with spot checks off."""
    s = Swarm(tiny_llama)
    try:
        s.add_worker(blocks="0:2")
        s.add_worker(blocks="2:4")
        liar = s.add_worker("--fault", "push-noise:3", "--throughput", "1e9", blocks="0:2")
        model = pushing_model(tiny_llama, s, spot_check_rate=0.0)
        try:
            runtime.run(model.manager.update(force=True))
            prefer(model, liar.peer_id)
            tokens, session = greedy_with_hook(model, lambda step, session: None)
            assert tokens == reference
            assert session.failovers >= 1
            assert liar.peer_id not in {h.peer_id for h in session.route}
            # its last ban's reason (kept until it succeeds again): the 1 s ban itself may be over by now
            assert "pushed by" in (model.manager.bans.reason(liar.peer_id) or "")
        finally:
            model.shutdown()
    finally:
        s.close()
