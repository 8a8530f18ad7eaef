"""LoRA adapters at the gateway: each adapter the swarm serves whole is a model (``BASE:NAME``), selected by
the request's ``model``; an adapter nobody serves is a 404 ``model_not_found``; session affinity never
resumes a cache computed with another adapter.

The pure parts (gateway/backends/adapters.py) have fast unit tests; the rest runs on real parts: a DHT and two worker
processes serving adapters ``a1`` and ``a2`` of the tiny Llama, ``SwarmBackend``, real uvicorn, a real
Redis as the affinity store, the official OpenAI SDK, against 🤗 + PEFT with each adapter merged.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import openai
import pytest

from gateway.affinity.sessions import InMemoryAffinityStore
from gateway.backends.adapters import ServedModel, parse_adapter_aliases, select_model, served_adapters, served_models
from gateway.errors import ModelNotFoundError
from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from tests.gateway_fixtures import Gateway, assert_greedy, chat_prompt_ids, conversation, swarm_gateway
from tests.swarm_fixtures import Swarm

# ------------------------------------------------------------------------------------------------ unit tests


def _span(peer: str, start: int, end: int, adapters: tuple[str, ...], state=ServerState.ONLINE) -> RemoteSpanInfo:
    info = ServerInfo(state=state, start_block=start, end_block=end, throughput=1.0, adapters=adapters)
    return RemoteSpanInfo(peer, start, end, info)


def test_served_adapters_need_online_servers_covering_every_block() -> None:
    spans = {
        "p1": _span("p1", 0, 2, ("a1", "a2", "half")),
        "p2": _span("p2", 2, 4, ("a1", "a2")),
        "p3": _span("p3", 1, 4, ("a3",)),
        "p4": _span("p4", 0, 1, ("a3", "a2"), state=ServerState.JOINING),
    }
    assert served_adapters(spans, 4) == ["a1", "a2"]  # a3 lacks block 0 (its server is only joining)
    spans["p5"] = _span("p5", 0, 2, ("a3",))
    assert served_adapters(spans, 4) == ["a1", "a2", "a3"]
    assert served_adapters({}, 4) == []


def test_model_names_select_adapters_and_unknown_names_list_what_exists() -> None:
    aliases = parse_adapter_aliases(["a1=support-bot", "gone=old-bot"])
    assert aliases == {"support-bot": "a1", "old-bot": "gone"}
    models = served_models("/models/tiny-llama", ["a1", "a2"], aliases)
    assert [m.id for m in models] == [
        "/models/tiny-llama",
        "/models/tiny-llama:a1",
        "/models/tiny-llama:a2",
        "support-bot",
    ]
    assert select_model(None, models) == ServedModel("/models/tiny-llama")
    assert select_model("tiny-llama", models) == ServedModel("/models/tiny-llama")
    assert select_model("/models/tiny-llama:a2", models).adapter == "a2"
    assert select_model("tiny-llama:a1", models).adapter == "a1"
    assert select_model("support-bot", models).adapter == "a1"
    for unknown in ("tiny-llama:nope", "old-bot", "tiny-llama:", "a1"):
        with pytest.raises(ModelNotFoundError) as err:
            select_model(unknown, models)
        assert err.value.code == "model_not_found" and "/models/tiny-llama:a2" in err.value.message
    for bad in (["a1"], ["=x"], ["a1=x", "a2=x"], ["bad name=x"]):
        with pytest.raises(ValueError):
            parse_adapter_aliases(bad)


async def test_affinity_records_of_one_adapter_are_invisible_to_another() -> None:
    store = InMemoryAffinityStore(namespace="lora-unit", block_tokens=4)
    tokens = list(range(12))
    for adapter in ("a1", None):
        for key in (None, "conversation"):
            claim = await store.claim(tokens[:8], key, "owner", adapter)
            assert claim is not None and claim.record is None
            assert await store.save(claim, {"adapter": adapter}, tokens, "replica")
    for adapter in ("a1", None, "a2"):
        for key in (None, "conversation"):
            claim = await store.claim(tokens, key, "owner", adapter)
            assert claim is not None
            found = None if claim.record is None else claim.record.state["adapter"]
            assert found == (adapter if adapter != "a2" else None), (adapter, key)


# ------------------------------------------------------------------------------------------- the real swarm

ADAPTERS = {"a1": 1, "a2": 2}  # name → seed


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    from swarm_client.tiny_lora import make_random_lora

    root = tmp_path_factory.mktemp("gateway-lora")
    return {name: make_random_lora(tiny_llama, root / name, seed=seed) for name, seed in ADAPTERS.items()}


@pytest.fixture(scope="module")
def merged_dirs(
    tiny_llama: str, adapter_dirs: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str | None, str]:
    """Model directories of the tiny Llama with each adapter merged by PEFT (None: the base model)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out: dict[str | None, str] = {None: tiny_llama}
    for name, path in adapter_dirs.items():
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
        target = tmp_path_factory.mktemp(f"merged-{name}")
        merged.save_pretrained(target)
        AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(target)
        out[name] = str(target)
    return out


@pytest.fixture(scope="module")
def lora_gw(tiny_llama: str, adapter_dirs: dict[str, pathlib.Path], redis_url: str) -> Iterator[tuple[Gateway, Swarm]]:
    served = [f"{name}={path}" for name, path in adapter_dirs.items()]
    s = Swarm(tiny_llama)
    try:
        for span in ("0:2", "2:4"):
            s.add_worker("--throughput", "1000", "--adapters", *served, blocks=span)
        with swarm_gateway(tiny_llama, s.initial_peers, redis_url=redis_url, adapter_aliases=["a2=second"]) as gw:
            yield gw, s
    finally:
        s.close()


def _names(gw: Gateway) -> dict[str | None, str]:
    return {None: gw.model, **{name: f"{gw.model}:{name}" for name in ADAPTERS}}


@pytest.mark.slow
def test_models_lists_each_served_adapter(lora_gw: tuple[Gateway, Swarm]) -> None:
    gw, _ = lora_gw
    base = gw.model  # the directory's name: never the path
    listed = {m.id: m for m in gw.client().models.list().data}
    assert list(listed) == [base, f"{base}:a1", f"{base}:a2", "second"]
    assert listed[f"{base}:a1"].model_dump()["parent"] == base and listed[base].model_dump()["parent"] is None
    assert gw.client().models.retrieve(f"{gw.model}:a2").id == f"{base}:a2"


@pytest.mark.slow
def test_each_adapter_answers_as_peft_merged(lora_gw: tuple[Gateway, Swarm], merged_dirs: dict) -> None:
    gw, _ = lora_gw
    client = gw.client()
    messages = [{"role": "user", "content": "Which adapter answers this?"}]
    prompt = chat_prompt_ids(messages, gw.backend.model_id)
    texts = {}
    for adapter, model in _names(gw).items():
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True)
        assert r.model == model  # the name /v1/models lists
        texts[adapter] = assert_greedy(r, prompt, 8, merged_dirs[adapter]).token_ids
    assert len(set(map(tuple, texts.values()))) == 3  # the adapters do change the output
    r = client.completions.create(model="second", prompt="Adapters are", max_tokens=6, temperature=0)
    assert r.model == "second"


@pytest.mark.slow
def test_an_adapter_nobody_serves_is_a_404_listing_the_served_models(lora_gw: tuple[Gateway, Swarm]) -> None:
    gw, _ = lora_gw
    client = gw.client()
    for call in (
        lambda: client.chat.completions.create(model=f"{gw.model}:nope", messages=[{"role": "user", "content": "hi"}]),
        lambda: client.completions.create(model=f"{gw.model}:nope", prompt="hi"),
        lambda: client.models.retrieve(f"{gw.model}:nope"),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        body = err.value.body
        assert body["code"] == "model_not_found"
        assert f"{gw.model}:a1" in body["message"] and f"{gw.model}:a2" in body["message"]
        assert gw.backend.model_id not in body["message"]  # names, never the model's path


@pytest.mark.slow
@pytest.mark.parametrize("user", [None, "lora-conversation"])
def test_a_conversation_never_resumes_another_adapters_cache(
    lora_gw: tuple[Gateway, Swarm], merged_dirs: dict, user: str | None
) -> None:
    """Turn 2 of a conversation resumes turn 1's cache under the same adapter only; the same turn 2 under
    another adapter (or the base model) prefills afresh and answers as that adapter merged would."""
    gw, _ = lora_gw
    client = gw.client()
    names = _names(gw)
    extra = {"user": user} if user else {}
    messages = [*conversation(f"lora-affinity-{user}"), {"role": "user", "content": "Tell me about adapters."}]
    first = client.chat.completions.create(model=names["a1"], messages=messages, max_tokens=8, temperature=0, **extra)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what do they change?"},
    ]
    prompt = chat_prompt_ids(messages, gw.backend.model_id)
    for adapter, reused in (("a1", True), ("a2", False), (None, False), ("a2", True)):
        r = client.chat.completions.create(
            model=names[adapter], messages=messages, max_tokens=8, temperature=0, **extra
        )
        assert_greedy(r, prompt, 8, merged_dirs[adapter])
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == reused, (adapter, cached)
