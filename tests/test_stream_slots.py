"""``--max-concurrent-streams`` counts choices (issue 35): a request with ``n=4`` holds 4 slots, one asking
for more choices than there are slots is a 400 naming ``n``, the line is first come first served by weight,
and the default comes from the machine (8 choices per core, at most the backend threads, at least the
largest ``n``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest

from gateway import GatewaySettings, LocalBackend
from gateway.admission.stream_slots import CHOICES_PER_CORE, StreamSlots, auto_stream_slots
from gateway.errors import InvalidRequestError
from tests.gateway_fixtures import (
    REQUEST_TIMEOUT_S,
    Gateway,
    InstrumentedBackend,
    shared_gateway,
    start_gateway,
    tiny_model_dir,
)

HELLO = [{"role": "user", "content": "Hello there"}]


def test_auto_default_is_8_choices_per_core_within_threads_and_choices() -> None:
    assert GatewaySettings().max_concurrent_streams is None
    assert auto_stream_slots(64, 16, cores=4) == 4 * CHOICES_PER_CORE == 32
    assert auto_stream_slots(64, 16, cores=16) == 64  # no more choices than backend threads
    assert auto_stream_slots(64, 16, cores=1) == 16  # the largest n accepted still fits
    settings = GatewaySettings()
    slots: StreamSlots = shared_gateway().server.app.state.stream_slots
    assert slots.max_active == auto_stream_slots(settings.backend_threads, settings.max_choices)


async def test_weights_wait_in_line_first_come_first_served() -> None:
    slots = StreamSlots(4, max_queued=4, queue_timeout_s=5)
    await slots.acquire(3)
    assert not slots.try_acquire(2) and slots.active == 3
    big = asyncio.create_task(slots.acquire(4))  # needs all four: waits for the three to go
    await asyncio.sleep(0)
    small = asyncio.create_task(slots.acquire(1))  # one is free, but it must not overtake the big one
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done() and slots.queued == 2
    slots.release(3)
    await asyncio.wait_for(big, 1)
    assert slots.active == 4 and not small.done()
    slots.release(4)
    await asyncio.wait_for(small, 1)
    assert slots.active == 1 and slots.queued == 0
    with pytest.raises(InvalidRequestError) as err:
        await slots.acquire(5)
    assert err.value.param == "n" and err.value.code == "too_many_choices"


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    """Four slots, nobody waits: what one request holds shows in who else gets in."""
    backend = InstrumentedBackend(LocalBackend(tiny_model_dir()))
    gw = start_gateway(backend, max_concurrent_streams=4, max_queued_streams=0, retry_after_s=2)
    yield gw
    gw.server.stop()


def _chat(gw: Gateway, n: int, max_tokens: int, out: list) -> None:
    body = {"messages": HELLO, "n": n, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        out.append(r.status_code)
        out.extend(line for line in r.iter_lines() if line.startswith("data: "))


def test_n_takes_a_slot_per_choice(gw: Gateway) -> None:
    slots: StreamSlots = gw.server.app.state.stream_slots
    with gw.http() as http:
        too_many = http.post("/v1/chat/completions", json={"messages": HELLO, "n": 5, "max_tokens": 2})
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["param"] == "n" and error["code"] == "too_many_choices" and "at most 4" in error["message"]

    held: list = []
    with gw.backend.tweaked(step_delay_s=0.05):
        holder = threading.Thread(target=_chat, args=(gw, 4, 40, held))
        holder.start()
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while not (slots.active == 4 and gw.backend.steps > 0):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with gw.http() as http:
            one_more = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert one_more.status_code == 503 and one_more.json()["error"]["code"] == "streams_saturated"
        holder.join(REQUEST_TIMEOUT_S)
    assert held[0] == 200 and held[-1] == "data: [DONE]"
    finishes = [
        c["finish_reason"] for line in held[1:-1] for c in json.loads(line[6:])["choices"] if c["finish_reason"]
    ]
    assert len(finishes) == 4
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while slots.active:  # all four given back once the last byte went out
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with gw.http() as http:  # and a request of four choices fits again
        r = http.post("/v1/chat/completions", json={"messages": HELLO, "n": 4, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
