"""Where the gateway's heavy request work runs (issue 18, hostile clients): never on the event loop.

Through a real uvicorn server over the tiny model, spies on the tokenizer class and on the backend's
``swarm_state`` record the thread of every call and whether an event loop was running there: a prompt body
just under the 8 MiB cap (chat), text and token-id prompts (completions), the Responses API and the rate
limiter's token estimate are all tokenized on the tokenize thread (gateway/decode/tokenize_thread.py), a body
over the cap is a 413 before anything is tokenized, and a flood of /health and /v1/swarm probes reads the
swarm on the swarm-view thread, one read at a time (gateway/backends/swarm_view.py). No assertion is timed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from gateway import LocalBackend
from gateway.backends.swarm_view import SwarmView
from gateway.decode.tokenize_thread import (
    PREFIX_CHARS_PER_TOKEN,
    PREFIX_MARGIN_TOKENS,
    TokenizeThread,
    encode_lazily,
    tokens_past,
)
from tests.gateway_fixtures import Gateway, start_gateway, tiny_model_dir, tiny_tokenizer

CAP = 8 * 2**20  # the default settings.max_body_bytes
SPIED = ("__call__", "encode", "apply_chat_template")


@dataclass(frozen=True)
class Call:
    method: str
    thread: str
    on_loop: bool  # an asyncio event loop was running on the calling thread
    size: int  # characters of the text argument (0: not text)


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _record(calls: list[Call], method: str, text: Any) -> None:
    size = len(text) if isinstance(text, str) else sum(len(str(m)) for m in text or [])
    calls.append(Call(method, threading.current_thread().name, _on_loop(), size))


class _RustSpy:
    """Stands for a tokenizer's Rust ``backend_tokenizer``: records its encodes, forwards everything."""

    def __init__(self, inner: Any, calls: list[Call]):
        self._inner, self._calls = inner, calls

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        _record(self._calls, "backend.encode", text)
        return self._inner.encode(text, *args, **kwargs)

    def encode_batch(self, texts: Any, *args: Any, **kwargs: Any) -> Any:
        _record(self._calls, "backend.encode_batch", "".join(t if isinstance(t, str) else "" for t in texts))
        return self._inner.encode_batch(texts, *args, **kwargs)

    def encode_batch_fast(self, texts: Any, *args: Any, **kwargs: Any) -> Any:
        _record(self._calls, "backend.encode_batch", "".join(t if isinstance(t, str) else "" for t in texts))
        return self._inner.encode_batch_fast(texts, *args, **kwargs)

    def __copy__(self) -> Any:  # llguidance copies it before changing its settings
        return copy.copy(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def tokenizer_calls(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    """Every encode / chat-template call of any instance of the tiny tokenizer's class, and every encode
    through its Rust ``backend_tokenizer``, with its thread."""
    calls: list[Call] = []
    cls = type(tiny_tokenizer())
    for name in SPIED:
        real = getattr(cls, name)

        def spy(self: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            _record(calls, _name, args[0] if args else kwargs.get("text", kwargs.get("conversation")))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    monkeypatch.setattr(cls, "backend_tokenizer", property(lambda self: _RustSpy(self._tokenizer, calls)))
    return calls


class SpyBackend:
    """``LocalBackend`` whose ``swarm_state`` records its thread and how many reads overlap; each read
    takes 20 ms, like a DHT read, so probes that did not share reads would overlap."""

    def __init__(self, inner: LocalBackend):
        self.inner = inner
        self.model_id = inner.model_id
        self.tokenizer = inner.tokenizer
        self.max_context = inner.max_context
        self.generation_config = inner.generation_config
        self.reads: list[tuple[str, bool]] = []
        self.running = self.max_running = 0
        self.lock = threading.Lock()

    def open_session(self, max_length: int, session_id: str | None = None) -> Any:
        return self.inner.open_session(max_length, session_id)

    def swarm_state(self) -> dict:
        with self.lock:
            self.reads.append((threading.current_thread().name, _on_loop()))
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            time.sleep(0.02)
            return self.inner.swarm_state()
        finally:
            with self.lock:
                self.running -= 1

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    """The default body cap; a token-per-minute limit, so the rate limiter counts prompts too."""
    gateway = start_gateway(SpyBackend(LocalBackend(tiny_model_dir())), rate_limit_tpm=10**12)
    yield gateway
    gateway.server.stop()


@pytest.fixture(scope="module")
def gw_no_tpm(gw: Gateway) -> Iterator[Gateway]:
    """No token limit: what tokenizes an 8 MiB prompt is the route alone."""
    gateway = start_gateway(gw.backend)
    yield gateway
    gateway.server.stop()


def _assert_off_loop(calls: list[Call]) -> None:
    assert calls, "the spy saw no tokenizing: it is not where the gateway tokenizes"
    on_loop = [c for c in calls if c.on_loop or not c.thread.startswith("tokenize")]
    assert not on_loop, on_loop


# ------------------------------------------------------------------------------------------- the prompts


@pytest.mark.parametrize("which", ["gw_no_tpm", "gw"])
def test_a_prompt_just_under_the_cap_is_tokenized_off_the_event_loop(
    which: str, request: pytest.FixtureRequest, tokenizer_calls: list[Call]
) -> None:
    """Rendered and counted on the tokenize thread (and by the rate limiter, there too, when it counts);
    only its beginning is counted, which is enough to refuse it."""
    gw: Gateway = request.getfixturevalue(which)
    head = {"model": gw.model, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    room = CAP - len(json.dumps(head)) - 64
    words = "hello world, a hostile prompt. "
    body = {**head, "messages": [{"role": "user", "content": words * (room // len(words))}]}
    data = json.dumps(body).encode()
    assert CAP - 128 < len(data) <= CAP
    with gw.http() as http:
        r = http.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"}, timeout=300)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
    _assert_off_loop(tokenizer_calls)
    rendered = [c.size for c in tokenizer_calls if c.method == "apply_chat_template"]
    encoded = [c.size for c in tokenizer_calls if c.method in ("__call__", "encode", "backend.encode_batch")]
    assert max(rendered) > CAP - 1024 and encoded  # the spies saw the whole prompt rendered, then counted
    assert max(encoded) <= PREFIX_CHARS_PER_TOKEN * (gw.backend.max_context + PREFIX_MARGIN_TOKENS)
    assert f"maximum context length is {gw.backend.max_context} tokens" in error["message"]
    assert "are more than" in error["message"]  # a lower bound: only the beginning was counted


def test_every_prompt_shape_is_tokenized_off_the_event_loop(gw: Gateway, tokenizer_calls: list[Call]) -> None:
    client = gw.client()
    client.chat.completions.create(
        model=gw.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=False
    )
    stream = client.chat.completions.create(
        model=gw.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
    )
    assert [chunk for chunk in stream]
    client.completions.create(model=gw.model, prompt=["some text", "more"], max_tokens=2, echo=True)
    client.completions.create(model=gw.model, prompt=[[5, 6, 7]], max_tokens=2, echo=True)
    client.responses.create(model=gw.model, input="Hello", instructions="Be brief.", max_output_tokens=2)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    client.chat.completions.create(
        model=gw.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, tools=tools
    )
    methods = {c.method for c in tokenizer_calls}
    assert "apply_chat_template" in methods and methods & {"__call__", "encode", "backend.encode_batch"}, methods
    _assert_off_loop(tokenizer_calls)


def test_a_token_id_prompt_past_the_window_is_refused_before_it_is_read(
    gw: Gateway, tokenizer_calls: list[Call]
) -> None:
    """A million token ids (3 MiB): a 400 from their number, before each is checked and all are decoded."""
    body = {"model": gw.model, "prompt": [5] * 1_000_000, "max_tokens": 1}
    with gw.http() as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt"
    assert not [c for c in tokenizer_calls if c.on_loop]


def test_a_body_over_the_cap_is_a_413_before_any_tokenizing(gw: Gateway, tokenizer_calls: list[Call]) -> None:
    content = "x" * CAP
    data = json.dumps({"model": gw.model, "messages": [{"role": "user", "content": content}]}).encode()
    with gw.http() as http:
        r = http.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for i in range(0, len(data), 2**20):
                yield data[i : i + 2**20]

        r = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert tokenizer_calls == []


# --------------------------------------------------------------------------------------------- the probes


def test_a_probe_flood_reads_the_swarm_off_the_event_loop_one_read_at_a_time(gw: Gateway) -> None:
    backend: SpyBackend = gw.backend
    backend.reads.clear()
    with gw.http() as http, ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda i: http.get("/health" if i % 2 else "/v1/swarm").status_code, range(48)))
    assert codes == [200] * 48
    assert backend.reads, "the spy saw no swarm read"
    assert all(thread.startswith("swarm-view") and not on_loop for thread, on_loop in backend.reads), backend.reads
    assert backend.max_running == 1
    assert len(backend.reads) <= 48


# ------------------------------------------------------------------------------------- the parts, alone


def test_the_tokenize_thread_owns_a_copy_it_hands_out_only_on_itself() -> None:
    tokenizer = tiny_tokenizer()
    thread = TokenizeThread(tokenizer)
    try:
        assert thread.tokenizer is not tokenizer
        assert thread.tokenizer.backend_tokenizer is not tokenizer.backend_tokenizer
        with pytest.raises(RuntimeError, match="TokenizeThread.run"):
            thread.own()

        async def main() -> tuple[list[int], str]:
            ids = await thread.run(lambda: thread.own()("Hello there", add_special_tokens=False)["input_ids"])
            return ids, await thread.run(lambda: threading.current_thread().name)

        ids, name = asyncio.run(main())
        assert ids == tokenizer("Hello there", add_special_tokens=False)["input_ids"]
        assert name.startswith("tokenize")
    finally:
        thread.close()


class _BlockingState:
    """A swarm whose reads wait for ``release``; with ``max_age_s`` (the swarm backend's signature)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reads = 0

    def swarm_state(self, max_age_s: float = 0.0) -> dict:
        self.reads += 1
        assert self.release.wait(30)
        return {"reads": self.reads}


async def test_swarm_view_is_single_flight_and_cached() -> None:
    backend = _BlockingState()
    view = SwarmView(backend, max_age_s=3600)
    try:
        probes = [asyncio.create_task(view.get()) for _ in range(40)]
        for _ in range(5):
            await asyncio.sleep(0)  # every probe is waiting now: on the one read in flight
        probes[0].cancel()  # a probe that hangs up does not cancel the read the others wait for
        backend.release.set()
        answers = await asyncio.gather(*probes[1:])
        assert answers == [{"reads": 1}] * 39 and backend.reads == 1
        assert await view.get() == {"reads": 1} and backend.reads == 1  # recent: answered from memory
    finally:
        view.close()


async def test_swarm_view_reads_a_backend_without_max_age_afresh() -> None:
    class Current:
        reads = 0

        def swarm_state(self) -> dict:
            self.reads += 1
            return {"reads": self.reads}

    view = SwarmView(Current())
    try:
        assert await view.get() == {"reads": 1}
        assert await view.get() == {"reads": 2}
    finally:
        view.close()


@pytest.mark.parametrize("family", ["llama", "mixtral", "falcon", "bloom"])
def test_encode_lazily_counts_and_encodes_as_the_tokenizer_does(family: str) -> None:
    from swarm_client.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(family)
    mine = TokenizeThread(tokenizer)
    try:
        texts = ["Hello there", " leading space", "ünïcödé 😀  spaces\n\nnew", "", "<|im_start|>user\nhi<|im_end|>"]
        for text in texts:
            for special in (True, False):
                want = list(tokenizer(text, add_special_tokens=special)["input_ids"])
                count, ids = encode_lazily(mine.tokenizer, text, add_special_tokens=special)
                assert (count, ids()) == (len(want), want), (text, special)
    finally:
        mine.close()


def test_tokens_past_counts_only_the_beginning_of_a_text_that_cannot_fit() -> None:
    tokenizer, limit = tiny_tokenizer(), 100
    cut = PREFIX_CHARS_PER_TOKEN * (limit + PREFIX_MARGIN_TOKENS)
    words = "hello world, a prompt. "
    short = (words * cut)[:cut]
    assert tokens_past(tokenizer, short, limit, add_special_tokens=False) is None  # short enough: count it whole
    long = words * cut
    past = tokens_past(tokenizer, long, limit, add_special_tokens=False)
    whole = len(tokenizer(long, add_special_tokens=False)["input_ids"])
    assert past is not None and limit + PREFIX_MARGIN_TOKENS < past < whole
    assert past == len(tokenizer(long[:cut], add_special_tokens=False)["input_ids"])
