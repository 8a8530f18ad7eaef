"""Access control, limits and metrics of the gateway, through real uvicorn servers over the tiny model:
API keys (401), per-key rate limits shared by two replicas on a real redis-server (429), body size (413),
stream slots with a bounded queue (503), the request timeout (504), ``/metrics`` on the gateway and on a
real worker process (``--metrics-port``); plus the pure parts (window arithmetic, token estimates, the
offline tiktoken counter, the key file).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway import GatewaySettings, LocalBackend, create_app
from gateway.admission.auth import load_api_keys, parse_key_file
from gateway.admission.limits import StreamSlots, StreamsSaturatedError, token_counter
from gateway.admission.ratelimit import (
    MemoryWindowStore,
    ModelTokenCounter,
    RateLimiter,
    TiktokenCounter,
    client_address,
    estimate_tokens,
    wait_seconds,
)
from gateway.metrics import GatewayMetrics
from tests.conftest import free_port
from tests.gateway_fixtures import (
    REQUEST_TIMEOUT_S,
    Gateway,
    InstrumentedBackend,
    assert_greedy,
    chat_prompt_ids,
    start_gateway,
    tiny_model_dir,
    tiny_tokenizer,
)

KEY = "sk-test-good-key"
NO_EOS = {"2": -100, "0": -100}  # the tiny model's EOS ids: keep streams going for as long as we need
HELLO = [{"role": "user", "content": "Hello there"}]


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def backend() -> InstrumentedBackend:
    return InstrumentedBackend(LocalBackend(tiny_model_dir()))


@pytest.fixture(scope="module")
def guarded(backend: InstrumentedBackend) -> Iterator[Gateway]:
    """Keys required; a 2 KiB body limit; one stream at a time with one waiting."""
    gw = start_gateway(
        backend,
        api_keys=[KEY],
        max_body_bytes=2048,
        max_concurrent_streams=1,
        max_queued_streams=1,
        stream_queue_timeout_s=REQUEST_TIMEOUT_S,
        retry_after_s=3,
        default_max_tokens=8,
    )
    yield gw
    gw.server.stop()


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _sdk(gw: Gateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.server.base_url, api_key=key, timeout=REQUEST_TIMEOUT_S, max_retries=0)


def scrape(gw: Gateway) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` parsed: (sample name, labels) → value."""
    r = httpx.get(f"{gw.url}/metrics", timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def _envelope(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    assert r.headers.get("x-request-id")
    return error


# --------------------------------------------------------------------------------------------------- auth


def test_missing_or_wrong_key_is_401_in_the_envelope(guarded: Gateway) -> None:
    body = {"model": guarded.model, "messages": HELLO, "max_tokens": 1}
    with guarded.http() as http:
        for headers in ({}, _auth("sk-wrong"), {"Authorization": f"Basic {KEY}"}):
            r = http.post("/v1/chat/completions", json=body, headers=headers)
            error = _envelope(r, 401, "invalid_api_key")
            assert error["type"] == "invalid_request_error"
            assert r.headers["www-authenticate"] == "Bearer"
        assert KEY not in http.post("/v1/completions", json={}, headers=_auth(KEY + "x")).text
        # the open paths stay open
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _sdk(guarded, "sk-wrong").models.list()


def test_right_key_works_through_the_openai_sdk(guarded: Gateway) -> None:
    client = _sdk(guarded)
    assert [m.id for m in client.models.list().data] == [guarded.model]  # its name, not its path
    r = client.chat.completions.create(model=guarded.model, messages=HELLO, max_tokens=3, temperature=0)
    assert_greedy(r, chat_prompt_ids(HELLO), 3)  # served, and served right


def test_keys_come_from_env_and_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_key_file("# team keys\nsk-a\n\n  sk-b   # ci\n#sk-c\n") == ["sk-a", "sk-b"]
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("sk-file  # one\n")
    monkeypatch.setenv("SWARMSERVE_API_KEYS", "sk-env1, sk-env2")
    settings = GatewaySettings(api_keys_file=str(keys_file))
    assert load_api_keys(settings.api_keys, settings.api_keys_file) == ["sk-env1", "sk-env2", "sk-file"]
    assert "sk-env1" not in repr(settings)
    with pytest.raises(FileNotFoundError):
        create_app(_StubBackend(), GatewaySettings(api_keys_file=str(tmp_path / "no")))


class _StubBackend:
    """Enough of a backend to build an app (never serves)."""

    model_id = "stub"
    max_context = 64

    def __init__(self) -> None:
        self.tokenizer = tiny_tokenizer()

    def open_session(self, max_length: int, session_id: str | None = None) -> Any:
        raise NotImplementedError

    def swarm_state(self) -> dict:
        return {}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------- bodies


def test_oversize_body_is_413_before_parsing(guarded: Gateway) -> None:
    with guarded.http() as http:
        big = b"{" + b" " * 4096  # not even JSON: a 400 would mean it was parsed
        r = http.post("/v1/chat/completions", content=big, headers=_auth())
        _envelope(r, 413, "request_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for _ in range(8):
                yield b" " * 512

        r = http.post("/v1/completions", content=chunks(), headers=_auth())
        _envelope(r, 413, "request_too_large")
        small = {"model": guarded.model, "prompt": "hi", "max_tokens": 1}
        assert http.post("/v1/completions", json=small, headers=_auth()).status_code == 200


# ----------------------------------------------------------------------------------------- stream slots


def _stream(gw: Gateway, max_tokens: int, out: list) -> None:
    body = {
        "model": gw.model,
        "messages": HELLO,
        "max_tokens": max_tokens,
        "stream": True,
        "logit_bias": NO_EOS,
    }
    with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body, headers=_auth()) as r:
        out.append(r.status_code)
        out.append([line for line in r.iter_lines() if line])


def _wait(predicate: Any, timeout: float = REQUEST_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_streams_beyond_slots_and_queue_are_503_with_retry_after(guarded: Gateway) -> None:
    slots: StreamSlots = guarded.server.app.state.stream_slots
    first: list = []
    second: list = []
    with guarded.backend.tweaked(step_delay_s=0.05):
        holder = threading.Thread(target=_stream, args=(guarded, 30, first))
        holder.start()
        _wait(lambda: slots.active == 1 and guarded.backend.steps > 0)
        waiter = threading.Thread(target=_stream, args=(guarded, 2, second))
        waiter.start()
        _wait(lambda: slots.queued == 1)

        body = {"model": guarded.model, "messages": HELLO, "max_tokens": 1, "stream": True}
        with guarded.http() as http:
            r = http.post("/v1/chat/completions", json=body, headers=_auth())
            error = _envelope(r, 503, "streams_saturated")
            assert r.headers["retry-after"] == "3" and "1 choices decoding at once" in error["message"]
            # a non-streaming request needs a slot too: a flood of them is no way around the limit
            for _ in range(3):
                plain = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=_auth())
                _envelope(plain, 503, "streams_saturated")
                assert plain.headers["retry-after"] == "3"
        metrics = scrape(guarded)
        assert sample(metrics, "swarmserve_active_streams") == 1
        assert sample(metrics, "swarmserve_queued_streams") == 1
        holder.join(REQUEST_TIMEOUT_S)
        waiter.join(REQUEST_TIMEOUT_S)
    assert first[0] == second[0] == 200
    assert first[1][-1] == second[1][-1] == "data: [DONE]"
    _wait(lambda: slots.active == 0 and slots.queued == 0)  # released once the last byte went out


async def test_a_queued_stream_that_waits_too_long_gets_503() -> None:
    slots = StreamSlots(1, max_queued=2, queue_timeout_s=0.05, retry_after_s=1)
    async with slots.slot():
        with pytest.raises(StreamsSaturatedError, match="No stream slot freed up"):
            await slots.acquire()
        assert slots.queued == 0
    assert slots.active == 0


# ------------------------------------------------------------------------------------------- timeouts


def test_request_timeout_is_504_or_an_error_frame(backend: InstrumentedBackend) -> None:
    gw = start_gateway(backend, request_timeout_s=0.3)
    try:
        body = {"model": gw.model, "messages": HELLO, "max_tokens": 50, "logit_bias": NO_EOS}
        with backend.tweaked(step_delay_s=0.05), gw.http() as http:
            _envelope(http.post("/v1/chat/completions", json=body), 504, "timeout")
            r = http.post("/v1/chat/completions", json={**body, "stream": True})
            assert r.status_code == 200
            frames = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert '"code":"timeout"' in frames[-2] and frames[-1] == "data: [DONE]"
        assert backend.wait_all_closed()
        metrics = scrape(gw)
        assert sample(metrics, "swarmserve_errors_total", code="timeout") == 2  # the 504 and the frame
    finally:
        gw.server.stop()


# ------------------------------------------------------------------------------------------ rate limits


#: keys of the replicas below, fresh per run so counters start at 0 even on a long-lived Redis (budgets
#: follow verified keys only: on an open gateway every one of these requests would share one address)
REPLICA_KEYS = [f"sk-{uuid.uuid4().hex}" for _ in range(5)]


@pytest.fixture(scope="module")
def replicas(backend: InstrumentedBackend, redis_url: str) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateways counting in one Redis: 3 requests and 200 tokens per minute per key."""
    kw = {
        "redis_url": redis_url,
        "rate_limit_rpm": 3,
        "rate_limit_tpm": 200,
        "affinity": False,
        "api_keys": REPLICA_KEYS,
    }
    one, two = start_gateway(backend, **kw), start_gateway(backend, **kw)
    yield one, two
    one.server.stop()
    two.server.stop()


def test_request_limit_is_shared_by_replicas_through_redis(replicas: tuple[Gateway, Gateway]) -> None:
    one, two = replicas
    key = REPLICA_KEYS[0]
    body = {"model": one.model, "prompt": "hi", "max_tokens": 1}
    with one.http() as h1, two.http() as h2:
        first = h1.post("/v1/completions", json=body, headers=_auth(key))
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "3"
        assert first.headers["x-ratelimit-remaining-requests"] == "2"
        assert h1.post("/v1/completions", json=body, headers=_auth(key)).status_code == 200
        assert h2.post("/v1/completions", json=body, headers=_auth(key)).status_code == 200
        r = h2.post("/v1/completions", json=body, headers=_auth(key))  # the 4th, on the other replica
        error = _envelope(r, 429, "rate_limit_exceeded")
        assert error["type"] == "requests" and "RPM" in error["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 120  # sliding: up to two windows
        # another key has its own budget; other routes are not limited
        assert h2.post("/v1/completions", json=body, headers=_auth(REPLICA_KEYS[1])).status_code == 200
        assert h2.get("/v1/models", headers=_auth(key)).status_code == 200
        # the Responses API counts against the same budget
        responses = {"model": one.model, "input": "hi", "max_output_tokens": 1}
        assert h1.post("/v1/responses", json=responses, headers=_auth(key)).status_code == 429
        assert h1.post("/v1/responses", json=responses, headers=_auth(REPLICA_KEYS[2])).status_code == 200
    with pytest.raises(openai.RateLimitError):
        _sdk(one, key).completions.create(model=one.model, prompt="hi", max_tokens=1)


def test_token_limit_counts_prompt_and_max_tokens(replicas: tuple[Gateway, Gateway]) -> None:
    one, two = replicas
    key = REPLICA_KEYS[3]
    with one.http() as h1, two.http() as h2:
        ok = {"model": one.model, "prompt": "hi", "max_tokens": 150}
        r = h1.post("/v1/completions", json=ok, headers=_auth(key))
        assert r.status_code == 200
        used = 200 - int(r.headers["x-ratelimit-remaining-tokens"])
        assert used == 150 + len(tiny_tokenizer()("hi", add_special_tokens=False)["input_ids"])
        r = h2.post("/v1/completions", json={**ok, "max_tokens": 100}, headers=_auth(key))
        error = _envelope(r, 429, "rate_limit_exceeded")
        assert "TPM" in error["message"] and "requested" in error["message"]
        too_big = h2.post("/v1/completions", json={**ok, "max_tokens": 500}, headers=_auth(REPLICA_KEYS[4]))
        assert "Request too large" in _envelope(too_big, 429, "rate_limit_exceeded")["message"]


def test_made_up_tokens_do_not_reset_an_open_gateways_limit(backend: InstrumentedBackend) -> None:
    """No keys configured: budgets follow the client's address, so a fresh bearer token per request buys
    nothing; a trusted proxy's X-Forwarded-For names the client, anybody else's is ignored."""
    gw = start_gateway(backend, rate_limit_rpm=2, affinity=False)
    body = {"model": gw.model, "prompt": "hi", "max_tokens": 1}
    try:
        with gw.http() as http:
            codes = [
                http.post("/v1/completions", json=body, headers=_auth(f"sk-made-up-{i}")).status_code for i in range(3)
            ]
            assert codes == [200, 200, 429]
            spoofed = {"X-Forwarded-For": "203.0.113.9", **_auth("sk-another")}
            assert http.post("/v1/completions", json=body, headers=spoofed).status_code == 429
    finally:
        gw.server.stop()
    behind = {"type": "http", "client": ("10.0.0.2", 1234), "headers": [(b"x-forwarded-for", b"6.6.6.6, 203.0.113.9")]}
    assert client_address(behind, {"10.0.0.2"}) == "203.0.113.9"  # the address the proxy saw
    assert client_address(behind, {"10.0.0.2", "203.0.113.9"}) == "6.6.6.6"
    assert client_address(behind) == "10.0.0.2"  # an untrusted peer's header is not believed


async def test_limits_fall_back_to_memory_when_redis_is_down() -> None:
    limiter = RateLimiter(2, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    try:
        decisions = [await limiter.check("key:a", 0) for _ in range(3)]
    finally:
        await limiter.aclose()
    assert [d.admitted for d in decisions] == [True, True, False]
    assert decisions[2].refused_by == "requests" and decisions[2].retry_after_s > 0


async def test_sliding_window_in_memory() -> None:
    now = [600.0]  # the start of a window
    limiter = RateLimiter(rpm=2, memory=MemoryWindowStore(clock=lambda: now[0]))
    assert (await limiter.check("k", 0)).admitted and (await limiter.check("k", 0)).admitted
    refused = await limiter.check("k", 0)
    assert not refused.admitted and refused.retry_after_s == pytest.approx(90.0)  # 60 to go, then half out
    now[0] += 90.0  # half of the previous window's 2 requests still count
    assert (await limiter.check("k", 0)).admitted
    assert not (await limiter.check("k", 0)).admitted
    assert (await limiter.check("other", 0)).admitted


def test_wait_seconds() -> None:
    assert wait_seconds(0, 0, 0, 60, 1, 2) == 0
    assert wait_seconds(0, 0, 0, 60, 3, 2) == float("inf")
    assert wait_seconds(10, 0, 30, 60, 1, 5) == pytest.approx(6.0)  # 10·(1 − (30 + t)/60) + 1 ≤ 5
    assert wait_seconds(0, 5, 10, 60, 1, 5) == pytest.approx(62.0)  # next window, then 5·(1 − t/60) ≤ 4


# ------------------------------------------------------------------------------------------ estimates


def test_token_estimates_of_every_request_shape() -> None:
    counter = ModelTokenCounter(tiny_tokenizer())
    hi = counter.count("hi")
    kw = {"default_max_tokens": 10, "max_context": 100, "max_choices": 4}
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"text": "hi"}]}]}
    assert estimate_tokens("/v1/chat/completions", chat, counter, **kw) == 3 + 2 * (4 + hi) + 10
    two = {**chat, "max_completion_tokens": 5, "max_tokens": 7, "n": 2}
    assert estimate_tokens("/v1/chat/completions", two, counter, **kw) == 3 + 2 * (4 + hi) + 5 * 2
    path = "/v1/completions"
    assert estimate_tokens(path, {"prompt": "hi", "max_tokens": 7}, counter, **kw) == hi + 7
    assert estimate_tokens(path, {"prompt": [1, 2, 3], "max_tokens": 1000}, counter, **kw) == 3 + 100
    assert estimate_tokens(path, {"prompt": ["hi", [5, 6]], "n": 3}, counter, **kw) == hi + 2 + 10 * 4
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with_tools = estimate_tokens("/v1/chat/completions", {**chat, "tools": tools}, counter, **kw)
    assert with_tools == 3 + 2 * (4 + hi) + 10 + counter.count(json.dumps(tools))
    responses = {"input": "hi", "instructions": "hi", "max_output_tokens": 6}
    assert estimate_tokens("/v1/responses", responses, counter, **kw) == 3 + (4 + hi) + hi + 6
    listed = {"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": "hi"}]}
    assert estimate_tokens("/v1/responses", listed, counter, **kw) == 3 + 2 * (4 + hi) + 10
    for junk in (None, [], {"prompt": {"x": 1}, "max_tokens": "9", "n": True}):
        assert estimate_tokens(path, junk, counter, **kw) in (0, 10)


def _write_bpe(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))


def test_tiktoken_counter_from_a_local_bpe_file(tmp_path: Path) -> None:
    """tiktoken downloads its encodings on first use; an encoding built from a local file needs no network."""
    pytest.importorskip("tiktoken")
    ranks = {bytes([i]): i for i in range(256)}
    for merged in (b"he", b"ll", b"hell", b"hello"):
        ranks[merged] = len(ranks)
    bpe = tmp_path / "tiny.tiktoken"
    _write_bpe(bpe, ranks)
    counter = TiktokenCounter.from_bpe_file(bpe)
    assert counter.count("hello") == 1
    assert counter.count("hello hello") == 3  # pieces "hello" and " hello"; no merge takes in the space
    assert counter.count("<|endoftext|>") == len("<|endoftext|>")  # plain text, never a special token
    settings = GatewaySettings(rate_limit_tiktoken_file=str(bpe))
    assert isinstance(token_counter(settings, tiny_tokenizer()), TiktokenCounter)
    assert isinstance(token_counter(GatewaySettings(), tiny_tokenizer()), ModelTokenCounter)
    body = {"prompt": "hello hello", "max_tokens": 4}
    assert estimate_tokens("/v1/completions", body, counter, default_max_tokens=1, max_context=9, max_choices=1) == 7


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_count_requests_errors_latency_and_tokens(guarded: Gateway) -> None:
    before = scrape(guarded)
    client = _sdk(guarded)
    plain = client.chat.completions.create(model=guarded.model, messages=HELLO, max_tokens=4, logit_bias=NO_EOS)
    streamed = client.chat.completions.create(
        model=guarded.model,
        messages=HELLO,
        max_tokens=3,
        logit_bias=NO_EOS,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None][0]
    with guarded.http() as http:
        http.post("/v1/chat/completions", json={"messages": []}, headers=_auth())  # 400
        http.get("/v1/models", headers=_auth("sk-nope"))  # 401
        http.get("/no/such/path", headers=_auth())  # 404, one label for every unknown path
    after = scrape(guarded)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    chat = "/v1/chat/completions"
    assert delta("swarmserve_requests_total", route=chat, method="POST", status="200") == 2
    assert delta("swarmserve_requests_total", route=chat, method="POST", status="400") == 1
    assert delta("swarmserve_requests_total", route="/v1/models", method="GET", status="401") == 1
    assert delta("swarmserve_requests_total", route="<unmatched>", method="GET", status="404") == 1
    assert delta("swarmserve_errors_total", code="invalid_api_key") == 1
    assert delta("swarmserve_errors_total", code="invalid_request_error") == 1  # code null: the type
    assert delta("swarmserve_errors_total", code="not_found") == 1
    assert delta("swarmserve_time_to_first_token_seconds_count") == 2
    assert delta("swarmserve_inter_token_latency_seconds_count") == (4 - 1) + (3 - 1)
    assert delta("swarmserve_completion_tokens_total") == plain.usage.completion_tokens + usage.completion_tokens
    assert delta("swarmserve_prompt_tokens_total") == plain.usage.prompt_tokens + usage.prompt_tokens
    assert delta("swarmserve_request_duration_seconds_count", route=chat) == 3
    assert sample(after, "swarmserve_active_streams") == 0


def test_observe_usage_counts_cache_hits() -> None:
    m = GatewayMetrics()
    m.observe_usage(10, 2)
    m.observe_usage(12, 3, cached_tokens=8)
    assert m.registry.get_sample_value("swarmserve_cache_reuse_hits_total") == 1
    assert m.registry.get_sample_value("swarmserve_cached_tokens_total") == 8
    assert m.registry.get_sample_value("swarmserve_prompt_tokens_total") == 22
    assert GatewayMetrics().registry.get_sample_value("swarmserve_prompt_tokens_total") == 0  # own registry


@pytest.mark.slow
def test_worker_metrics_port(tiny_llama: str) -> None:
    import torch

    from swarm_client import AutoDistributedModelForCausalLM
    from tests.swarm_fixtures import swarm

    port = free_port()
    with swarm(tiny_llama, ["0:4"], "--metrics-port", str(port), "--cache-tokens", "4096") as s:
        line = s.workers[0].wait_for("worker metrics:", timeout=30)
        url = line.split("worker metrics:", 1)[1].strip()
        assert url == f"http://127.0.0.1:{port}/metrics"

        def read() -> dict:
            text = httpx.get(url, timeout=REQUEST_TIMEOUT_S).text
            return {
                (x.name, frozenset(x.labels.items())): x.value
                for family in text_string_to_metric_families(text)
                for x in family.samples
            }

        idle = read()
        assert sample(idle, "swarmserve_worker_cache_tokens_free") == 4096
        assert sample(idle, "swarmserve_worker_cache_tokens_used") == 0
        assert sample(idle, "swarmserve_worker_blocks", start="0", end="4") == 4
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[s.initial_peers])
        try:
            ids = torch.tensor([[1, 5, 9, 13]])
            model.generate(ids, max_new_tokens=3, do_sample=False)
        finally:
            model.shutdown()
        busy = read()
        steps = sample(busy, "swarmserve_worker_step_seconds_count", rpc="inference")
        assert steps >= 3  # the prefill and the decode steps
        assert sample(busy, "swarmserve_worker_tokens_processed_total", rpc="inference") == 4 + 2
