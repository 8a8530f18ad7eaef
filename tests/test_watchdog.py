"""A client heals itself (issue 35): real workers, a real client, the audit's wedge brought about by hand —
every server banned for a minute while ONLINE, the p2p client's unary reader dead (what a cancel racing an
answer did, ``tests/test_unary_wedge.py``) — and the watchdog gets a request through within seconds."""

from __future__ import annotations

import time

import pytest
import torch

from swarm_client import AutoDistributedModelForCausalLM, p2p_guard, runtime
from tests.swarm_fixtures import greedy_session, swarm

pytestmark = pytest.mark.slow

PROMPT = torch.tensor([[3, 14, 15, 92, 65]])


async def _wedge(manager) -> None:
    """Ban every server for the maximum (renewed, as the audit logged) and kill the unary reader."""
    for peer in manager.spans:
        for _ in range(8):
            manager.bans.unban(peer)
            manager.bans.ban(peer, reason="did not answer a ping within 3.0 s — it may be behind NAT")
    p2p = await manager.p2p()
    p2p._client.control._read_task.cancel()


def test_a_wedged_client_heals_within_seconds(tiny_llama) -> None:
    with swarm(tiny_llama, ["0:2", "2:4"]) as s:
        model = AutoDistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=[s.initial_peers], spot_check_rate=0.0, route_wait=20.0
        )
        try:
            manager = model.manager
            reference, _ = greedy_session(model, PROMPT, 4)
            runtime.run(_wedge(manager))
            time.sleep(0.1)
            assert manager.bans.remaining(next(iter(manager.spans))) > 55.0
            assert not p2p_guard.unary_reader_alive(runtime.run(manager.p2p()))
            t0 = time.monotonic()
            tokens, _ = greedy_session(model, PROMPT, 4)  # waits in route_wait until the watchdog resets
            healed_s = time.monotonic() - t0
            print(f"healed and answered in {healed_s:.2f}s; watchdog: {manager.watchdog.as_dict()}")
            assert tokens == reference
            assert manager.watchdog.resets >= 1 and "unary reader was dead" in manager.watchdog.last_reason
            assert healed_s < 8.0  # the watchdog holds 3 s before it resets; the machine is shared
            assert p2p_guard.unary_reader_alive(runtime.run(manager.p2p()))
            assert manager.bans.banned() == set()
        finally:
            model.shutdown()
