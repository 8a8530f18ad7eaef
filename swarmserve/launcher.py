"""A swarm on this machine: ``LocalSwarm`` — a DHT and N block servers as ``swarmserve worker`` children —
shared by ``swarmserve up``, the test fixtures and every benchmark.

Readiness is the workers' ready line; a worker that dies first is reported with its last lines. Teardown:
workers get SIGTERM together (they announce OFFLINE and drain), are killed with their process group after a
grace period, the DHT goes last. The child processes themselves are ``swarmserve/processes.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmserve.processes import (
    DHT_READY,
    WORKER_READY,
    ChildProcess,
    Say,
    WorkerProcess,
    WorkerStartError,
    child_env,
    forks_in_their_own_session,
    stop_processes,
    swarmserve_argv,
    wait_ready,
)

__all__ = [
    "DHT_READY",
    "WORKER_READY",
    "ChildProcess",
    "LocalSwarm",
    "WorkerProcess",
    "WorkerStartError",
    "child_env",
    "model_num_blocks",
    "split_blocks",
    "stop_processes",
    "swarmserve_argv",
    "wait_ready",
]


def split_blocks(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    """``[0, num_blocks)`` in ``parts`` contiguous spans whose sizes differ by at most one (earlier ones
    larger): 30 blocks, 4 parts → 0:8, 8:16, 16:23, 23:30."""
    if num_blocks < 1 or parts < 1:
        raise ValueError(f"cannot split {num_blocks} blocks into {parts} parts")
    parts = min(parts, num_blocks)
    base, extra = divmod(num_blocks, parts)
    spans, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def model_num_blocks(model: str | Path) -> int:
    """The model's depth; a local directory's config.json is read directly (importing transformers costs
    seconds, which a status probe should not pay)."""
    config_file = Path(model).expanduser() / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(config.get(key), int):
                return int(config[key])
    from transformers import AutoConfig

    from swarm_client.model_source import resolve_model_path

    return int(AutoConfig.from_pretrained(resolve_model_path(str(model))).num_hidden_layers)


# ---------------------------------------------------------------------------------------------- the swarm
async def _serve_reachability_checks(dht: Any) -> Any:
    """Answer the workers' start-up reachability checks (``worker.reachability_service``) on the inline DHT
    node, as ``swarmserve dht`` does, from the client's I/O loop; returns the service (``close()`` it)."""
    from worker.reachability_service import ReachabilityService

    service = ReachabilityService()
    await service.add_p2p_handlers(await dht.replicate_p2p())
    return service


class LocalSwarm:
    """A DHT and block-server children on this machine; every process binds to 127.0.0.1.

    ``dht="inline"`` runs the bootstrap DHT in this process (as ``swarmserve up`` does: a gateway here can
    reuse it as ``self.dht``; it validates the records of the model's prefix), ``"process"`` in a
    ``swarmserve dht`` child (``self.dht_process``; tests kill and restart pieces independently).
    ``worker_args`` go to every worker; ``threads`` sets each worker's torch/BLAS threads. ``own_session``
    puts the inline DHT's process (and its p2pd) in a session of its own, as the workers are (``up``: a
    terminal's Ctrl-C reaches only this process, which stops them in order). Always ``close()`` it (or use
    ``with``).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dht: str = "inline",
        dht_prefix: str | None = None,
        threads: int | None = None,
        worker_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        echo: bool = False,
        grace: float = 15.0,
        say: Say | None = None,
        own_session: bool = False,
    ):
        from swarm_client.config import default_dht_prefix

        if dht not in ("inline", "process"):
            raise ValueError(f"dht must be 'inline' or 'process', not {dht!r}")
        self.model = str(model)
        self.prefix = dht_prefix or default_dht_prefix(self.model)
        self.threads = threads
        self.worker_args = list(worker_args)
        self.extra_env = dict(env or {})
        self.echo = echo
        self.grace = grace
        self.say = say
        self.own_session = own_session
        self.workers: list[WorkerProcess] = []
        self.dht: Any = None
        self.dht_process: ChildProcess | None = None
        self._checks: Any = None
        if dht == "inline":
            self._start_inline_dht()
        else:
            self._start_dht_process()

    def _start_inline_dht(self) -> None:
        # the DHT forks a process: start it before this process's torch spins up thread pools
        from hivemind.dht import DHT

        from swarm_client.dht_records import mark_validated, record_validators

        # the swarm's bootstrap node stores the servers' records: it checks their signatures and schema
        detached = forks_in_their_own_session() if self.own_session else contextlib.nullcontext()
        with detached:
            self.dht = DHT(
                initial_peers=[],
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                record_validators=record_validators(self.prefix),
                start=True,
            )
        mark_validated(self.dht)
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        from swarm_client import runtime

        self._checks = runtime.run(_serve_reachability_checks(self.dht), timeout=30)

    def _start_dht_process(self) -> None:
        # the workers' environment (their thread counts too): a test zygote forks both (swarmserve/zygote.py)
        self.dht_process = ChildProcess.spawn("dht", ["dht"], self._env(), echo=self.echo)
        try:
            line = self.dht_process.wait_for(DHT_READY)
        except BaseException:
            self.dht_process.kill()
            raise
        self.maddrs = [line.split(DHT_READY, 1)[1].strip()]

    @property
    def initial_peers(self) -> str:
        """The bootstrap multiaddr, as ``--initial-peers`` takes it."""
        return self.maddrs[0]

    @property
    def num_blocks(self) -> int:
        return model_num_blocks(self.model)

    def _env(self) -> dict[str, str]:
        return child_env(self.threads, self.extra_env)

    def add_worker(
        self,
        *extra: str,
        blocks: str | tuple[int, int] | None = None,
        name: str | None = None,
        wait: bool = True,
        timeout: float = 120.0,
    ) -> WorkerProcess:
        """Start one worker (``blocks`` "a:b", or its own choice with ``--num-blocks`` in ``extra``); with
        ``wait``, return once it is ready (``WorkerStartError`` if it dies first)."""
        span = tuple(int(x) for x in blocks.split(":")) if isinstance(blocks, str) else blocks
        args = ["worker", "--model", self.model, "--initial-peers", *self.maddrs, "--dht-prefix", self.prefix]
        if self.threads:
            args += ["--torch-threads", str(self.threads)]
        args += [*self.worker_args, *extra]
        if span is not None:
            args += ["--blocks", f"{span[0]}:{span[1]}"]
        worker = WorkerProcess.spawn(name or f"worker{len(self.workers)}", args, self._env(), echo=self.echo, span=span)
        self.workers.append(worker)
        if self.say is not None:
            self.say(f"{worker.name} (blocks {worker.span_text}) starting, pid {worker.pid}")
        if wait:
            wait_ready([worker], timeout)
        return worker

    def cover(
        self, parts: int, *extra: str, timeout: float = 600.0, stop: threading.Event | None = None
    ) -> list[WorkerProcess]:
        """Split the model's blocks evenly over ``parts`` workers, start them together and wait until all
        are ready (``WorkerStartError`` / ``InterruptedError`` otherwise). Without ``threads``, each worker
        gets an equal share of this machine's cores."""
        spans = split_blocks(self.num_blocks, parts)
        if self.threads is None:
            self.threads = max(1, (os.cpu_count() or 1) // len(spans))
        started = [
            self.add_worker(*extra, blocks=span, name=f"worker {i + 1}/{len(spans)}", wait=False)
            for i, span in enumerate(spans)
        ]
        wait_ready(started, timeout, stop=stop, say=self.say)
        return started

    @classmethod
    def covering(cls, model: str | Path, parts: int, *extra: str, timeout: float = 600.0, **kw: Any) -> LocalSwarm:
        """A new swarm whose ``parts`` workers cover the model (``cover``), closed again if they fail."""
        swarm = cls(model, **kw)
        try:
            swarm.cover(parts, *extra, timeout=timeout)
        except BaseException:
            swarm.close()
            raise
        return swarm

    def close(self) -> None:
        if self.workers:
            stop_processes(self.workers, self.grace, self.say)
        if self._checks is not None:
            from swarm_client import runtime

            with contextlib.suppress(Exception):
                runtime.run(self._checks.close(), timeout=5)
            self._checks = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.dht_process is not None:
            self.dht_process.stop(timeout=5)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
