"""Continuous batching across sessions gives the same results as running each session alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig

from swarm_client.families import get_family
from worker.batcher import StepBatcher
from worker.cache import CacheManager
from worker.compute import SpanRunner, StepItem


@pytest.fixture(scope="module")
def runner_and_layout(tiny_llama, local_llama):
    config = AutoConfig.from_pretrained(tiny_llama)
    family = get_family(config)
    state = local_llama.state_dict()
    blocks = []
    for i in range(config.num_hidden_layers):
        prefix = family.layer_prefix(i)
        blocks.append(
            family.build_block(
                config, i, {k[len(prefix) :]: v.clone() for k, v in state.items() if k.startswith(prefix)}
            )
        )
    return SpanRunner(blocks, torch.float32, torch.device("cpu")), family.cache_layout(config), config


def make_sessions(runner, layout, prompt_lengths, batch_sizes):
    caches = CacheManager(100_000, len(runner.blocks), layout, torch.float32)
    sessions = []
    for n, (length, batch) in enumerate(zip(prompt_lengths, batch_sizes, strict=True)):
        cache = caches.open(f"s{n}", batch, 256)
        caches.ensure_capacity(cache, 256)
        prompt = torch.randn(batch, length, 64, generator=torch.Generator().manual_seed(n))
        runner.inference_step(cache, prompt, 0)
        sessions.append(cache)
    return sessions


def test_batched_decode_equals_unbatched(runner_and_layout):
    runner, layout, _ = runner_and_layout
    lengths, batches = [3, 11, 1, 7], [1, 2, 1, 3]
    alone = make_sessions(runner, layout, lengths, batches)
    together = make_sessions(runner, layout, lengths, batches)
    for step in range(5):
        tokens = [
            torch.randn(b, 1, 64, generator=torch.Generator().manual_seed(100 * step + i))
            for i, b in enumerate(batches)
        ]
        expected = [runner.inference_step(c, t, c.position) for c, t in zip(alone, tokens, strict=True)]
        got = runner.inference_batch([StepItem(c, t, c.position) for c, t in zip(together, tokens, strict=True)])
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
    assert [c.position for c in together] == [c.position for c in alone]


def test_mixed_batch_with_prefill_and_hidden_states_falls_back(runner_and_layout):
    runner, layout, _ = runner_and_layout
    alone = make_sessions(runner, layout, [4, 5], [1, 1])
    together = make_sessions(runner, layout, [4, 5], [1, 1])
    prefill = torch.randn(1, 6, 64)
    token = torch.randn(1, 1, 64)
    expected = [
        runner.inference_step(alone[0], prefill, 4),
        runner.inference_step(alone[1], token, 5, output_hidden_states=True),
    ]
    got = runner.inference_batch([StepItem(together[0], prefill, 4), StepItem(together[1], token, 5, True)])
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)


def test_step_batcher_groups_concurrent_steps(runner_and_layout):
    runner, layout, _ = runner_and_layout
    sessions = make_sessions(runner, layout, [2, 3, 4, 5, 6, 7, 8, 9], [1] * 8)
    reference = make_sessions(runner, layout, [2, 3, 4, 5, 6, 7, 8, 9], [1] * 8)
    executor = ThreadPoolExecutor(max_workers=1)
    batcher = StepBatcher(runner, executor)
    token = torch.randn(1, 1, 64)

    async def run_all():
        return await asyncio.gather(*(batcher.submit(StepItem(c, token, c.position)) for c in sessions))

    outs = asyncio.run(run_all())
    for cache, out in zip(reference, outs, strict=True):
        torch.testing.assert_close(out, runner.inference_step(cache, token, cache.position), atol=1e-4, rtol=0)
    assert batcher.batches < len(sessions)  # at least some steps shared a pass
    assert batcher.max_batch_seen > 1
    executor.shutdown()


def test_prefills_share_the_pass_with_decode_steps(runner_and_layout, monkeypatch):
    """Prompts of several lengths and batch sizes, prefilled in one batch beside decode steps, then decoded
    together: every result and cache equals running each session alone, and nothing ran alone."""
    runner, layout, _ = runner_and_layout
    lengths, batches = [3, 1, 6, 2], [1, 2, 1, 3]
    alone = make_sessions(runner, layout, lengths, batches)
    together = make_sessions(runner, layout, lengths, batches)
    solo_calls = []
    original_step = runner.inference_step
    for step, new_tokens in enumerate([[5, 1, 9, 1], [1, 7, 1, 4], [1, 1, 1, 1]]):
        tokens = [
            torch.randn(b, t, 64, generator=torch.Generator().manual_seed(10 * step + i))
            for i, (b, t) in enumerate(zip(batches, new_tokens, strict=True))
        ]
        expected = [original_step(c, t, c.position) for c, t in zip(alone, tokens, strict=True)]
        monkeypatch.setattr(runner, "inference_step", lambda *a, **k: solo_calls.append(a) or original_step(*a, **k))
        got = runner.inference_batch([StepItem(c, t, c.position) for c, t in zip(together, tokens, strict=True)])
        monkeypatch.setattr(runner, "inference_step", original_step)
        for e, g in zip(expected, got, strict=True):
            assert g.shape == e.shape
            torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
        assert [c.position for c in together] == [c.position for c in alone]
    assert solo_calls == []
    for a, b in zip(alone, together, strict=True):  # the caches hold the same keys and values
        for (ka, va), (kb, vb) in zip(a.layer_kv(), b.layer_kv(), strict=True):
            torch.testing.assert_close(ka[:, :, : a.position], kb[:, :, : b.position], atol=1e-4, rtol=0)
            torch.testing.assert_close(va[:, :, : a.position], vb[:, :, : b.position], atol=1e-4, rtol=0)


def test_pipeline_groups_batch_one_group_at_a_time(runner_and_layout):
    """Steps tagged with two pipeline groups, all pending at once: each batch holds one group's steps (the
    oldest step's group first), and every output equals the unbatched one."""
    runner, layout, _ = runner_and_layout
    sessions = make_sessions(runner, layout, [2, 3, 4, 5, 6, 7, 8, 9], [1] * 8)
    reference = make_sessions(runner, layout, [2, 3, 4, 5, 6, 7, 8, 9], [1] * 8)
    for i, cache in enumerate(sessions):
        cache.batch_group = i % 2
    seen: list[list[int | None]] = []
    original = runner.inference_batch

    def recording(items):
        seen.append([item.cache.batch_group for item in items])
        return original(items)

    executor = ThreadPoolExecutor(max_workers=1)
    batcher = StepBatcher(runner, executor)
    token = torch.randn(1, 1, 64)

    async def run_all():
        return await asyncio.gather(*(batcher.submit(StepItem(c, token, c.position)) for c in sessions))

    runner.inference_batch = recording
    try:
        outs = asyncio.run(run_all())
    finally:
        del runner.inference_batch
        executor.shutdown()
    assert all(len(set(groups)) == 1 for groups in seen), seen
    assert sorted(g for groups in seen for g in groups) == [0] * 4 + [1] * 4
    assert seen[0][0] == 0 and max(len(groups) for groups in seen) > 1
    for cache, out in zip(reference, outs, strict=True):
        torch.testing.assert_close(out, runner.inference_step(cache, token, cache.position), atol=1e-4, rtol=0)


@pytest.mark.parametrize("groups", [0, -1, 65, 1.5, True, "Auto", "2"])
def test_pipeline_groups_out_of_range_are_refused_before_anything_starts(groups):
    from swarm_client.sequence_manager import ClientConfig, SequenceManager

    with pytest.raises(ValueError, match="pipeline_groups"):
        SequenceManager(ClientConfig([], "x", 4, pipeline_groups=groups))


def test_pipeline_groups_are_dealt_round_robin_and_auto_follows_the_route():
    """A fixed number of groups is dealt round-robin whatever the route; under "auto" a session's route
    length is its number of groups, and a one-server route gets no group (splitting its batch gains nothing)."""
    from swarm_client.sequence_manager import ClientConfig, SequenceManager

    fixed = SequenceManager(ClientConfig([], "x", 4, pipeline_groups=3), dht=object())
    assert not fixed.groups_follow_route
    assert [fixed.next_batch_group(chain_length=n) for n in (1, 2, 5, 1, 1)] == [0, 1, 2, 0, 1]
    single = SequenceManager(ClientConfig([], "x", 4), dht=object())
    assert [single.next_batch_group(2) for _ in range(3)] == [None] * 3
    auto = SequenceManager(ClientConfig([], "x", 4, pipeline_groups="auto"), dht=object())
    assert auto.groups_follow_route
    assert [auto.next_batch_group(2) for _ in range(4)] == [0, 1, 0, 1]
    assert auto.next_batch_group(1) is None
    assert [auto.next_batch_group(3) for _ in range(3)] == [1, 2, 0]  # one shared counter, modulo the route
    assert auto.next_batch_group(1000) < 64  # capped at MAX_PIPELINE_GROUPS
