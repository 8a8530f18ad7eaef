"""The gateway over a real swarm: a DHT and two worker processes (blocks 0:2 and 2:4 of a tiny Llama),
``SwarmBackend`` in this process, real uvicorn, the official OpenAI SDK.

The swarm path must be *exact*: greedy output and logprobs equal what ``LocalBackend`` serves from the
same checkpoint. A client that hangs up mid-stream must leave no KV cache behind on any server. The last
test stops one worker, so it runs last and the module's swarm is not reused after it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway import LocalBackend
from gateway.backends.swarm import SwarmBackend
from gateway.decode.engine import eos_token_ids
from tests.gateway_fixtures import (
    Gateway,
    assert_greedy,
    chat_prompt_ids,
    collect_stream,
    start_gateway,
    swarm_gateway,
    text_prompt_ids,
)
from tests.swarm_fixtures import Swarm, swarm

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Tell me about the swarm."}]
SPANS = ["0:2", "2:4"]


@pytest.fixture(scope="module")
def the_swarm(tiny_llama: str) -> Iterator[Swarm]:
    # a fixed throughput skips the workers' benchmark (seconds of startup) and makes routing deterministic
    with swarm(tiny_llama, SPANS, "--throughput", "1000") as s:
        yield s


@pytest.fixture(scope="module")
def swarm_gw(the_swarm: Swarm, tiny_llama: str) -> Iterator[Gateway]:
    with swarm_gateway(tiny_llama, the_swarm.initial_peers) as gw:
        yield gw


@pytest.fixture(scope="module")
def local_gw(tiny_llama: str) -> Iterator[Gateway]:
    backend = LocalBackend(tiny_llama)
    gw = start_gateway(backend)
    yield gw
    gw.server.stop()
    backend.close()


@pytest.fixture(scope="module")
def client(swarm_gw: Gateway) -> openai.OpenAI:
    return swarm_gw.client()


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def test_chat_and_completion(swarm_gw: Gateway, client: openai.OpenAI, tiny_llama: str) -> None:
    r = client.chat.completions.create(model=swarm_gw.model, messages=HELLO, max_tokens=12, temperature=0)
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    # text, finish reason, token counts: what 🤗 transformers decodes greedily from the same checkpoint
    assert_greedy(r, chat_prompt_ids(HELLO, tiny_llama), 12, tiny_llama)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    c = client.completions.create(model=swarm_gw.model, prompt="The swarm is", max_tokens=8, temperature=0)
    assert c.object == "text_completion"
    assert_greedy(c, text_prompt_ids("The swarm is", tiny_llama), 8, tiny_llama)
    assert swarm_gw.backend.open_sessions == 0


def test_streamed_equals_non_streamed_with_n_and_usage(swarm_gw: Gateway, client: openai.OpenAI) -> None:
    kw = dict(model=swarm_gw.model, messages=HELLO, max_tokens=20, temperature=0, n=2)
    full = client.chat.completions.create(**kw)
    texts, finishes, usage_chunks = collect_stream(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    usage = [chunk.usage for chunk in usage_chunks]
    assert [texts[c.index] for c in full.choices] == [c.message.content for c in full.choices]
    assert [finishes[c.index] for c in full.choices] == [c.finish_reason for c in full.choices]
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy: n equal copies
    (u,) = usage
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)

    ckw = dict(model=swarm_gw.model, prompt=["The swarm is", "A server"], max_tokens=12, temperature=0)
    cfull = client.completions.create(**ckw)
    ctexts, _, _ = collect_stream(client.completions.create(stream=True, **ckw))
    assert ctexts == {c.index: c.text for c in cfull.choices}


def test_greedy_identical_to_local_backend(swarm_gw: Gateway, local_gw: Gateway, client) -> None:
    local = local_gw.client()
    kw = dict(messages=HELLO, max_tokens=32, temperature=0, logprobs=True, top_logprobs=2)
    ours = client.chat.completions.create(model=swarm_gw.model, **kw)
    ref = local.chat.completions.create(model=local_gw.model, **kw)
    assert ours.choices[0].message.content == ref.choices[0].message.content
    assert ours.usage.completion_tokens == ref.usage.completion_tokens
    ours_lp = [(e.token, e.logprob) for e in ours.choices[0].logprobs.content]
    ref_lp = [(e.token, e.logprob) for e in ref.choices[0].logprobs.content]
    assert [t for t, _ in ours_lp] == [t for t, _ in ref_lp]
    assert [lp for _, lp in ours_lp] == pytest.approx([lp for _, lp in ref_lp], abs=1e-4)

    ckw = dict(prompt="Once upon a time", max_tokens=24, temperature=0)
    ours_c = client.completions.create(model=swarm_gw.model, **ckw).choices[0].text
    ref_c = local.completions.create(model=local_gw.model, **ckw).choices[0].text
    assert ours_c == ref_c


@pytest.fixture(scope="module")
def grouped_gw(the_swarm: Swarm, tiny_llama: str) -> Iterator[Gateway]:
    """A second gateway over the same swarm whose client deals its sessions into pipeline groups, one per
    server of their route ("auto", the CLI's default): 2 here."""
    backend = SwarmBackend(tiny_llama, [the_swarm.initial_peers], update_period=1.0, pipeline_groups="auto")
    gw = start_gateway(backend)
    yield gw
    gw.server.stop()
    backend.close()


@pytest.mark.parametrize("groups", [1, 2])
def test_concurrent_chats_are_decoded_together_and_exact(
    request: pytest.FixtureRequest, local_gw: Gateway, groups: int
) -> None:
    """Six streaming chats at once: their decode steps go to the swarm in shared batches
    (gateway/decode/batch.py), and each text is what the local model gives that prompt alone. With two
    pipeline groups every batch holds one group's steps, and both groups are used."""
    swarm_gw: Gateway = request.getfixturevalue("swarm_gw" if groups == 1 else "grouped_gw")
    client = swarm_gw.client()
    prompts = [f"Tell me about server number {i} of the swarm." for i in range(6)]
    kw = dict(max_tokens=24, temperature=0)
    local = local_gw.client()
    expected = [
        local.chat.completions.create(model=local_gw.model, messages=[{"role": "user", "content": p}], **kw)
        .choices[0]
        .message.content
        for p in prompts
    ]
    decoder = swarm_gw.server.app.state.engine.decoder
    assert decoder is not None
    batches, items = decoder.batches, decoder.items

    def chat(prompt: str) -> str:
        stream = client.chat.completions.create(
            model=swarm_gw.model, messages=[{"role": "user", "content": prompt}], stream=True, **kw
        )
        return collect_stream(stream)[0][0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(chat, prompts))
    assert got == expected
    assert decoder.items - items >= len(prompts) * 10
    assert (decoder.items - items) / (decoder.batches - batches) > 1.5  # steps really were shared
    assert set(decoder._groups) == ({None} if groups == 1 else {0, 1})


REPEATS = [{"role": "user", "content": "one two three four five, one two three four five, one two three four"}]


def test_speculation_over_the_swarm_is_exact_and_reported(swarm_gw: Gateway, client: openai.OpenAI) -> None:
    """Speculative decoding through the OpenAI API (gateway/speculation/verify.py): with prompt-lookup guesses and
    with a ``prediction``, greedy text and logprobs equal plain decoding's, streamed and not; usage reports
    the guesses (``completion_tokens_details`` + the ``speculation`` extension) and ``/metrics`` counts them."""
    kw = dict(model=swarm_gw.model, messages=REPEATS, max_tokens=40, temperature=0, logprobs=True)
    plain = client.chat.completions.create(extra_body={"speculation": "off"}, **kw)
    guessed = client.chat.completions.create(extra_body={"speculation": "prompt_lookup"}, **kw)
    answer = plain.choices[0].message.content
    assert guessed.choices[0].message.content == answer
    tokens = [e.token for e in plain.choices[0].logprobs.content]
    assert [e.token for e in guessed.choices[0].logprobs.content] == tokens
    assert plain.usage.completion_tokens_details is None and not (plain.usage.model_extra or {}).get("speculation")
    spec = guessed.usage.model_extra["speculation"]
    details = guessed.usage.completion_tokens_details
    assert spec["drafter"] == "prompt_lookup" and spec["drafted_tokens"] > 0
    assert details.accepted_prediction_tokens == spec["accepted_tokens"]
    assert details.rejected_prediction_tokens == spec["drafted_tokens"] - spec["accepted_tokens"]

    # the answer as OpenAI's predicted output: most of it is accepted, nothing changes
    predicted = client.chat.completions.create(prediction={"type": "content", "content": answer}, **kw)
    assert predicted.choices[0].message.content == answer
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens >= len(tokens) // 2

    texts, _, usage_chunks = collect_stream(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert texts[0] == answer
    (streamed,) = [chunk.usage for chunk in usage_chunks]
    assert streamed.model_extra["speculation"]["drafted_tokens"] > 0

    with swarm_gw.http() as http:
        metrics = http.get("/metrics").text
        assert "swarmserve_speculation_accepted_tokens_total" in metrics
        bad = http.post("/v1/chat/completions", json={**kw, "speculation": "draft_model"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculation", bad.text
        bad = http.post("/v1/chat/completions", json={**kw, "speculation": "sometimes"})
        assert bad.status_code == 400, bad.text
        bad = http.post("/v1/chat/completions", json={**kw, "prediction": {"type": "content", "content": 3}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction.content", bad.text


def test_health_and_swarm_state(swarm_gw: Gateway, the_swarm: Swarm) -> None:
    with swarm_gw.http() as http:
        health = http.get("/health")
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "ok"
        state = http.get("/v1/swarm").json()
    assert state["backend"] == "swarm"
    assert state["num_blocks"] == 4
    assert state["missing_blocks"] == []
    spans = {s["peer_id"]: s for s in state["spans"]}
    expected = {w.peer_id: span for w, span in zip(the_swarm.workers, SPANS, strict=True)}
    assert set(spans) == set(expected)
    for peer_id, span in expected.items():
        assert f"{spans[peer_id]['start']}:{spans[peer_id]['end']}" == span
        assert spans[peer_id]["state"] == "ONLINE"
        assert spans[peer_id]["cache_tokens_left"] > 0
        assert spans[peer_id]["reachability"] == "direct"  # the `swarmserve dht` node dialed it back at start-up
    first, second = (w.peer_id for w in the_swarm.workers)
    assert state["blocks"] == [[first], [first], [second], [second]]


def test_a_health_probe_flood_costs_one_dht_read_per_interval(
    swarm_gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/health`` and ``/v1/swarm`` answer from a view at most ``STATE_MAX_AGE_S`` old: 40 concurrent probes
    (unauthenticated, and each used to force a DHT read under the lock routing needs) read the DHT once or
    twice, not 40 times. (The client also re-reads the view in the background every ``update_period``: those
    reads may fall inside the flood too, one per period.)"""
    from concurrent.futures import ThreadPoolExecutor

    import swarm_client.sequence_manager as sm
    from gateway.routes.health import STATE_MAX_AGE_S

    reads: list[float] = []
    real = sm.fetch_block_records

    def counting(*args, **kwargs):
        reads.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(sm, "fetch_block_records", counting)
    time.sleep(STATE_MAX_AGE_S + 0.1)  # older than STATE_MAX_AGE_S unless the background refresh just ran
    started = time.monotonic()
    with swarm_gw.http() as http, ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: http.get("/health" if i % 2 else "/v1/swarm").status_code, range(40)))
    took = time.monotonic() - started
    assert codes == [200] * 40
    during = [t for t in reads if t >= started]
    period = swarm_gw.backend.manager.config.update_period
    assert len(during) <= 2 + int(took / STATE_MAX_AGE_S) + 1 + int(took / period), (len(during), took, reads)


def test_client_disconnect_frees_every_server_cache(swarm_gw: Gateway, the_swarm: Swarm) -> None:
    """Finished requests leave their caches *detached* on the servers for reuse (engine.py); an abandoned
    one must not: its session is closed and the servers end up holding no more than before it started."""
    backend: SwarmBackend = swarm_gw.backend
    peers = [w.peer_id for w in the_swarm.workers]
    before = [backend.server_info(peer) for peer in peers]
    assert all(i["sessions_attached"] == 0 for i in before), before
    body = {
        "model": swarm_gw.model,
        "messages": [{"role": "user", "content": "A long story, please, never seen before in this test."}],
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
        # the tiny model ends this reply with EOS after 50 tokens: banned, the stream is surely still running
        # when the checks below run (before, a fast swarm could finish it between them, and keep its caches)
        "logit_bias": {str(i): -100 for i in eos_token_ids(backend)},
    }
    with (
        httpx.Client(base_url=swarm_gw.url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks >= 4:
                break

        # mid-stream: every server on the route holds this session's cache (polled: once in a fresh-clone CI
        # run the second server said 0 the instant the first said 1, never reproduced since)
        def all_hold() -> list[dict] | None:
            infos = [backend.server_info(peer) for peer in peers]
            ok = all(i["sessions_attached"] == 1 and i["cache_tokens_used"] > 0 for i in infos)
            return infos if ok else None

        _wait_for(all_hold, timeout=10, what="every server to hold the streaming session")
    # the connection is closed here, long before 1500 tokens

    seen: list[list[dict]] = []

    def all_free() -> list[dict] | None:
        infos = [backend.server_info(peer) for peer in peers]
        seen.append(infos)
        done = all(
            i["sessions_attached"] == 0
            and i["sessions_detached"] <= b["sessions_detached"]  # not kept for reuse (it may have
            and i["cache_tokens_used"] <= b["cache_tokens_used"]  # resumed, and so freed, an older one)
            for i, b in zip(infos, before, strict=True)
        )
        return infos if done else None

    try:
        infos = _wait_for(all_free, timeout=30, what="servers to free the abandoned session's cache")
    except AssertionError as exc:
        keys = ("sessions_attached", "sessions_detached", "cache_tokens_used", "active_streams")
        said = [{k: i.get(k) for k in keys} for i in seen[-1]]
        was = [{k: i.get(k) for k in keys} for i in before]
        raise AssertionError(f"{exc}; servers said {said}, before the request {was}") from None
    # the client closes the server streams first, then forgets the session: wait for the second step too
    _wait_for(lambda: backend.open_sessions == 0, timeout=10, what="the gateway to forget the session")
    # the stream really stopped: the servers' token counters no longer move
    counts = [i["tokens_processed"] for i in infos]
    time.sleep(0.5)
    assert [backend.server_info(p)["tokens_processed"] for p in peers] == counts


def test_missing_span_is_a_503_naming_the_blocks(swarm_gw: Gateway, the_swarm: Swarm) -> None:
    """Runs last: it stops the worker of blocks 2:4."""
    the_swarm.workers[1].stop(signal.SIGTERM, timeout=20)
    with swarm_gw.http() as http:
        health = _wait_for(
            lambda: (r := http.get("/health")).status_code == 503 and r, timeout=20, what="/health to be 503"
        )
    assert health.json()["missing_blocks"] == [2, 3]
    assert health.headers["retry-after"]

    client = swarm_gw.client()
    for call in (
        lambda: client.chat.completions.create(model=swarm_gw.model, messages=HELLO, max_tokens=4),
        lambda: client.completions.create(model=swarm_gw.model, prompt="x", max_tokens=4, stream=True),
    ):
        with pytest.raises(openai.APIStatusError) as info:
            call()
        err = info.value
        assert err.status_code == 503
        assert int(err.response.headers["retry-after"]) >= 0
        payload = err.response.json()["error"]
        assert payload["code"] == "no_route"
        assert "2..3" in payload["message"] or "2-3" in payload["message"], payload
    assert swarm_gw.backend.open_sessions == 0

