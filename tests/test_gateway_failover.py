"""A server SIGKILLed in the middle of an SSE stream: the gateway's swarm client fails over and the client
sees nothing but the same tokens.

Real swarm: blocks 0:1, 1:3, 3:4 of a tiny Llama plus a spare 1:3; ``SwarmBackend`` in this process behind
real uvicorn; the official OpenAI SDK. Decode steps are slowed down (``InstrumentedBackend``) so the kill
lands while the stream is still running, not after the last token was computed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.backends.swarm import SwarmBackend
from swarmserve.processes import wait_ready
from tests.gateway_fixtures import Gateway, InstrumentedBackend, start_gateway
from tests.swarm_fixtures import Swarm

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the swarm."}]
KW = dict(messages=MESSAGES, temperature=0, max_tokens=40)
MIDDLE = "1:3"
SPANS = ["0:1", MIDDLE, "3:4", MIDDLE]


@pytest.fixture(scope="module")
def failover_swarm(tiny_llama: str) -> Iterator[Swarm]:
    s = Swarm(tiny_llama)
    try:
        # fixed spans need no view of each other: start all four at once, then wait for each
        procs = [s.add_worker("--throughput", "1000", blocks=span, wait=False) for span in SPANS]
        wait_ready(procs, timeout=120)  # each reads its peer id from its ready line
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def gw(failover_swarm: Swarm, tiny_llama: str) -> Iterator[Gateway]:
    inner = SwarmBackend(tiny_llama, [failover_swarm.initial_peers], update_period=0.5, failover_deadline=60)
    gateway = start_gateway(InstrumentedBackend(inner, speculate=True))
    yield gateway
    gateway.server.stop()
    inner.close()


def test_sigkill_of_the_middle_server_mid_stream_keeps_the_text(gw: Gateway, failover_swarm: Swarm) -> None:
    """Mid-speculation too: the reference decodes plainly, the stream with guesses copied from a prediction
    wrong at every third token (steps of several tokens, rolled back on every server of the chain, replayed
    into the spare)."""
    backend: InstrumentedBackend = gw.backend
    swarm_backend: SwarmBackend = backend.inner
    client = gw.client(timeout=120)
    reference = client.chat.completions.create(model=gw.model, extra_body={"speculation": "off"}, **KW)
    expected = reference.choices[0].message.content
    assert reference.usage.completion_tokens >= 10, reference  # enough tokens left after the kill

    answer = swarm_backend.tokenizer(expected, add_special_tokens=False)["input_ids"]
    noisy = [t if i % 3 else (t + 7) % len(swarm_backend.tokenizer) for i, t in enumerate(answer)]
    prediction = {"type": "content", "content": swarm_backend.tokenizer.decode(noisy)}

    middles = [w for w in failover_swarm.workers if f"serving blocks {MIDDLE} " in " ".join(w.lines)]
    assert len(middles) == 2
    text, chunks, finishes, killed, usage = "", 0, [], None, None
    with backend.tweaked(step_delay_s=0.05):
        stream = client.chat.completions.create(
            model=gw.model,
            stream=True,
            stream_options={"include_usage": True},
            prediction=prediction,
            **KW,
        )
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.finish_reason is not None:
                    finishes.append(choice.finish_reason)
            chunks += 1
            if chunks == 5:
                infos = {w.peer_id: swarm_backend.server_info(w.peer_id) for w in middles}
                killed = next(w for w in middles if infos[w.peer_id]["sessions_attached"] > 0)
                survivor = next(w for w in middles if w is not killed)
                survivor_tokens = infos[survivor.peer_id]["tokens_processed"]
                killed.kill()  # the whole process group: worker, DHT process, p2pd
    assert killed is not None, "the stream ended before the kill"
    assert finishes == [reference.choices[0].finish_reason]
    assert text == expected
    assert usage is not None and usage.model_extra["speculation"]["accepted_tokens"] > 0, usage
    # the rest of the stream really went through the spare, after replaying the history into it
    assert swarm_backend.server_info(survivor.peer_id)["tokens_processed"] > survivor_tokens
    assert backend.wait_all_closed()
