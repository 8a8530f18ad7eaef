"""What a client is told: ``ClientConfig`` (every option of ``SequenceManager`` and the model, with defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm_client.lora import check_adapter_name
from swarm_client.precision import check_min_precision
from swarm_client.protocol import MAX_PIPELINE_GROUPS
from swarm_client.routing import CLAIM_CAP_FACTOR

#: default ``ClientConfig.spot_check_rate`` (its cost: load_tests/results/spot-check-cost-2026-12-06.json)
DEFAULT_SPOT_CHECK_RATE = 0.03

#: ``ClientConfig.pipeline_groups`` value: one group per server of each session's route
AUTO_GROUPS = "auto"
#: ``ClientConfig.push`` value: push where the measured RTTs say it pays (``SequenceManager.push_pays``)
AUTO_PUSH = "auto"


def check_pipeline_groups(groups: object) -> int | str:
    """``groups`` itself if it is a valid ``ClientConfig.pipeline_groups``; a ValueError otherwise."""
    if groups == AUTO_GROUPS or (
        isinstance(groups, int) and not isinstance(groups, bool) and 1 <= groups <= MAX_PIPELINE_GROUPS
    ):
        return groups  # type: ignore[return-value]
    raise ValueError(f"pipeline_groups must be an int in [1, {MAX_PIPELINE_GROUPS}] or {AUTO_GROUPS!r}, got {groups!r}")


@dataclass
class ClientConfig:
    initial_peers: list[str]
    dht_prefix: str
    num_blocks: int
    #: how often the swarm view is re-read from the DHT in the background (routing never waits on that read)
    update_period: float = 5.0
    #: a single inference step (one server) must answer within this
    step_timeout: float = 30.0
    #: opening a stream to a server (dialing a dead peer must not stall a request for long)
    connect_timeout: float = 5.0
    #: forward/backward/info calls
    request_timeout: float = 60.0
    #: total time a step may spend failing over before SessionLost / NoRouteError
    failover_deadline: float = 60.0
    #: a new peer's first ping (its RTT) must answer within this, else the peer is banned as unreachable
    ping_timeout: float = 3.0
    #: the client's DHT node deems a DHT request lost after this (hivemind's default, 3 s, is what one dead or
    #: unreachable DHT peer added to a swarm read; hivemind then skips that peer for a while)
    dht_wait_timeout: float = 1.0
    #: route discovery stops waiting for the pings of new peers once those that answered cover the blocks and
    #: this long passed since the pings started (``pings``: the rest go on in the background) ...
    ping_grace: float = 0.3
    #: ... or this many times the fastest answer, if that is less (a LAN swarm: a few ms)
    ping_grace_factor: float = 3.0
    #: a step silent for this long triggers a liveness ping of its server (see _ServerSession)
    probe_after: float = 1.0
    #: a liveness ping of a silent step's server must answer within this; a busy server computing a long step
    #: still answers pings at once (its event loop is free: 3.5 ms median, 42 ms max during a 2.5 s prefill), so ...
    silent_ping_timeout: float = 0.75
    #: ... this many unanswered liveness pings in a row mean the server is gone (stopped, frozen, cut off), not
    #: busy: the step fails with ``PeerTimeout`` and failover starts
    silent_pings: int = 2
    #: the slowest link a ping's allowance assumes for the step's own bytes ahead of it on the connection
    #: (a 418-token float32 prefill, 963 kB, took 4.3 s per hop at 25 ms one way with slow start: 0.75 s pings
    #: failed it); 200 kB/s adds 11 ms for a one-token step of a 576-wide model, 4.8 s for that prefill
    slow_link_bytes_per_s: float = 200_000.0
    #: how long opening a span keeps re-reading the DHT while some of its blocks have no usable server (a
    #: restarting server announces itself again within seconds), before ``NoRouteError``
    route_wait: float = 10.0
    #: fraction of inference steps re-run on a second server of the same blocks (where one exists) to catch
    #: servers returning wrong activations; load_tests/spot_check_cost.py measures what it costs
    spot_check_rate: float = DEFAULT_SPOT_CHECK_RATE
    #: relative L2 difference above which a spot-checked server is considered wrong (bfloat16 servers ≈ 1e-2)
    spot_check_tolerance: float = 5e-2
    #: how long a step waits for its spot check after the checked server answered; a later check is dropped
    spot_check_wait: float = 2.0
    compression: str = "none"
    #: server-to-server push: each server also sends its output straight to the next server of the chain,
    #: which starts computing at once (the client sends its own copy only if the answer is late: ``push_grace``).
    #: "auto": on for a chain of 2+ servers unless every later server is nearer than ``push_min_rtt`` (a LAN or
    #: one machine, where it saves nothing and costs a message per hop) or ``step_bundles`` is on (a pushed step
    #: cannot travel in a bundle); True / False: always / never
    push: bool | str = AUTO_PUSH
    #: under ``push="auto"``: the measured RTT (client to server) from which pushing to a server pays
    push_min_rtt: float = 0.005
    #: pipeline groups: sessions are dealt round-robin into this many groups, and a server batches one group's
    #: steps at a time, so consecutive servers of a chain compute different groups at once instead of each
    #: idling while the other computes the one big batch (1: no groups, every session batches with every other;
    #: "auto": as many groups as the session's route has servers, decided when its chain is first routed)
    pipeline_groups: int | str = 1
    #: bundled steps: the steps of all sessions bound for one server in the same few event-loop iterations
    #: travel as one message each way (``swarm_client.step_bundles``), where the server announces the feature
    step_bundles: bool = False
    ban_base: float = 1.0
    ban_max: float = 60.0
    #: a server that answered "busy" (full, not faulty) is avoided by routing for this long — never banned
    busy_mark: float = 2.0
    #: how long opening a span keeps retrying while every server of it is busy, before ``SwarmBusyError``
    #: (the gateway queues the request itself; a library caller may wait longer)
    busy_wait: float = 3.0
    #: trust policy: peer ids allowed to serve the first and the last block (their activations are closest to
    #: the text); empty: any server may. A list, or one comma-separated string
    trusted_peers: list[str] = field(default_factory=list)
    #: an announced throughput counts for at most this many times the median claim (``routing``)
    throughput_cap_factor: float = CLAIM_CAP_FACTOR
    #: the least precise server weights a route may use (``swarm_client.precision``): "full" (no quantized
    #: server), "int8", "nf4" or "any" (also quantizations newer than this client)
    min_precision: str = "any"
    #: the served LoRA adapter (``swarmserve worker --adapters NAME=PATH``) sessions and forward/backward run
    #: with unless a session names its own (``inference_session(adapter=...)``); None: the base model. Routes
    #: use only servers announcing it for their blocks
    active_adapter: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.trusted_peers = parse_peer_ids(self.trusted_peers)
        check_min_precision(self.min_precision)
        if self.active_adapter is not None:
            check_adapter_name(self.active_adapter)
        if self.push not in (True, False, AUTO_PUSH):
            raise ValueError(f"push must be True, False or {AUTO_PUSH!r}, got {self.push!r}")


def parse_peer_ids(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Peer ids from a list and/or comma- or space-separated strings, duplicates dropped, order kept."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    ids: list[str] = []
    for item in items:
        for part in str(item).replace(",", " ").split():
            if part not in ids:
                ids.append(part)
    return ids
