"""The gateway over a swarm as a service: ``run_gateway(config, stop)`` (``swarmserve gateway``) and the
``serving_gateway`` context (``swarmserve up`` and benchmarks, which may hand over a DHT of their own)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gateway.app import create_app
from gateway.backends.swarm import SwarmBackend
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings

__all__ = ["GatewayConfig", "run_gateway", "serving_gateway"]


@dataclass
class GatewayConfig:
    """What a gateway process needs beyond ``GatewaySettings`` (model, peers, host, port, limits…)."""

    settings: GatewaySettings
    #: the name clients use (default: ``settings.model``)
    model_id: str | None = None
    #: DHT namespace (default: the model's basename)
    dht_prefix: str | None = None
    #: ``swarm_client`` options of the gateway's client (``pipeline_groups``, ``step_bundles``, ``push``…)
    client_options: dict[str, Any] = field(default_factory=dict)


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: the server's own /health probe would show up in the output."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def trust_policy(trusted_peers: list[str], client_options: dict[str, Any]) -> dict[str, Any]:
    """The client options with the settings' trust policy (``SWARMSERVE_TRUSTED_PEERS``) where they name none."""
    if trusted_peers and "trusted_peers" not in client_options:
        return {**client_options, "trusted_peers": list(trusted_peers)}
    return client_options


@contextmanager
def serving_gateway(
    cfg: GatewayConfig,
    *,
    dht: Any = None,
    log_level: str | None = None,
    wait_healthy: bool = True,
    timeout: float = 120.0,
) -> Iterator[tuple[BackgroundServer, SwarmBackend]]:
    """The app over a ``SwarmBackend`` served by uvicorn in a thread of this process; on exit the server
    stops first (no new sessions), then the client closes its sessions (servers free their caches)."""
    settings = cfg.settings
    backend = SwarmBackend(
        settings.model,
        settings.initial_peers,
        model_id=cfg.model_id or settings.model,
        dht_prefix=cfg.dht_prefix,
        dht=dht,
        **trust_policy(settings.trusted_peers, cfg.client_options),
    )
    server = None
    try:
        app = create_app(backend, settings)
        server = BackgroundServer(app, settings.host, settings.port, log_level=log_level or settings.log_level)
        server.start(timeout, wait_healthy=wait_healthy)
        yield server, backend
    finally:
        if server is not None:
            server.stop()
        backend.close()


def run_gateway(cfg: GatewayConfig, stop: threading.Event) -> int:
    """Serve until ``stop`` is set; prints one ready line with the swarm's coverage and the base URL."""
    quiet_http_logs()
    with serving_gateway(cfg, wait_healthy=False) as (server, backend):
        state = backend.swarm_state()
        missing = state["missing_blocks"]
        coverage = "all blocks served" if not missing else f"blocks {missing} not served yet (/health is 503)"
        print(
            f"swarmserve gateway ready: {backend.model_id} ({backend.dht_prefix}, "
            f"{backend.num_blocks} blocks, {len(state['spans'])} servers; {coverage}); "
            f"OpenAI base URL: {server.base_url}; chat page: {server.url}/chat",
            flush=True,
        )
        stop.wait()
        print("swarmserve gateway: shutting down", flush=True)
    return 0
