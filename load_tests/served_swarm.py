"""A swarm plus an in-process gateway for the benchmarks: ``swarmserve up`` with a handle on every piece.

``ServedSwarm`` is the shared launcher's ``LocalSwarm`` (a DHT in this process, worker children splitting
the model's blocks evenly) and ``gateway.run.serving_gateway`` (``SwarmBackend`` + app + uvicorn in a
thread) reusing that DHT; used by ``bench_concurrency.py`` and ``soak.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from swarmserve.launcher import LocalSwarm

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def resolve_model(name: str, workdir: Path) -> Path:
    """``tiny`` (hidden 64, 4 layers), ``medium`` (hidden 1024, 8 layers; random weights), ``smollm``
    (SmolLM2-135M-Instruct, offline) or a local path / hub id."""
    if name == "tiny":
        from swarm_client.tiny_model import make_tiny_model

        return Path(make_tiny_model(workdir / "tiny-llama", family="llama", num_layers=4, seed=0))
    if name == "medium":
        from load_tests.bench_decode import make_medium_model

        return Path(make_medium_model(workdir / "medium-llama"))
    from swarm_client.model_source import resolve_model_path

    if name == "smollm":
        name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return Path(resolve_model_path(name))


class ServedSwarm:
    """``workers`` block servers and a gateway on 127.0.0.1. Workers announce a fixed ``throughput`` (no
    startup benchmark, a deterministic route). Always ``close()`` it (or use ``with``): the gateway stops,
    the client closes its sessions, the workers drain (killed after ``grace`` seconds), the DHT goes."""

    def __init__(
        self,
        model_dir: Path,
        workers: int = 2,
        *,
        worker_threads: int | None = None,
        throughput: float | None = 1000.0,
        cache_tokens: int = 16384,
        ready_timeout: float = 600.0,
        gateway_settings: Mapping[str, Any] | None = None,
        worker_args: Sequence[str] = (),
        grace: float = 15.0,
        client_options: Mapping[str, Any] | None = None,
    ):
        self.model_dir = Path(model_dir)
        threads = worker_threads or max(1, (os.cpu_count() or 1) // workers)
        args = ["--cache-tokens", str(cache_tokens), "--update-period", "2"]
        if throughput is not None:
            args += ["--throughput", str(throughput)]
        self.swarm = LocalSwarm.covering(
            self.model_dir,
            workers,
            timeout=ready_timeout,
            threads=threads,
            worker_args=[*args, *worker_args],
            env=OFFLINE,
            grace=grace,
        )
        self.workers = self.swarm.workers
        self._stack = ExitStack()
        self._stack.callback(self.swarm.close)
        try:
            spans = ", ".join(w.span_text for w in self.workers)
            print(f"swarm: {len(self.workers)} worker(s) ready ({spans}), {threads} thread(s) each", flush=True)
            self.server, self.backend = self._stack.enter_context(
                self._gateway(dict(gateway_settings or {}), dict(client_options or {}))
            )
            print(f"gateway: {self.server.url}", flush=True)
        except BaseException:
            self.close()
            raise

    def _gateway(self, settings: dict[str, Any], client_options: dict[str, Any]):
        from gateway import GatewaySettings
        from gateway.run import GatewayConfig, serving_gateway

        settings.setdefault("model", str(self.model_dir))
        settings.setdefault("port", 0)
        settings["initial_peers"] = self.swarm.maddrs
        cfg = GatewayConfig(
            GatewaySettings(**settings),
            dht_prefix=self.swarm.prefix,
            client_options={"update_period": 2.0, **client_options},
        )
        return serving_gateway(cfg, dht=self.swarm.dht, log_level="warning")

    @property
    def url(self) -> str:
        return self.server.url

    def worker_infos(self) -> list[dict[str, Any]]:
        """Each worker's own report (cache use, sessions, batching counters), in span order."""
        infos = []
        for w in self.workers:
            info = dict(self.backend.server_info(w.peer_id, timeout=10.0))
            info["name"], info["span"] = w.name, w.span_text
            infos.append(info)
        return infos

    def worker_rss_mb(self) -> list[float | None]:
        """Resident memory of each worker process (its DHT child and p2pd not included)."""
        import psutil

        out: list[float | None] = []
        for w in self.workers:
            try:
                out.append(round(psutil.Process(w.pid).memory_info().rss / 2**20, 1))
            except psutil.Error:
                out.append(None)
        return out

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ServedSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gateway_overrides(**wanted: Any) -> dict[str, Any]:
    """The ``GatewaySettings`` fields among ``wanted`` that this gateway version has (others are dropped
    with a note): the scripts keep working while settings come and go."""
    from gateway import GatewaySettings

    fields = GatewaySettings.model_fields
    for name in sorted(set(wanted) - set(fields)):
        print(f"note: this gateway has no setting {name!r}; ignored", file=sys.stderr)
    return {k: v for k, v in wanted.items() if k in fields}


def eos_logit_bias(backend: Any) -> dict[str, float]:
    """``logit_bias`` that bans every EOS id: each request then makes exactly ``max_tokens`` tokens, so
    levels are compared on equal work."""
    from gateway.decode.engine import eos_token_ids

    return {str(i): -100.0 for i in sorted(eos_token_ids(backend))}
