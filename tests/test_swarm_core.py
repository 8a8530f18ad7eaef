"""The swarm core end to end: real DHT + worker processes, the distributed model vs the local 🤗 one."""

from __future__ import annotations

import pytest
import torch

from swarm_client import AutoDistributedModelForCausalLM, SessionNotFoundError, runtime
from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow

ATOL = 1e-4


@pytest.fixture(
    scope="module", params=[["0:2", "2:4"], ["0:1", "1:3", "3:4"]], ids=["2-workers", "3-workers"]
)
def dist(request, tiny_llama):
    with swarm(tiny_llama, request.param) as s:
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[s.initial_peers])
        model.swarm = s
        yield model
        model.shutdown()


def prompt(local, length=9, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, local.config.vocab_size, (batch, length), generator=g)


def test_route_uses_every_worker(dist):
    with dist.inference_session(max_length=8) as s:
        dist(prompt(dist, 3), session=s)
        assert len(s.route) == len(dist.swarm.workers)


def test_forward_logits_match_local(dist, local_llama):
    ids = prompt(local_llama, 13, batch=2)
    with torch.no_grad():
        ours, ref = dist(ids).logits, local_llama(ids).logits
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_greedy_generate_identical(dist, local_llama):
    ids = prompt(local_llama, 7, seed=1)
    ours = dist.generate(ids, max_new_tokens=32, do_sample=False)
    ref = local_llama.generate(ids, max_new_tokens=32, do_sample=False)
    assert ours.tolist() == ref.tolist()


def test_seeded_sampling_identical(dist, local_llama):
    ids = prompt(local_llama, 5, seed=2)
    torch.manual_seed(1234)
    ours = dist.generate(ids, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=50)
    torch.manual_seed(1234)
    ref = local_llama.generate(ids, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=50)
    assert ours.tolist() == ref.tolist()


def test_three_generate_calls_in_one_session_equal_one_local_call(dist, local_llama):
    ids = prompt(local_llama, 6, seed=3)
    with dist.inference_session(max_length=64) as session:
        out = dist.generate(ids, max_new_tokens=8, do_sample=False)
        position_after_first = session.position
        out = dist.generate(out, max_new_tokens=8, do_sample=False)
        out = dist.generate(out, max_new_tokens=8, do_sample=False)
        # each call sent only its new tokens: the session holds every token but the last generated one
        assert session.position == out.shape[1] - 1
        assert position_after_first == 6 + 8 - 1
    ref = local_llama.generate(ids, max_new_tokens=24, do_sample=False)
    assert out.tolist() == ref.tolist()


def test_custom_loop_with_forward_inside_session(dist, local_llama):
    ids = prompt(local_llama, 4, seed=4)
    tokens = ids
    with dist.inference_session(max_length=32) as session:
        logits = dist(ids, session=session).logits
        for _ in range(6):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], 1)
            logits = dist(next_token, session=session).logits
    ref = local_llama.generate(ids, max_new_tokens=6, do_sample=False)
    assert tokens.tolist() == ref.tolist()


def test_session_rollback_matches_fresh_computation(dist, local_llama):
    ids = prompt(local_llama, 10, seed=5)
    with dist.inference_session(max_length=32) as session:
        dist(ids, session=session)
        session.rollback(4)
        other = prompt(local_llama, 3, seed=6)
        logits = dist(other, session=session).logits
    with torch.no_grad():
        ref = local_llama(torch.cat([ids[:, :4], other], 1)).logits[:, 4:]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_hidden_states_of_a_slice_equal_local_layers(dist, local_llama):
    ids = prompt(local_llama, 8, seed=7)
    with torch.no_grad():
        ref = local_llama(ids, output_hidden_states=True).hidden_states
        x = ref[1]  # output of block 0 = input of block 1
        out = dist.blocks[1:3](x)
        _, states = dist.blocks[1:3].forward_with_states(x)
    torch.testing.assert_close(out, ref[3], atol=ATOL, rtol=0)
    torch.testing.assert_close(states[0], ref[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(states[1], ref[3], atol=ATOL, rtol=0)


def test_output_hidden_states_match_local(dist, local_llama):
    ids = prompt(local_llama, 6, seed=8)
    with torch.no_grad():
        ours = dist(ids, output_hidden_states=True).hidden_states
        ref = local_llama(ids, output_hidden_states=True).hidden_states
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_backward_through_remote_blocks_matches_local_autograd(dist, local_llama):
    ids = prompt(local_llama, 7, batch=2, seed=9)
    labels = prompt(local_llama, 7, batch=2, seed=10)
    embeds = local_llama.get_input_embeddings()(ids).detach()

    ours_in = embeds.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(
        dist(inputs_embeds=ours_in).logits.flatten(0, 1), labels.flatten()
    )
    loss.backward()

    ref_in = embeds.clone().requires_grad_(True)
    ref_loss = torch.nn.functional.cross_entropy(
        local_llama(inputs_embeds=ref_in).logits.flatten(0, 1), labels.flatten()
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=ATOL, rtol=0)


def test_session_kept_on_servers_resumes_in_a_later_request(dist, local_llama):
    ids = prompt(local_llama, 6, seed=11)
    with dist.inference_session(max_length=64, keep_on_close=True) as first:
        out = dist.generate(ids, max_new_tokens=5, do_sample=False)
        state = first.export_state()
    tokens_before = sum(
        runtime.run(dist.manager.info(h["peer_id"]))["tokens_processed"] for h in state["hops"]
    )
    with dist.inference_session(resume_state=state, keep_on_close=True) as second:
        assert second.position == state["position"]
        out = dist.generate(out, max_new_tokens=5, do_sample=False)
    tokens_after = sum(
        runtime.run(dist.manager.info(h["peer_id"]))["tokens_processed"] for h in state["hops"]
    )
    # only the last token of turn 1 and the 4 fed tokens of turn 2 were processed (5 per server)
    assert tokens_after - tokens_before == 5 * len(state["hops"])
    assert out.tolist() == local_llama.generate(ids, max_new_tokens=10, do_sample=False).tolist()


def test_resuming_an_unknown_session_is_not_found(dist):
    state = {
        "session_id": "gone",
        "position": 3,
        "max_length": 16,
        "batch_size": 1,
        "start": 0,
        "end": 4,
        "hops": [
            {"peer_id": w.peer_id, "start": 0, "end": 4, "server_session_id": "nope"}
            for w in dist.swarm.workers[:1]
        ],
    }
    with pytest.raises(SessionNotFoundError), dist.inference_session(resume_state=state):
        pass


def test_workers_with_default_flags_size_their_cache_from_memory(dist):
    """No --cache-tokens: each worker's budget is sized from free memory, capped at 8 context windows of the
    model (the tiny model's 2048 tokens: 16384 slots here), and its ready line says how (issue 40)."""
    for worker in dist.swarm.workers:
        ready = next(line for line in worker.lines if line.startswith("swarmserve worker ready:"))
        assert "cache 16384 tokens (auto: 8 × the 2048-token context)" in ready, ready
