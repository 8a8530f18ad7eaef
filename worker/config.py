"""A block server's settings (``WorkerConfig``, filled by ``swarmserve worker``) and the addresses it announces."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm_client.lora import AdapterSpec
from swarm_client.protocol import MAX_STEP_TOKENS
from worker.message_cap import DEFAULT_MAX_MESSAGE_BYTES
from worker.uploads import DEFAULT_UPLOAD_BUDGET

__all__ = ["WorkerConfig", "announce_list", "cache_settings"]


@dataclass
class WorkerConfig:
    model: str
    initial_peers: list[str] = field(default_factory=list)
    blocks: tuple[int, int] | None = None
    num_blocks: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    #: on a float32 CPU server, projections run on packed weights: "auto" (our panel kernel where it builds,
    #: else oneDNN), "panels", "onednn" or "torch" (swarm_client/kernels/cpu_kernels.py)
    cpu_kernels: str = "auto"
    #: weight quantization of the projections: "none", "int8", "nf4" or "auto" (by the span's size vs the free
    #: memory); CPU: our int8/NF4 kernels, CUDA: bitsandbytes (worker/quant.py)
    quant: str = "none"
    #: LoRA adapters served beside the base blocks (``--adapters NAME=PATH``; swarm_client/lora.py)
    adapters: list[AdapterSpec] = field(default_factory=list)
    #: KV-cache budget in token slots; None: sized from free memory (worker/cache_size.py)
    cache_tokens: int | None = None
    session_ttl: float = 300.0
    idle_timeout: float = 300.0
    host: str = "127.0.0.1"
    port: int = 0
    #: announce ``/ip4/public_ip/tcp/port`` (needs a fixed ``port``) instead of the addresses we listen on
    public_ip: str | None = None
    #: announce these multiaddrs too (each with an explicit port); with neither, hivemind announces ours
    announce_maddrs: list[str] = field(default_factory=list)
    dht_prefix: str | None = None
    update_period: float = 5.0
    expiration: float | None = None
    drain_timeout: float = 10.0
    throughput: float | None = None
    public_name: str | None = None
    max_sessions_per_peer: int = 1024
    #: sessions of all peers together (detached ones are evicted first)
    max_sessions: int = 4096
    #: share of the cache one holder (caller IP; peer id on loopback) is sure of; beyond it, its idle sessions
    #: are evicted when a holder within its share needs room (worker/cache_policy.py); 1.0: never
    peer_cache_share: float = 0.25
    #: a session not stepped for this long is idle (evictable beyond its holder's share)
    evict_idle_after: float = 2.0
    #: idle timeout of a stream while less than 10% of the cache is free
    pressure_idle_timeout: float = 30.0
    #: one serialized tensor may not exceed this (checked on the wire, before deserializing)
    max_tensor_bytes: int = 256 * 2**20
    #: one inference step may carry at most this many tokens (batch × length; clients split prefills)
    max_step_tokens: int = MAX_STEP_TOKENS
    #: one stream message may not exceed this, checked on its header before hivemind reads it (worker/message_cap.py)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: bytes of forward/backward uploads held at once, all requests together (worker/uploads.py)
    max_upload_bytes: int = DEFAULT_UPLOAD_BUDGET
    #: a ``--num-blocks`` server moves only if that makes the weakest block this much stronger
    #: (``current_min < balance_quality * new_min``; see ``worker.block_selection``)
    balance_quality: float = 0.75
    #: seconds (jittered ±50%) between balance checks of a ``--num-blocks`` server; 0 disables moving
    rebalance_period: float = 60.0
    #: test-only: "KIND[:AFTER_STEPS]" with KIND in nan, hang, wrong-shape, noise, slow
    fault: str | None = None
    #: serve Prometheus metrics on ``host:metrics_port`` (worker/metrics.py); 0 = off
    metrics_port: int = 0
    #: ask peers to dial us back before going ONLINE (worker/reachability.py); off: announce reachability None
    reachability_check: bool = True
    #: "auto": a server the check finds unreachable tries to serve through its initial peers as libp2p relays
    #: (worker/relay.py) before giving up; "off": it exits at once
    relay: str = "auto"


def announce_list(cfg: WorkerConfig) -> list[str]:
    """``cfg.announce_maddrs`` plus ``/ipN/public_ip/tcp/port``; ``ValueError`` if ``public_ip`` has no fixed port."""
    if cfg.public_ip and not cfg.port:
        raise ValueError("public_ip needs a fixed port (the one forwarded to this server), not 0")
    ip = cfg.public_ip and f"/ip{6 if ':' in cfg.public_ip else 4}/{cfg.public_ip}/tcp/{cfg.port}"
    return list(cfg.announce_maddrs) + ([ip] if ip else [])


def cache_settings(cfg: WorkerConfig) -> dict:
    """``CacheManager`` keywords from the config (all but the budget and the span's shape)."""
    return {
        "session_ttl": cfg.session_ttl,
        "max_sessions_per_peer": cfg.max_sessions_per_peer,
        "max_sessions": cfg.max_sessions,
        "peer_share": cfg.peer_cache_share,
        "evict_idle_after": cfg.evict_idle_after,
        "pressure_idle_timeout": cfg.pressure_idle_timeout,
    }
