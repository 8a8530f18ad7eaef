"""Served LoRA adapters on a real swarm: two workers (blocks 0:2 and 2:4) serving adapters a1 and a2 beside
the base blocks, a third holding blocks 0:2 with a1 only. Logits with an adapter equal the local 🤗 model
with the same PEFT adapter merged (float32, atol 1e-4), greedy tokens exactly; sessions of different adapters
stepping at once each equal their own reference; routes use only servers holding the adapter, and a missing
one is a ``NoRouteError`` naming adapter and blocks."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from swarm_client import AutoDistributedModelForCausalLM, runtime
from swarm_client.errors import AdapterNotFoundError, NoRouteError, RemoteError
from swarm_client.routing import RouteHop
from swarm_client.server_session import _ServerSession
from swarm_client.tiny_lora import make_random_lora
from swarmserve.launcher import wait_ready
from tests.swarm_fixtures import Swarm, greedy_session

pytestmark = pytest.mark.slow

ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-swarm")
    return {name: str(make_random_lora(tiny_llama, root / name, seed=seed)) for name, seed in (("a1", 1), ("a2", 2))}


@pytest.fixture(scope="module")
def references(tiny_llama, adapters) -> dict[str | None, Any]:
    """The local 🤗 model, plain and with each adapter merged by PEFT."""
    models: dict[str | None, Any] = {None: AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)}
    for name, path in adapters.items():
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        models[name] = PeftModel.from_pretrained(base, path).merge_and_unload()
    return {name: model.eval() for name, model in models.items()}


@pytest.fixture(scope="module")
def served(tiny_llama, adapters) -> Iterator[tuple[Any, Swarm]]:
    both = [f"{name}={path}" for name, path in adapters.items()]
    with Swarm(tiny_llama) as s:
        starting = [
            s.add_worker("--adapters", *both, blocks="0:2", wait=False),
            s.add_worker("--adapters", *both, blocks="2:4", wait=False),
            s.add_worker("--adapters", both[0], blocks="0:2", wait=False),
        ]
        wait_ready(starting, timeout=120.0)
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[s.initial_peers])
        try:
            yield model, s
        finally:
            model.shutdown()


def _ids(seed: int, length: int = 9) -> torch.Tensor:
    return torch.randint(0, 200, (1, length), generator=torch.Generator().manual_seed(seed))


def _reference_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    return out[0, prompt.shape[1] :].tolist()


def test_servers_announce_their_adapters(served) -> None:
    model, _ = served
    spans = runtime.run(model.manager.update(force=True))
    held = sorted(tuple(sorted(s.server_info.adapters)) for s in spans.values())
    assert held == [("a1",), ("a1", "a2"), ("a1", "a2")]


@pytest.mark.parametrize("adapter", [None, "a1", "a2"])
def test_logits_and_greedy_tokens_equal_peft_merged(served, references, adapter) -> None:
    model, _ = served
    prompt = _ids(1)
    with torch.no_grad(), model.inference_session(max_length=32, adapter=adapter) as session:
        logits = model(prompt, session=session).logits
    with torch.no_grad():
        expected = references[adapter](prompt).logits
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    if adapter is not None:  # the adapter changes the output: a route that ignored it would fail above
        assert (references[None](prompt).logits - expected).abs().max() > 0.05
    model.manager.config.active_adapter = adapter
    try:
        tokens, _ = greedy_session(model, prompt, 8)
        stateless = model(prompt).logits  # rpc_forward with the adapter
    finally:
        model.manager.config.active_adapter = None
    assert tokens == _reference_greedy(references[adapter], prompt, 8)
    torch.testing.assert_close(stateless, expected, atol=ATOL, rtol=0)


def test_sessions_of_different_adapters_at_once_each_equal_their_reference(served, references) -> None:
    """Four sessions (a1, a2, base, a1) decode concurrently through the same servers, whose batcher may put
    their steps into one pass: each still equals its own merged reference."""
    model, _ = served
    names = ["a1", "a2", None, "a1"]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(names))

    def run(i: int, adapter: str | None) -> None:
        try:
            prompt = _ids(10 + i)
            tokens = []
            with torch.no_grad(), model.inference_session(max_length=32, adapter=adapter) as session:
                barrier.wait(timeout=30)
                logits = model(prompt, session=session).logits
                for _ in range(6):
                    token = logits[:, -1].argmax(-1, keepdim=True)
                    tokens.append(int(token))
                    logits = model(token, session=session).logits
            results[i] = tokens
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, adapter in enumerate(names):
        assert results[i] == _reference_greedy(references[adapter], _ids(10 + i), 6), (i, adapter)


def test_routes_use_only_servers_holding_the_adapter(served) -> None:
    model, _ = served
    spans = runtime.run(model.manager.update(force=True))
    a2_holders = {p for p, span in spans.items() if "a2" in span.server_info.adapters}
    for _ in range(4):
        with model.inference_session(max_length=16, adapter="a2") as session:
            session.open()
            assert {hop.peer_id for hop in session.route} <= a2_holders
    assert len(a2_holders) == 2


def test_missing_adapter_is_a_no_route_error_naming_it(served) -> None:
    model, _ = served
    wait, model.manager.config.route_wait = model.manager.config.route_wait, 1.0
    try:
        expected = r"adapter 'nope'.*does not hold adapter 'nope'"
        with pytest.raises(NoRouteError, match=expected) as info, model.inference_session(16, adapter="nope") as s:
            s.open()
    finally:
        model.manager.config.route_wait = wait
    assert info.value.adapter == "nope" and info.value.missing_blocks == [0, 1, 2, 3]


def test_active_adapter_of_from_pretrained_drives_generate(served, references, tiny_llama) -> None:
    _, s = served
    model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, [s.initial_peers], active_adapter="a2")
    try:
        prompt = _ids(40)
        out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert out[0, prompt.shape[1] :].tolist() == _reference_greedy(references["a2"], prompt, 6)
    finally:
        model.shutdown()


def test_a_server_refuses_an_adapter_it_does_not_hold(served) -> None:
    """Past routing (a stale record, a hostile client): the server itself answers ``adapter_not_found``, and a
    resume under another adapter than the session's is refused."""
    model, _ = served
    spans = runtime.run(model.manager.update(force=True))
    peer = next(p for p, span in spans.items() if span.server_info.adapters == ("a1",))
    session = _ServerSession(model.manager, RouteHop(peer, 0, 2), "lora-refusal", adapter="a2")
    with pytest.raises(AdapterNotFoundError, match="holds no adapter 'a2' .*it holds: a1"):
        runtime.run(session.open(16, 1, resume=False, timeout=10))
    runtime.run(session.close())
    opened = _ServerSession(model.manager, RouteHop(peer, 0, 2), "lora-resume", adapter="a1")
    runtime.run(opened.open(16, 1, resume=False, timeout=10))
    runtime.run(opened.close(keep=True))
    other = _ServerSession(model.manager, RouteHop(peer, 0, 2), "lora-resume", adapter=None)
    other.adapter = "x1"  # any other name: the server holds this session under a1
    with pytest.raises(RemoteError, match="runs with adapter 'a1'"):
        runtime.run(other.open(16, 1, resume=True, timeout=10))


def test_spot_checks_compare_like_with_like(served, references) -> None:
    """Every step spot-checked: the checker of blocks 0:2 is the other server holding a1, asked to run a1,
    so an honest server is never found to disagree (a checker running the base model would ban it)."""
    model, _ = served
    rate, model.manager.config.spot_check_rate = model.manager.config.spot_check_rate, 1.0
    try:
        prompt = _ids(20)
        model.manager.config.active_adapter = "a1"
        tokens, session = greedy_session(model, prompt, 6)
    finally:
        model.manager.config.active_adapter = None
        model.manager.config.spot_check_rate = rate
    assert session.spot_checks > 0 and session.spot_check_failures == 0
    assert not model.manager.bans.banned()
    assert tokens == _reference_greedy(references["a1"], prompt, 6)


def test_failover_mid_session_keeps_the_adapter(served, references) -> None:
    """Runs last (it kills a worker): the server of blocks 0:2 in an a1 session is SIGKILLed mid-generation;
    the session replays its history onto the other server holding a1 there, and its tokens still equal the
    merged a1 reference."""
    model, s = served
    prompt = _ids(30)
    expected = _reference_greedy(references["a1"], prompt, 10)
    tokens, killed = [], None
    with torch.no_grad(), model.inference_session(max_length=40, adapter="a1") as session:
        logits = model(prompt, session=session).logits
        for i in range(10):
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            if i == 3:
                killed = session.route[0].peer_id
                next(w for w in s.workers if w.peer_id == killed).kill()
            logits = model(token, session=session).logits
        assert session.failovers >= 1 and killed not in {hop.peer_id for hop in session.route}
    assert tokens == expected
