"""What ``chaos.py`` adds for issue 35 ("load is not death"): a saturated CPU beside the swarm, a record of the
gateway client's ban decisions (who, how long, why; healthy servers told apart from the killed ones), and a
check that the gateway serves normally after the chaos.

- ``CpuBurn``: N busy processes (plain Python loops, or ``stress-ng --cpu N`` where installed) for the
  chaos phase, sampling the load average meanwhile (the audit's wedge came at load average 10–22 on 2 cores).
- ``BanRecorder``: a logging handler on the in-process gateway's ``swarm_client`` loggers; ``summary(killed)``
  says how many bans fell on servers that were alive (not SIGKILLed) and the longest of them, how often a
  server was kept while slow, and the watchdog's resets.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

__all__ = ["BanRecorder", "CpuBurn"]

_BAN = re.compile(r"banning peer (\S+) for ([\d.]+)s: (.*)")
_SLOW = re.compile(r"peer (\S+) is slow but the only server")


class CpuBurn:
    """``with CpuBurn(n):`` n processes spinning on the CPU (0: none); ``loadavg`` samples every second."""

    def __init__(self, processes: int):
        self.processes = processes
        self._procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self.loadavg: list[float] = []
        self.tool = ""

    def __enter__(self) -> CpuBurn:
        if self.processes > 0:
            stress = shutil.which("stress-ng")
            if stress:
                self.tool = f"stress-ng --cpu {self.processes}"
                self._procs = [subprocess.Popen([stress, "--cpu", str(self.processes), "--quiet"])]
            else:
                self.tool = f"{self.processes} Python busy loops"
                spin = "while True:\n    pass"
                self._procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(self.processes)]
        threading.Thread(target=self._sample, name="loadavg", daemon=True).start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self.loadavg.append(os.getloadavg()[0])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def as_dict(self) -> dict[str, Any]:
        xs = self.loadavg
        return {
            "processes": self.processes,
            "tool": self.tool or "none",
            "loadavg_median": round(sorted(xs)[len(xs) // 2], 2) if xs else None,
            "loadavg_max": round(max(xs), 2) if xs else None,
        }


@dataclass
class Ban:
    at_s: float
    peer: str
    seconds: float
    reason: str


class BanRecorder(logging.Handler):
    """Collects the client's ban, kept-while-slow and watchdog lines (``swarm_client`` logs them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.t0 = time.perf_counter()
        self.bans: list[Ban] = []
        self.kept_slow: list[str] = []
        self.watchdog: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if m := _BAN.search(text):
            self.bans.append(Ban(round(time.perf_counter() - self.t0, 3), m[1], float(m[2]), m[3][:200]))
        elif m := _SLOW.search(text):
            self.kept_slow.append(m[1])
        elif record.name.endswith("watchdog"):
            self.watchdog.append(text[:300])

    def attach(self) -> BanRecorder:
        for name in ("swarm_client.sequence_manager", "swarm_client.watchdog"):
            logger = logging.getLogger(name)
            logger.addHandler(self)
            logger.setLevel(logging.INFO)
        return self

    def detach(self) -> None:
        for name in ("swarm_client.sequence_manager", "swarm_client.watchdog"):
            logging.getLogger(name).removeHandler(self)

    def summary(self, killed: Collection[str]) -> dict[str, Any]:
        """Bans of servers that were never killed ("healthy") apart from the killed ones'; a healthy server
        banned again (``healthy_escalations``: banned for longer than one backoff) is a failure."""
        killed = set(killed)
        healthy = [b for b in self.bans if b.peer not in killed]
        seen: set[str] = set()
        escalations = 0
        for b in healthy:  # a healthy server banned again: its backoff grew past one step
            escalations += b.peer in seen
            seen.add(b.peer)
        return {
            "ban_decisions": len(self.bans),
            "killed_servers_bans": sum(1 for b in self.bans if b.peer in killed),
            "healthy_servers_bans": len(healthy),
            "healthy_longest_ban_s": max((b.seconds for b in healthy), default=0.0),
            "healthy_escalations": escalations,
            "healthy_ban_samples": [b.__dict__ for b in healthy[:8]],
            "kept_while_slow": len(self.kept_slow),
            "watchdog_resets": len(self.watchdog),
            "watchdog_samples": self.watchdog[:3],
        }
