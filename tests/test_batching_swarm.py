"""Concurrent sessions on a real worker are batched and still decode exactly like the local model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm_client import AutoDistributedModelForCausalLM, runtime
from swarm_client.errors import InvalidInputError
from swarm_client.routing import RouteHop
from swarm_client.session import _ServerSession
from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("pipeline_groups", "step_bundles"), [(1, True), ("auto", True), (1, False)])
def test_concurrent_greedy_sessions_are_batched_and_exact(tiny_llama, local_llama, pipeline_groups, step_bundles):
    """With ``pipeline_groups="auto"`` each session's route has 2 servers, so the sessions are dealt into 2
    groups that the servers batch apart; with step bundles the sessions' steps to one server travel together
    in one message per hop; outputs stay exact either way."""
    prompts = [
        torch.randint(0, 1000, (1, 3 + i), generator=torch.Generator().manual_seed(i)) for i in range(8)
    ]
    expected = [
        local_llama.generate(p, max_new_tokens=12, do_sample=False)[0, p.shape[1] :].tolist() for p in prompts
    ]
    with swarm(tiny_llama, ["0:2", "2:4"]) as s:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=[s.initial_peers], pipeline_groups=pipeline_groups, step_bundles=step_bundles
        )
        try:

            groups_dealt = []

            async def decode(prompt):
                session = model.blocks.inference_session(max_length=32)
                try:
                    out = await session.astep(model.head.embed(prompt))
                    groups_dealt.append(session.batch_group)
                    tokens = []
                    for _ in range(12):
                        token = model.head.final(out[:, -1:]).argmax(-1)
                        tokens.append(int(token))
                        out = await session.astep(model.head.embed(token))
                    return tokens
                finally:
                    await session.aclose()

            async def run_all():
                return await asyncio.gather(*(decode(p) for p in prompts))

            with torch.no_grad():
                got = runtime.run(run_all())
            assert got == expected
            infos = [runtime.run(model.manager.info(w.peer_id)) for w in s.workers]
            assert max(info["max_batch_seen"] for info in infos) > 1
            bundlers = [model.manager.step_bundler(w.peer_id) for w in s.workers]
            if step_bundles:  # every decode step went bundled, and bundles did carry several sessions' steps
                assert all(b is not None and b.steps_sent >= 8 * 12 for b in bundlers)
                assert all(b.bundles_sent < b.steps_sent for b in bundlers)
            else:
                assert bundlers == [None, None]
            assert sorted(groups_dealt, key=str) == ([None] * 8 if pipeline_groups == 1 else [0] * 4 + [1] * 4)
            if pipeline_groups != 1:
                # a batch never mixes groups: at most the 4 sessions of one group
                assert max(info["max_batch_seen"] for info in infos) <= 4
                # a server refuses a group number out of range, and keeps serving
                bad = _ServerSession(model.manager, RouteHop(s.workers[0].peer_id, 0, 2), "bad-group", 10**6)

                async def step_bad_group():
                    try:
                        await bad.open(8, 1, resume=False, timeout=10)
                        await bad.step(torch.zeros(1, 1, model.config.hidden_size), 0, 10)
                    finally:
                        await bad.close()

                with pytest.raises(InvalidInputError, match="batch_group"):
                    runtime.run(step_bad_group())
        finally:
            model.shutdown()
