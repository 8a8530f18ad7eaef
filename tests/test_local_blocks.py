"""Local blocks in the client (``from_pretrained(local_blocks="0:2")``, ``swarmserve gateway --local-blocks``).

A real swarm of two worker processes holds blocks 2:3 and 3:4 of the tiny Llama; the client runs blocks 0:2
itself. Everything is compared with the local 🤗 model from the same checkpoint: logits, greedy tokens,
hidden states, gradients, slices of ``model.blocks``. Later tests add workers (a 0:2 server for the
all-remote gateway, a second 3:4 server to fail over to), so the module's tests run in file order.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from gateway.backends.swarm import SwarmBackend
from swarm_client import AutoDistributedModelForCausalLM, capabilities, runtime
from swarm_client.local_span import LocalSession
from swarm_client.routing import LOCAL_PEER, RouteHop
from swarm_client.server_session import _ServerSession, push_chain
from swarm_client.session import InferenceSession
from swarmserve.cli import build_parser
from swarmserve.cli.gateway import client_options
from tests.gateway_fixtures import start_gateway, swarm_gateway
from tests.swarm_fixtures import Swarm, greedy_route, swarm
from tests.test_prompt_tuning import deep_prompts_on

pytestmark = pytest.mark.slow

ATOL = 1e-4
PROMPT = torch.tensor([[3, 14, 15, 92, 65]])
NEW_TOKENS = 20
LOCAL = RouteHop(LOCAL_PEER, 0, 2)


@pytest.fixture(scope="module")
def the_swarm(tiny_llama: str) -> Iterator[Swarm]:
    assert_layers(tiny_llama, 4)
    # a fixed throughput skips the workers' benchmark (seconds of startup)
    with swarm(tiny_llama, ["2:3", "3:4"], "--throughput", "1000") as s:
        yield s


def assert_layers(path: str, n: int) -> None:
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).num_hidden_layers == n


@pytest.fixture(scope="module")
def model(the_swarm: Swarm, tiny_llama: str):
    m = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=[the_swarm.initial_peers], local_blocks="0:2", update_period=0.5, failover_deadline=20
    )
    m.requires_grad_(False)  # a frozen head: only the prompts train
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def reference(local_llama) -> list[int]:
    return local_llama.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT.shape[1] :].tolist()


def test_logits_match_local_model(model, local_llama) -> None:
    with torch.no_grad():
        ref = local_llama(PROMPT).logits
        torch.testing.assert_close(model(PROMPT).logits, ref, atol=ATOL, rtol=0)  # stateless
        with model.inference_session(max_length=16) as session:
            prefill = model(PROMPT[:, :3], session=session).logits
            decode = torch.cat([model(PROMPT[:, i : i + 1], session=session).logits for i in (3, 4)], 1)
            assert session.route[0] == LOCAL and all(h.peer_id != LOCAL_PEER for h in session.route[1:])
            assert [(h.start, h.end) for h in session.route] == [(0, 2), (2, 3), (3, 4)]
    torch.testing.assert_close(torch.cat([prefill, decode], 1), ref, atol=ATOL, rtol=0)
    assert model.manager.local.cache_tokens_used == 0  # the closed session freed its local cache


def test_greedy_identical(model, reference) -> None:
    tokens, route = greedy_route(model, PROMPT, NEW_TOKENS)
    assert tokens == reference and route[0] == LOCAL
    out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, PROMPT.shape[1] :].tolist() == reference


def test_push_between_remote_hops_only(the_swarm, tiny_llama, model, reference) -> None:
    """Pushing on: the 2:3 server pushes to the 3:4 one, nobody pushes to the local hop; same tokens."""
    manager = model.manager
    a, b = RouteHop("A", 2, 3), RouteHop("B", 3, 4)
    manager.config.push = True
    try:
        assert manager.push_pays([LOCAL, a, b]) and not manager.push_pays([LOCAL, a])
        assert not manager.push_pays([RouteHop("A", 0, 1), RouteHop(LOCAL_PEER, 1, 3), b])
    finally:
        manager.config.push = "auto"
    hops = [_ServerSession(manager, RouteHop("A", 0, 1), "s0"), LocalSession(manager.local, LOCAL, "s1")]
    hops += [_ServerSession(manager, a, "s2"), _ServerSession(manager, b, "s3")]
    chain = functools.partial(push_chain, hops, step_id="step", position=7, seq=3)
    assert chain(0) == [] and chain(3) == [] and push_chain(hops, 2, None, 7, 3) == []
    (target,) = chain(2)  # only this step's authorization travels, never the session's push key
    assert target == {"peer_id": "B", "session_id": "s3", "push_auth": capabilities.push_auth("s3", "step", 7, 3)}
    assert capabilities.push_token("s3") not in target.values()

    pushing = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=[the_swarm.initial_peers], local_blocks=(0, 2), push=True
    )
    try:
        with torch.inference_mode(), pushing.inference_session(max_length=32) as session:
            out = pushing.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, session=session)
            assert session.pushing and session.route[0] == LOCAL
        assert out[0, PROMPT.shape[1] :].tolist() == reference
    finally:
        pushing.shutdown()


def test_output_hidden_states(model, local_llama) -> None:
    with torch.no_grad():
        ref = local_llama(PROMPT, output_hidden_states=True).hidden_states
        stateless = model(PROMPT, output_hidden_states=True).hidden_states
        with model.inference_session(max_length=8) as session:
            stepped = model(PROMPT, session=session, output_hidden_states=True).hidden_states
    assert len(stateless) == len(stepped) == len(ref) == 5
    for ours, theirs, want in zip(stateless, stepped, ref, strict=True):
        torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(theirs, want, atol=ATOL, rtol=0)


def test_backward_through_local_and_remote_blocks(model, local_llama) -> None:
    cfg = local_llama.config
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, cfg.vocab_size, (2, 7), generator=gen), torch.randint(0, cfg.vocab_size, (2, 7))
    init = torch.randn(cfg.num_hidden_layers, 1, 3, cfg.hidden_size, generator=gen) * 0.1
    embeds0 = local_llama.get_input_embeddings()(ids).detach()

    def run(forward) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        prompts, embeds = init.clone().requires_grad_(True), embeds0.clone().requires_grad_(True)
        loss = F.cross_entropy(forward(embeds, prompts).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach(), prompts.grad, embeds.grad

    def local_forward(embeds, prompts):
        with deep_prompts_on(local_llama, prompts):
            return local_llama(inputs_embeds=embeds)

    ours = run(lambda embeds, prompts: model(inputs_embeds=embeds, prompts=prompts))
    for got, want in zip(ours, run(local_forward), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert ours[1][0].abs().max() > 1e-3 and ours[1][-1].abs().max() > 1e-3  # local and remote blocks' gradients


def test_lora_on_local_blocks_alone_trains(the_swarm, tiny_llama, local_llama) -> None:
    """PEFT LoRA injected into the client's local block 1 only (embeddings frozen, no prompts): its gradients
    arrive, and equal those of the same LoRA on the local 🤗 model's layer 1."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ours = AutoDistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=[the_swarm.initial_peers], local_blocks="0:2"
    )
    try:
        ours.requires_grad_(False)
        torch.manual_seed(0)
        inject_adapter_in_model(config, ours.manager.local.blocks[1])
        theirs = copy.deepcopy(local_llama)
        theirs.requires_grad_(False)
        inject_adapter_in_model(config, theirs.model.layers[1])
        lora = {n: p for n, p in ours.manager.local.blocks[1].named_parameters() if "lora_" in n}
        assert lora and all(p.requires_grad for p in lora.values())
        reference = {n.removeprefix("layer."): p for n, p in lora.items()}
        with torch.no_grad():  # the same LoRA weights on both sides
            for name, param in theirs.model.layers[1].named_parameters():
                if "lora_" in name:
                    param.copy_(reference[name])
        labels = PROMPT.roll(-1, 1)
        for model in (ours, theirs):
            loss = F.cross_entropy(model(PROMPT).logits.flatten(0, 1), labels.flatten())
            loss.backward()
        for name, param in theirs.model.layers[1].named_parameters():
            if "lora_" in name:
                assert reference[name].grad is not None, name
                torch.testing.assert_close(reference[name].grad, param.grad, atol=ATOL, rtol=0)
        assert any(p.grad.abs().max() > 1e-4 for p in lora.values())
    finally:
        ours.shutdown()


def test_slices_of_blocks_cross_the_local_span(model, local_llama) -> None:
    with torch.no_grad():
        hs = local_llama(PROMPT, output_hidden_states=True).hidden_states  # hs[i]: input of block i
        torch.testing.assert_close(model.blocks[1:3](hs[1]), hs[3], atol=ATOL, rtol=0)  # local 1 + remote 2
        torch.testing.assert_close(model.blocks[0:1](hs[0]), hs[1], atol=ATOL, rtol=0)  # local only
        x = hs[0]
        for block in model.blocks:  # a custom loop, block by block
            x = block(x)
        torch.testing.assert_close(local_llama.model.norm(x), hs[4], atol=ATOL, rtol=0)
        with model.blocks[1:4].inference_session(max_length=8) as session:
            out = torch.cat([session.step(hs[1][:, :3]), session.step(hs[1][:, 3:])], 1)
            assert [(h.peer_id == LOCAL_PEER, h.start, h.end) for h in session.route] == [
                (True, 1, 2),
                (False, 2, 3),
                (False, 3, 4),
            ]
    torch.testing.assert_close(local_llama.model.norm(out), hs[4], atol=ATOL, rtol=0)


def test_resume_reattaches_the_local_cache(model, local_llama) -> None:
    """``export_state`` / ``aresume`` (the gateway's detach and resume) keep the local hop's cache too."""
    with torch.no_grad():
        ref = local_llama(PROMPT).logits[:, -1]
        first = model.blocks.inference_session(max_length=8, keep_on_close=True)
        first.step(model.head.embed(PROMPT[:, :4]))
        state = first.export_state()
        first.close()
        assert state["hops"][0]["peer_id"] == LOCAL_PEER
        resumed = InferenceSession.resume(model.manager, state, keep_on_close=False)
        with resumed:
            logits = model.head.final(resumed.step(model.head.embed(PROMPT[:, 4:])))[:, -1]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert model.manager.local.cache_tokens_used == 0


@pytest.mark.parametrize("value", ["5:2", "0:5", "2:2", "x"])
def test_bad_local_blocks_raise_value_error(tiny_llama, value) -> None:
    with pytest.raises(ValueError, match="local_blocks"):
        AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[], local_blocks=value)


def test_gateway_with_local_blocks_serves_chats_of_the_all_remote_swarm(the_swarm, tiny_llama) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--model", tiny_llama, "--initial-peers", "x", "--local-blocks", "3:1"])
    args = parser.parse_args(
        ["gateway", "--model", tiny_llama, "--initial-peers", the_swarm.initial_peers, "--local-blocks", "0:2"]
    )
    assert isinstance(args, argparse.Namespace)
    options = client_options(args)
    assert options["local_blocks"] == (0, 2) and options["device"] == "cpu"
    backend = SwarmBackend(tiny_llama, [the_swarm.initial_peers], update_period=1.0, **options)
    messages = [{"role": "user", "content": "Tell me about the swarm."}]
    gw = start_gateway(backend)  # waits for /health: no server holds 0:2, the gateway does
    try:
        state = gw.http().get("/v1/swarm").json()
        assert state["missing_blocks"] == [] and state["local_blocks"] == [0, 2]
        r = gw.client().chat.completions.create(model=gw.model, messages=messages, max_tokens=16, temperature=0)
        ours = r.choices[0].message.content
    finally:
        gw.server.stop()
        backend.close()
    the_swarm.add_worker("--throughput", "1000", blocks="0:2")  # now the whole model is on servers
    with swarm_gateway(tiny_llama, the_swarm.initial_peers) as remote_gw:
        r = remote_gw.client().chat.completions.create(
            model=remote_gw.model, messages=messages, max_tokens=16, temperature=0
        )
        assert r.choices[0].message.content == ours and ours


def test_failover_of_a_remote_span_with_local_blocks(the_swarm, model, reference) -> None:
    """Runs last: it adds a second 3:4 server and kills whichever one the session uses, mid-generation."""
    the_swarm.add_worker("--throughput", "1000", blocks="3:4")
    deadline = time.monotonic() + 20
    while sum(s.start <= 3 < s.end for s in runtime.run(model.manager.update(force=True)).values()) < 2:
        assert time.monotonic() < deadline, "the second 3:4 server never showed up"
        time.sleep(0.3)
    killed = {}
    tokens = []
    with torch.inference_mode(), model.inference_session(max_length=32) as session:
        logits = model(PROMPT, session=session).logits
        for step in range(NEW_TOKENS):
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            if step == 5:
                hop = next(h for h in session.route if h.start <= 3 < h.end)
                next(w for w in the_swarm.workers if getattr(w, "peer_id", None) == hop.peer_id).kill()
                killed["peer"] = hop.peer_id
            if step + 1 < NEW_TOKENS:
                logits = model(token, session=session).logits
        route = session.route
    assert tokens == reference
    assert session.failovers >= 1 and route[0] == LOCAL
    assert killed["peer"] not in {h.peer_id for h in route}
