"""The engine over a scripted backend (no model, no server): text assembly, stop conditions, session
lifecycle under cancellation, and prefix reuse."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from gateway.decode.engine import ChoiceSpec, Engine, eos_token_ids
from gateway.decode.prefill import prefill
from gateway.decode.sampling import SamplingParams
from gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def tokenizer():
    from swarm_client.tiny_model import build_tokenizer

    return build_tokenizer("llama")


class ScriptedSession:
    def __init__(self, backend, max_length):
        self.backend = backend
        self.max_length = max_length
        self.token_ids: list[int] = []
        self.steps = 0
        self.closed = False
        self.calls: list[tuple] = []

    @property
    def position(self) -> int:
        return len(self.token_ids)

    def step(self, token_ids):
        assert not self.closed, "step after close"
        assert self.position + len(token_ids) <= self.max_length
        self.calls.append(("step", list(token_ids)))
        if self.backend.delay:
            time.sleep(self.backend.delay)
        self.token_ids.extend(token_ids)
        script = self.backend.script
        token = script[self.steps] if self.steps < len(script) else self.backend.filler
        self.steps += 1
        logits = torch.full((self.backend.vocab,), -10.0)
        logits[token] = 10.0
        return logits

    def rollback(self, position):
        self.calls.append(("rollback", position))
        del self.token_ids[position:]

    def close(self):
        self.closed = True
        self.backend.open -= 1


class ScriptedBackend:
    """Whatever the input, session step k returns logits that make ``script[k]`` the greedy choice."""

    def __init__(self, tokenizer, script, *, filler=None, delay=0.0):
        self.model_id = "org/scripted-model"
        self.tokenizer = tokenizer
        self.max_context = 512
        self.vocab = len(tokenizer)
        self.script = script
        self.filler = filler if filler is not None else tokenizer.convert_tokens_to_ids("a")
        self.delay = delay
        self.open = 0
        self.sessions: list[ScriptedSession] = []

    def open_session(self, max_length, session_id=None):
        self.open += 1
        s = ScriptedSession(self, max_length)
        self.sessions.append(s)
        return s

    def swarm_state(self):
        return {}

    def close(self):
        pass


def _engine(backend) -> Engine:
    return Engine(backend, GatewaySettings(request_timeout_s=0, default_max_tokens=32))


def _spec(index=0, prompt=(5, 6, 7), max_tokens=50, stop=(), logprobs=None) -> ChoiceSpec:
    return ChoiceSpec(index, list(prompt), max_tokens, SamplingParams(temperature=0.0), list(stop), logprobs)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


TEXT = "Héllo 😀 wörld, 日本"


async def test_text_is_assembled_and_eos_stops(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    backend = ScriptedBackend(tokenizer, _ids(tokenizer, TEXT) + [eos])
    engine = _engine(backend)
    assert eos in engine.eos_ids
    deltas = []
    generation = await engine.start([_spec()])
    async for d in generation:
        deltas.append(d)
    assert "".join(d.text for d in deltas) == TEXT
    assert not any("\ufffd" in d.text for d in deltas)
    assert [d.finish_reason for d in deltas].count("stop") == 1 and deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens == len(_ids(tokenizer, TEXT)) + 1
    assert backend.open == 0


async def test_max_tokens_is_a_length_finish(tokenizer):
    backend = ScriptedBackend(tokenizer, _ids(tokenizer, TEXT))
    engine = _engine(backend)
    (result,) = await (await engine.start([_spec(max_tokens=3)])).collect()
    assert result.finish_reason == "length"
    assert result.completion_tokens == 3
    assert result.text == tokenizer.decode(_ids(tokenizer, TEXT)[:3])
    # exactly max_tokens steps: the prompt, then one per new token but the last
    assert [c for c in backend.sessions[0].calls] == [("step", [5, 6, 7])] + [
        ("step", [t]) for t in _ids(tokenizer, TEXT)[:2]
    ]


@pytest.mark.parametrize("stop", ["😀", "lo 😀 w", "ö", "Hé", "日本"])
async def test_stop_strings_across_tokens(tokenizer, stop):
    backend = ScriptedBackend(tokenizer, _ids(tokenizer, TEXT))
    engine = _engine(backend)
    (result,) = await (await engine.start([_spec(stop=[stop, "never"])])).collect()
    assert result.text == TEXT[: TEXT.find(stop)]
    assert result.finish_reason == "stop"


async def test_logprobs_follow_the_tokens(tokenizer):
    ids = _ids(tokenizer, TEXT)
    backend = ScriptedBackend(tokenizer, ids)
    engine = _engine(backend)
    (result,) = await (await engine.start([_spec(max_tokens=len(ids), logprobs=2)])).collect()
    assert [lp.token_id for lp in result.logprobs] == ids
    assert all(lp.top[0][0] == lp.token_id for lp in result.logprobs)


async def test_choices_run_concurrently_and_all_close(tokenizer):
    backend = ScriptedBackend(tokenizer, _ids(tokenizer, TEXT), delay=0.01)
    engine = _engine(backend)
    started = time.monotonic()
    results = await (await engine.start([_spec(i, max_tokens=10) for i in range(4)])).collect()
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert len({r.text for r in results}) == 1
    assert time.monotonic() - started < 4 * 10 * 0.01  # not one after another
    assert backend.open == 0


async def test_closing_mid_generation_closes_sessions_after_the_step_in_flight(tokenizer):
    backend = ScriptedBackend(tokenizer, [], delay=0.05)
    engine = _engine(backend)
    generation = await engine.start([_spec(i, max_tokens=200) for i in range(2)])
    seen = 0
    async for _ in generation:
        seen += 1
        if seen == 3:
            break
    await generation.aclose()
    assert backend.open == 0
    assert all(s.closed and s.steps < 20 for s in backend.sessions)


async def test_cancelling_the_consumer_task_closes_sessions(tokenizer):
    backend = ScriptedBackend(tokenizer, [], delay=0.05)
    engine = _engine(backend)

    async def consume():
        generation = await engine.start([_spec(max_tokens=200)])
        try:
            async for _ in generation:
                pass
        finally:
            await generation.aclose()

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.open == 0
    assert backend.sessions[0].closed


async def test_a_failed_open_closes_the_sessions_already_open(tokenizer):
    backend = ScriptedBackend(tokenizer, [])
    real_open = backend.open_session
    calls = []

    def flaky_open(max_length, session_id=None):
        calls.append(max_length)
        if len(calls) == 2:
            raise RuntimeError("no route")
        return real_open(max_length)

    backend.open_session = flaky_open
    with pytest.raises(RuntimeError, match="no route"):
        await _engine(backend).start([_spec(i) for i in range(3)])
    assert backend.open == 0


def test_prefill_feeds_only_what_the_session_lacks(tokenizer):
    backend = ScriptedBackend(tokenizer, [1, 1, 1])
    s = backend.open_session(64)
    s.token_ids = [1, 2, 3, 4]
    prefill(s, [1, 2, 9, 9])
    assert s.calls == [("rollback", 2), ("step", [9, 9])]
    s.calls.clear()
    prefill(s, [1, 2, 9, 9])  # all cached: recompute the last position's logits
    assert s.calls == [("rollback", 3), ("step", [9])]


def test_model_names_and_budgets(tokenizer):
    engine = _engine(ScriptedBackend(tokenizer, []))
    for name in (None, "org/scripted-model", "scripted-model"):
        assert asyncio.run(engine.select_model(name)).adapter is None
    with pytest.raises(Exception, match="does not exist"):
        asyncio.run(engine.select_model("scripted"))
    assert engine.max_tokens_for(500, None, param="messages") == 12  # what is left of 512
    assert engine.max_tokens_for(10, None, param="messages") == 32  # the default
    with pytest.raises(Exception, match="512 tokens. However, you requested 513 tokens"):
        engine.max_tokens_for(500, 13, param="messages")


def test_eos_ids_come_from_tokenizer_and_generation_config():
    backend = SimpleNamespace(
        tokenizer=SimpleNamespace(eos_token_id=2), generation_config=SimpleNamespace(eos_token_id=[7, 2])
    )
    assert eos_token_ids(backend) == {2, 7}
    assert eos_token_ids(SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=None))) == frozenset()
