"""Real multi-process swarms for integration tests, on the shared launcher (``swarmserve/launcher.py``):
a ``swarmserve dht`` bootstrap process and ``swarmserve worker`` processes, one torch thread each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from swarmserve.launcher import ChildProcess, LocalSwarm, WorkerProcess, child_env
from swarmserve.processes import wait_ready

__all__ = ["Proc", "Swarm", "WorkerProcess", "greedy_route", "greedy_session", "spawn", "swarm"]

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
def swarm(model_path: str, spans: list[str], *extra: str, timeout: float = 180.0) -> Iterator[Swarm]:
    """A DHT and one worker per span, started together (their imports overlap: a 2-worker swarm is ready in
    about the time of one worker's start, not two), ready when every worker is."""
    s = Swarm(model_path)
    try:
        started = [s.add_worker(*extra, blocks=span, wait=False) for span in spans]
        wait_ready(started, timeout)
        yield s
    finally:
        s.close()


def greedy_session(model, prompt, new_tokens: int):
    """Greedy tokens of ``model`` after ``prompt`` [1, T] in one session, and that (closed) session: its
    route, spot checks and the rest stay readable."""
    import torch

    tokens = []
    with torch.inference_mode(), model.inference_session(max_length=prompt.shape[1] + new_tokens) as session:
        logits = model(prompt, session=session).logits
        for step in range(new_tokens):
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            if step + 1 < new_tokens:
                logits = model(token, session=session).logits
    return tokens, session


def greedy_route(model, prompt, new_tokens: int) -> tuple[list[int], list]:
    """Greedy tokens of ``model`` after ``prompt`` [1, T], one session, and the route that session took."""
    tokens, session = greedy_session(model, prompt, new_tokens)
    return tokens, session.route
