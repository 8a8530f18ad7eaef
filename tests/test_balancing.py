"""Swarm balancing: the pure move decisions of ``worker.rebalance`` and, with real processes, three
``--num-blocks`` workers that cover an 8-block model and re-cover it after one is SIGKILLed.

The integration test uses ``--num-blocks 4``: three servers of 3 blocks (9 slots) cover 8 blocks, but the
6 slots left after a kill cannot, so no rebalancing could ever close that gap.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from swarm_client import protocol
from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState, spans_from_records
from swarm_client.errors import RemoteError, SessionNotFoundError
from swarmserve.launcher import swarmserve_argv
from worker.rebalance import (
    PENDING,
    HandlerSwitch,
    balancing_view,
    jittered,
    joining_range,
    plan_move,
    retired_ranges,
    tombstone,
)

NUM_BLOCKS = 8


def info(start: int, end: int, state: ServerState = ServerState.ONLINE, throughput: float = 10.0) -> ServerInfo:
    return ServerInfo(state=state, start_block=start, end_block=end, throughput=throughput)


def span(peer: str, start: int, end: int, state: ServerState = ServerState.ONLINE) -> RemoteSpanInfo:
    return RemoteSpanInfo(peer, start, end, info(start, end, state))


def swarm(*spans: RemoteSpanInfo) -> dict[str, RemoteSpanInfo]:
    return {s.peer_id: s for s in spans}


def records(*announcements: tuple[str, int, int, ServerInfo]) -> list[dict[str, ServerInfo]]:
    """Per-block records as the DHT holds them after ``(peer, start, end, info)`` stores, in order."""
    per_block: list[dict[str, ServerInfo]] = [{} for _ in range(NUM_BLOCKS)]
    for peer, start, end, value in announcements:
        for block in range(start, end):
            per_block[block][peer] = value
    return per_block


# --- plan_move --------------------------------------------------------------------------------------


def test_plan_move_fills_a_gap_only_while_it_exists():
    after_kill = swarm(span("A", 0, 4), span("C", 0, 4))  # the holder of 4:8 died
    assert plan_move("A", after_kill, NUM_BLOCKS) == (4, 8)
    assert plan_move("C", after_kill, NUM_BLOCKS) == (4, 8)
    after_move = swarm(span("A", 0, 4), span("C", 4, 8))
    assert plan_move("A", after_move, NUM_BLOCKS) is None
    assert plan_move("C", after_move, NUM_BLOCKS) is None


def test_plan_move_stays_when_balanced_alone_or_unannounced():
    assert plan_move("A", swarm(span("A", 0, 4), span("B", 4, 8), span("C", 0, 4)), NUM_BLOCKS) is None
    assert plan_move("A", swarm(span("A", 0, 4)), NUM_BLOCKS) is None  # moving cannot close the gap
    assert plan_move("A", swarm(span("B", 0, 8)), NUM_BLOCKS) is None
    # never leave blocks that only I serve, even for a bigger gap elsewhere
    assert plan_move("A", swarm(span("A", 0, 4), span("B", 0, 2)), NUM_BLOCKS) is None


def test_plan_move_respects_balance_quality():
    # moving C from 0:4 to 4:8 lifts the weakest block from 10 to 20
    spans = swarm(span("A", 0, 4), span("B", 4, 8), span("C", 0, 4), span("D", 0, 4))
    assert plan_move("C", spans, NUM_BLOCKS, balance_quality=0.75) == (4, 8)
    assert plan_move("C", spans, NUM_BLOCKS, balance_quality=0.4) is None


def test_a_move_in_progress_keeps_the_others_home():
    # A loads 4:8 (JOINING above its old span) while still serving 0:4: C must not run to the same gap
    during = records(("A", 0, 4, info(0, 4)), ("C", 0, 4, info(0, 4)), ("A", 4, 8, info(4, 8, ServerState.JOINING)))
    view = balancing_view(during)
    assert (view["A"].start, view["A"].end) == (0, 4)
    assert (view[f"A{PENDING}"].start, view[f"A{PENDING}"].end) == (4, 8)
    assert plan_move("C", view, NUM_BLOCKS) is None
    assert plan_move("A", view, NUM_BLOCKS) == (4, 8)  # my own pending move does not count against me
    assert set(spans_from_records(during)) == {"A", "C"}  # routing never sees the pseudo-peer


# --- the records of a move, read back the way clients read them ------------------------------------


@pytest.mark.parametrize(("old", "new"), [((0, 4), (4, 8)), ((4, 8), (0, 4)), ((0, 4), (2, 6)), ((3, 7), (1, 5))])
def test_records_during_and_after_a_move_never_hide_a_served_span(old, new):
    joining = joining_range(old, new)
    during = [("B", 0, 8, info(0, 8)), ("A", *old, info(*old))]
    if joining is not None:
        during.append(("A", *joining, info(*new, ServerState.JOINING)))
    seen = spans_from_records(records(*during))["A"]
    assert (seen.start, seen.end, seen.state) == (*old, ServerState.ONLINE)  # the old span is still served

    online = info(*new)
    after = [*during, ("A", *new, online)] + [("A", lo, hi, tombstone(online)) for lo, hi in retired_ranges(old, new)]
    seen = spans_from_records(records(*after))["A"]
    assert (seen.start, seen.end, seen.state) == (*new, ServerState.ONLINE)
    assert all(
        r["A"].state == ServerState.OFFLINE for lo, hi in retired_ranges(old, new) for r in records(*after)[lo:hi]
    )


def test_joining_and_retired_ranges():
    assert joining_range((0, 4), (4, 8)) == (4, 8)
    assert joining_range((4, 8), (0, 4)) is None
    assert joining_range((2, 6), (0, 4)) == (3, 4)
    assert retired_ranges((0, 4), (4, 8)) == [(0, 4)]
    assert retired_ranges((2, 6), (0, 4)) == [(4, 6)]
    assert retired_ranges((0, 8), (2, 4)) == [(0, 2), (4, 8)]
    assert retired_ranges((0, 4), (0, 4)) == []


def test_jittered_spreads_around_the_period():
    rng = random.Random(0)
    delays = [jittered(2.0, rng) for _ in range(200)]
    assert all(1.0 <= d <= 3.0 for d in delays)
    assert max(delays) - min(delays) > 1.0


# --- HandlerSwitch ----------------------------------------------------------------------------------


class FakeHandler:
    """Just enough of ``BlockHandler``: a span, and an inference stream that echoes what it was sent."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.accepting = True
        self.active_streams = 0
        self.seen: list[dict] = []

        class Limits:
            idle_timeout = 5.0

        self.limits = Limits()

    async def rpc_inference(self, requests: AsyncIterator, context: object) -> AsyncIterator:
        async for request in requests:
            self.seen.append(protocol.unpack_metadata(request.metadata))
            yield protocol.make_response(echo=len(self.seen))


async def _talk(switch: HandlerSwitch, *messages: dict) -> list[dict]:
    async def requests() -> AsyncIterator:
        for metadata in messages:
            yield protocol.make_request(**metadata)

    return [protocol.unpack_metadata(r.metadata) async for r in switch.rpc_inference(requests(), None)]


def test_handler_switch_routes_by_span_and_rejects_stale_routes():
    old, new = FakeHandler(0, 4), FakeHandler(4, 8)
    switch = HandlerSwitch(old)  # type: ignore[arg-type]
    opening = {"open": {"start_block": 0, "end_block": 4, "max_length": 8}}
    assert asyncio.run(_talk(switch, opening, {"position": 0})) == [{"echo": 1}, {"echo": 2}]

    assert switch.switch_to(new) is old  # type: ignore[arg-type]
    assert old.accepting is False and switch.retired == [old]
    (reply,) = asyncio.run(_talk(switch, opening))
    assert reply["error"]["code"] == RemoteError.code  # retryable elsewhere, unlike invalid_input
    assert "4:8" in reply["error"]["message"]
    (reply,) = asyncio.run(_talk(switch, {"open": {"start_block": 0, "end_block": 4, "resume": True}}))
    assert reply["error"]["code"] == SessionNotFoundError.code
    sub_span = {"open": {"start_block": 5, "end_block": 7, "max_length": 8}}
    assert asyncio.run(_talk(switch, sub_span)) == [{"echo": 1}]
    assert len(old.seen) == 2 and new.seen[0]["open"]["start_block"] == 5


# --- real processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eight_blocks(tmp_path_factory) -> str:
    from swarm_client.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-8", family="llama", num_layers=8))


@pytest.fixture(scope="module")
def dht_reader(eight_blocks: str) -> Iterator:
    """``read()`` → spans seen by a client-mode DHT inside the test process (cheap enough to poll)."""
    from hivemind.dht import DHT

    from swarm_client.config import default_dht_prefix
    from swarm_client.dht_records import fetch_block_records
    from tests.swarm_fixtures import Swarm

    s = Swarm(eight_blocks)
    dht = DHT(initial_peers=[s.initial_peers], client_mode=True, start=True)
    prefix = default_dht_prefix(eight_blocks)

    def read() -> dict[str, RemoteSpanInfo]:
        return spans_from_records(fetch_block_records(dht, prefix, NUM_BLOCKS))

    try:
        yield s, read
    finally:
        dht.shutdown()
        s.close()


def _status(s, model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        swarmserve_argv("status", "--initial-peers", s.initial_peers, "--model", model),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_num_blocks_workers_cover_the_model_and_recover_from_a_kill(dht_reader, eight_blocks, local_llama_8):
    from swarm_client import AutoDistributedModelForCausalLM
    from swarm_client.routing import missing_blocks

    s, read = dht_reader
    # a fixed throughput skips the benchmark and makes placement deterministic: 0:4, 4:8, 0:4
    flags = ("--num-blocks", "4", "--throughput", "1000", "--rebalance-period", "2")
    workers = [s.add_worker(*flags) for _ in range(3)]  # each waits until the previous one is ONLINE
    spans = read()
    assert missing_blocks(spans, NUM_BLOCKS) == []
    assert sorted((spans[w.peer_id].start, spans[w.peer_id].end) for w in workers) == [(0, 4), (0, 4), (4, 8)]
    status = _status(s, eight_blocks)
    assert status.returncode == 0, status.stdout + status.stderr

    victim = next(w for w in workers if spans[w.peer_id].start == 4)
    survivors = [w for w in workers if w is not victim]
    victim.kill()  # the whole process group: worker, DHT process, p2pd
    t0 = time.monotonic()

    # the victim's records live until they expire (15 s here), then a survivor moves into the gap
    deadline = t0 + 90
    while time.monotonic() < deadline:
        spans = read()
        if victim.peer_id not in spans and not missing_blocks(spans, NUM_BLOCKS):
            break
        time.sleep(0.5)
    recovered = time.monotonic() - t0
    assert victim.peer_id not in spans and missing_blocks(spans, NUM_BLOCKS) == [], (recovered, spans)
    assert sorted((spans[w.peer_id].start, spans[w.peer_id].end) for w in survivors) == [(0, 4), (4, 8)]
    mover = next(w for w in survivors if spans[w.peer_id].start == 4)
    # the mover announces its new span before it retires the old one and says so: the line may lag the record
    mover.wait_for("swarmserve worker: now serving blocks 4:8", timeout=30)
    print(f"re-covered {recovered:.1f}s after the kill")
    status = _status(s, eight_blocks)
    assert status.returncode == 0, status.stdout + status.stderr

    # the moved server really computes blocks 4:8: greedy output equals the local model's
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    model = AutoDistributedModelForCausalLM.from_pretrained(eight_blocks, initial_peers=[s.initial_peers])
    try:
        ours = model.generate(prompt, max_new_tokens=8, do_sample=False)
    finally:
        model.shutdown()
    ref = local_llama_8.generate(prompt, max_new_tokens=8, do_sample=False)
    assert ours.tolist() == ref.tolist()


@pytest.fixture(scope="module")
def local_llama_8(eight_blocks: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(eight_blocks, dtype=torch.float32).eval()
