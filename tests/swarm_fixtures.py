"""Real multi-process swarms for integration tests, on the shared launcher (``swarmserve/launcher.py``):
a ``swarmserve dht`` bootstrap process and ``swarmserve worker`` processes, one torch thread each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from swarmserve.launcher import ChildProcess, LocalSwarm, WorkerProcess, child_env

__all__ = ["Proc", "Swarm", "WorkerProcess", "spawn", "swarm"]

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

#: a child process whose output lines the tests read (``wait_for``, ``lines``, ``stop``, ``kill``)
Proc = ChildProcess


def spawn(name: str, args: list[str]) -> ChildProcess:
    """``swarmserve *args`` as a child with one torch thread, offline."""
    return ChildProcess.spawn(name, args, child_env(1, OFFLINE))


class Swarm(LocalSwarm):
    """A DHT bootstrap process plus workers; ``add_worker`` blocks until the worker is ONLINE."""

    def __init__(self, model_path: str):
        super().__init__(
            model_path, dht="process", threads=1, worker_args=["--update-period", "1"], env=OFFLINE, grace=5.0
        )


@contextlib.contextmanager
def swarm(model_path: str, spans: list[str], *extra: str) -> Iterator[Swarm]:
    s = Swarm(model_path)
    try:
        for span in spans:
            s.add_worker(*extra, blocks=span)
        yield s
    finally:
        s.close()
