"""The bounds of ``/v1/responses``' stored responses (issue 35): ``metadata``, ``user`` and
``safety_identifier`` within OpenAI's limits (a 400 naming them), the in-memory store's byte budget (the
oldest go first), a conversation too big to keep refused before it runs, and on an open gateway a stored
response owned by its caller (bearer token, else client address) — anyone else gets a 404.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.responses.store import ResponsesStore, StoredResponse
from tests.gateway_fixtures import REQUEST_TIMEOUT_S, Gateway, shared_gateway, start_gateway


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


def _post(gw: Gateway, body: dict, **kw) -> httpx.Response:
    with gw.http() as http:
        return http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, **body}, **kw)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"user": "u" * 257}, "user"),
        ({"safety_identifier": "s" * 129}, "safety_identifier"),
    ],
)
def test_bounds_are_400s_naming_the_field(gw: Gateway, body: dict, param: str) -> None:
    r = _post(gw, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and len(r.text) < 1000  # the refused value is not echoed


def test_values_at_the_bounds_are_kept(gw: Gateway) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = _post(gw, {"metadata": metadata, "user": "u" * 256, "safety_identifier": "s" * 128})
    assert r.status_code == 200, r.text
    with gw.http() as http:
        kept = http.get(f"/v1/responses/{r.json()['id']}").json()
    assert kept["metadata"] == metadata and kept["user"] == "u" * 256


def test_store_is_bounded() -> None:
    now = [0.0]
    store = ResponsesStore(max_entries=2, ttl_s=10, clock=lambda: now[0])

    def put(i: int, owner: str | None = "k") -> None:
        asyncio.run(store.put(StoredResponse(f"resp_{i}", owner, "key", [], {})))

    def get(i: int, owner: str | None) -> StoredResponse | None:
        return asyncio.run(store.get(f"resp_{i}", owner))

    put(1), put(2), put(3)
    assert (get(1, "k"), len(store)) == (None, 2)  # the oldest went first
    assert get(3, "k") is not None and get(3, "other") is None
    now[0] = 10.5
    assert get(3, "k") is None and len(store) == 0  # expired
    put(4, None)
    assert get(4, None) is not None and get(4, "k") is None


def test_the_memory_store_keeps_a_byte_budget() -> None:
    store = ResponsesStore(max_entries=100, max_bytes=10_000, max_entry_bytes=4_000)

    def entry(i: int, size: int) -> StoredResponse:
        return StoredResponse(f"resp_{i}", "k", "key", [{"role": "user", "content": "x" * size}], {})

    async def run() -> None:
        assert not await store.put(entry(0, 5_000))  # over the entry cap: refused
        for i in range(1, 8):
            assert await store.put(entry(i, 2_000))
            assert store.bytes <= 10_000
        kept = [i for i in range(1, 8) if await store.get(f"resp_{i}", "k") is not None]
        assert kept == [4, 5, 6, 7]  # the oldest went first
        assert await store.delete("resp_7", "k") and not await store.delete("resp_6", "other")
        assert len(store) == 3 and store.bytes == 3 * (store.bytes // 3)

    asyncio.run(run())


@pytest.fixture(scope="module")
def small(gw: Gateway) -> Iterator[Gateway]:
    """A second app over the shared backend that keeps responses of at most 4 kB."""
    small = start_gateway(gw.backend, responses_max_entry_bytes=4000)
    yield small
    small.server.stop()


def test_a_conversation_too_big_to_keep_is_refused_unless_not_stored(small: Gateway) -> None:
    client = small.client()
    big = "word " * 900  # ~4.5 kB, within the tiny model's context window
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=small.model, input=big, max_output_tokens=1)
    assert info.value.body["param"] == "store" and "store: false" in info.value.message
    r = client.responses.create(model=small.model, input=big, max_output_tokens=1, store=False)
    assert r.status == "incomplete" and r.store is False
    # a chain grows until its stored conversation is too big: that turn is refused, not silently dropped
    chain = [client.responses.create(model=small.model, input="word " * 150, max_output_tokens=1).id]
    with pytest.raises(openai.BadRequestError) as info:
        for _ in range(10):
            r = client.responses.create(
                model=small.model, input="word " * 150, previous_response_id=chain[-1], max_output_tokens=1
            )
            chain.append(r.id)
    assert info.value.body["param"] == "store" and len(chain) >= 2
    assert [client.responses.retrieve(i).id for i in chain] == chain  # every turn served was kept


def test_open_gateway_responses_belong_to_their_caller(gw: Gateway) -> None:
    """No API keys: a bearer token (unverified) or else the client's address owns a response."""
    body = {"input": "hi", "max_output_tokens": 1}
    here = httpx.Client(base_url=gw.url, timeout=REQUEST_TIMEOUT_S)
    elsewhere = httpx.Client(
        base_url=gw.url, timeout=REQUEST_TIMEOUT_S, transport=httpx.HTTPTransport(local_address="127.0.0.2")
    )
    with here, elsewhere:
        created = here.post("/v1/responses", json=body).json()["id"]
        assert here.get(f"/v1/responses/{created}").status_code == 200
        for attempt in (
            lambda: elsewhere.get(f"/v1/responses/{created}"),
            lambda: elsewhere.post("/v1/responses", json={**body, "previous_response_id": created}),
            lambda: elsewhere.delete(f"/v1/responses/{created}"),
            lambda: here.get(f"/v1/responses/{created}", headers={"Authorization": "Bearer someone"}),
        ):
            r = attempt()
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert here.post("/v1/responses", json={**body, "previous_response_id": created}).status_code == 200
    # with the SDK: the token owns it, whichever address sends it
    alice, bob = gw.client(api_key="alice"), gw.client(api_key="bob")
    r = alice.responses.create(model=gw.model, input="hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    assert alice.responses.retrieve(r.id).id == r.id


def test_rate_limit_estimate_counts_tools_and_call_items() -> None:
    """The TPM estimate of a Responses request counts its tools and its calls' arguments and outputs, as
    chat's counts tools and messages (gateway/admission/token_estimates.py)."""
    from gateway.admission.token_estimates import ModelTokenCounter, estimate_tokens
    from tests.gateway_fixtures import tiny_tokenizer

    counter = ModelTokenCounter(tiny_tokenizer())
    kw = {"default_max_tokens": 10, "max_context": 100, "max_choices": 4}
    tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
    call = {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": '{"zone": "UTC"}'}
    output = {"type": "function_call_output", "call_id": "c", "output": "12:00"}
    body = {"input": [call, output], "tools": tools, "max_output_tokens": 6}
    expected = 3 + 2 * 4 + counter.count('get_time {"zone": "UTC"}') + counter.count("12:00") + 6
    assert estimate_tokens("/v1/responses", body, counter, **kw) == expected + counter.count(json.dumps(tools))
