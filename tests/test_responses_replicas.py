"""Stored responses shared by gateway replicas through one real Redis (``--redis-url``): two real uvicorn
gateway processes over the same tiny model, the official SDK as client. A conversation started on one
replica continues, is read and is deleted on the other; owners stay apart; 7 MiB metadata is refused
without the gateway's memory growing. And ``RedisResponsesStore`` itself: TTL, entry size cap, per-owner
count cap, and a Redis outage as a 503.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import psutil
import pytest

from gateway.errors import ServiceUnavailableError
from gateway.responses.redis_store import RedisResponsesStore
from gateway.responses.store import StoredResponse
from tests.conftest import RedisServer, free_port
from tests.gateway_fixtures import REQUEST_TIMEOUT_S, tiny_model_dir
from tests.test_responses_tools import RESPONSE_TOOLS

#: a gateway process: uvicorn serving create_app over LocalBackend (one torch thread), sharing ``redis_url``
_SERVE = """
import sys, torch, uvicorn
torch.set_num_threads(1)
from gateway import GatewaySettings, LocalBackend, create_app
model, port, redis_url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
settings = GatewaySettings(model=model, redis_url=redis_url, default_max_tokens=32)
uvicorn.run(create_app(LocalBackend(model), settings), host="127.0.0.1", port=port, log_level="warning")
"""


@dataclass
class Replica:
    proc: subprocess.Popen
    url: str
    model: str

    def client(self, api_key: str = "x") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss


def _start(model: str, redis_url: str) -> Replica:
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, model, str(port), redis_url], env={**os.environ, **env})
    return Replica(proc, f"http://127.0.0.1:{port}", model.rsplit("/", 1)[-1])


def _wait_healthy(replica: Replica, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            raise RuntimeError(f"gateway process exited with {replica.proc.returncode}")
        try:
            if httpx.get(f"{replica.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"gateway at {replica.url} did not become healthy in {timeout}s")


def _stop(replica: Replica) -> None:
    replica.proc.terminate()
    try:
        replica.proc.wait(10)
    except subprocess.TimeoutExpired:
        replica.proc.kill()
        replica.proc.wait()


@pytest.fixture(scope="module")
def replicas(redis_url: str) -> Iterator[tuple[Replica, Replica]]:
    model = str(tiny_model_dir())
    started = [_start(model, redis_url), _start(model, redis_url)]
    try:
        for replica in started:
            _wait_healthy(replica)
        yield started[0], started[1]
    finally:
        for replica in started:
            _stop(replica)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_conversation_crosses_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    on_a, on_b = a.client(), b.client()
    first = on_a.responses.create(
        model=a.model,
        input="What is the weather in Paris?",
        tools=RESPONSE_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    (call,) = [i for i in first.output if i.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    second = on_b.responses.create(
        model=b.model, input=[result], previous_response_id=first.id, tools=RESPONSE_TOOLS, max_output_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert second.output[0].type == "message" and second.previous_response_id == first.id
    # B rendered the conversation A stored: the same as sending it whole, unstored, to A
    whole = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True), result]
    stateless = on_a.responses.create(
        model=a.model, input=whole, tools=RESPONSE_TOOLS, max_output_tokens=8, temperature=0, store=False
    )
    assert (stateless.output_text, stateless.usage.input_tokens) == (second.output_text, second.usage.input_tokens)
    # either replica reads and deletes either's responses
    assert on_b.responses.retrieve(first.id).output == first.output
    assert on_a.responses.retrieve(second.id).output_text == second.output_text
    on_a.responses.delete(second.id)
    for client in (on_a, on_b):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(second.id)
    # streamed on B, continued on A
    with on_b.responses.stream(model=b.model, input="Hi", max_output_tokens=4, temperature=0) as stream:
        streamed = [e for e in stream][-1].response
    third = on_a.responses.create(model=a.model, input="More", previous_response_id=streamed.id, max_output_tokens=2)
    assert third.previous_response_id == streamed.id


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_owners_stay_apart_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    r = a.client("alice").responses.create(model=a.model, input="hi", max_output_tokens=1)
    bob = b.client("bob")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=b.model, input="x", previous_response_id=r.id, max_output_tokens=1)
    assert b.client("alice").responses.retrieve(r.id).id == r.id


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_megabytes_of_metadata_are_refused_and_not_kept(replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    body = {"model": a.model, "input": "hi", "max_output_tokens": 1, "metadata": {"k": "v" * (7 * 2**20)}}
    with httpx.Client(base_url=a.url, timeout=REQUEST_TIMEOUT_S) as http:
        for _ in range(3):  # allocator warm-up: the first big bodies grow the heap once
            assert http.post("/v1/responses", json=body).status_code == 400
        before = a.rss()
        for _ in range(40):
            r = http.post("/v1/responses", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
        after = a.rss()
    print(f"gateway RSS before/after 40 x 7 MiB metadata: {before / 2**20:.1f} / {after / 2**20:.1f} MiB")
    assert after - before < 32 * 2**20  # 40 kept would be 280 MiB


# ------------------------------------------------------------------------------ the Redis store by itself


def _entry(i: int, owner: str = "o", size: int = 10) -> StoredResponse:
    return StoredResponse(f"resp_{i}", owner, "key", [{"role": "user", "content": "x" * size}], {"id": f"resp_{i}"})


def test_redis_store_bounds(redis_url: str) -> None:
    async def run() -> None:
        store = RedisResponsesStore(redis_url, f"t{time.time_ns()}", ttl_s=1.0, max_entry_bytes=500, max_per_owner=3)
        try:
            assert not await store.put(_entry(0, size=1000))  # over the entry cap
            for i in range(1, 6):
                assert await store.put(_entry(i))
            kept = [i for i in range(1, 6) if await store.get(f"resp_{i}", "o") is not None]
            assert kept == [3, 4, 5]  # the owner's oldest went first, entries and all
            assert await store._client.get().exists(store._entry_key("resp_1")) == 0
            assert await store.put(_entry(9, owner="other"))  # another owner has a count of its own
            assert await store.get("resp_9", "o") is None and not await store.delete("resp_9", "o")
            assert await store.delete("resp_9", "other") and await store.get("resp_9", "other") is None
            await asyncio.sleep(1.2)
            assert await store.get("resp_5", "o") is None  # expired in Redis
        finally:
            await store.aclose()

    asyncio.run(run())


def test_redis_outage_is_a_503(own_redis: RedisServer) -> None:
    async def run() -> None:
        store = RedisResponsesStore(own_redis.url, "outage", socket_timeout_s=0.5)
        try:
            assert await store.put(_entry(1))
            own_redis.kill()
            with pytest.raises(ServiceUnavailableError):
                await store.get("resp_1", "o")
        finally:
            await store.aclose()
            own_redis.start()

    asyncio.run(run())
