"""Real multi-process swarms for integration tests: a DHT bootstrap process and worker processes."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

READY_TIMEOUT = 120.0


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


@dataclass
class Proc:
    """A child process whose stdout lines are collected in the background."""

    name: str
    popen: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def read() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                self.lines.append(line.rstrip("\n"))
                self._queue.put(line.rstrip("\n"))
            self._queue.put(None)

        threading.Thread(target=read, daemon=True).start()

    def wait_for(self, prefix: str, timeout: float = READY_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(
                    f"{self.name} exited (rc={self.popen.poll()}) before printing {prefix!r}:\n"
                    + "\n".join(self.lines[-40:])
                )
            if line.startswith(prefix):
                return line
        raise TimeoutError(
            f"{self.name} did not print {prefix!r} within {timeout}s:\n" + "\n".join(self.lines[-40:])
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._kill_group()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the whole server: the worker, its DHT process and its p2p daemon (a machine dying)."""
        self._kill_group()
        self.popen.wait(5)

    def _kill_group(self) -> None:
        # children (hivemind's DHT process, p2pd) would otherwise outlive a killed worker
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def spawn(name: str, args: list[str]) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    proc = Proc(name, popen)
    proc.start_reader()
    return proc


class Swarm:
    """A DHT bootstrap node plus workers; ``add_worker`` blocks until the worker is ONLINE."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.dht = spawn("dht", ["dht"])
        line = self.dht.wait_for("initial_peers:")
        self.initial_peers = line.split("initial_peers:", 1)[1].strip()
        self.workers: list[Proc] = []

    def add_worker(self, *extra: str, blocks: str | None = None, wait: bool = True) -> Proc:
        args = [
            "worker",
            "--model",
            self.model_path,
            "--initial-peers",
            self.initial_peers,
            "--update-period",
            "1",
            "--torch-threads",
            "1",
            *extra,
        ]
        if blocks is not None:
            args += ["--blocks", blocks]
        proc = spawn(f"worker{len(self.workers)}", args)
        self.workers.append(proc)
        if wait:
            line = proc.wait_for("swarmserve worker ready:")
            proc.peer_id = line.split(" as peer ", 1)[1].split(";", 1)[0]
        return proc

    def close(self) -> None:
        for proc in self.workers:
            proc.stop(timeout=5)
        self.dht.stop(timeout=5)


@contextlib.contextmanager
def swarm(model_path: str, spans: list[str], *extra: str) -> Iterator[Swarm]:
    s = Swarm(model_path)
    try:
        for span in spans:
            s.add_worker(*extra, blocks=span)
        yield s
    finally:
        s.close()
