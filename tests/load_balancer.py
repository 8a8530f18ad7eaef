"""A real HAProxy (Debian's ``haproxy``) in front of gateway replicas, for tests and benchmarks: ``HAProxy``
writes a config on free ports, runs ``haproxy -db`` in the foreground as a child, and reads its servers'
states from the stats page's CSV.

The config is what an operator would run in front of ``swarmserve gateway`` replicas (docs/operations.md):
round robin per request (``option http-server-close``: the client's keep-alive connection is HAProxy's, and
each request is balanced on its own), health checks on each replica's ``/health``, server timeouts long
enough for a stream's slowest gap (SSE bodies are forwarded as they come), and a request whose replica
refuses the connection is sent to another one (``retries`` + ``option redispatch``) — nothing of it was
sent, so that is safe for a POST. A replica that dies mid-response cannot be retried by the balancer: its
client sees the response cut and retries itself.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

__all__ = ["HAPROXY", "HAProxy", "haproxy_config"]

HAPROXY = "haproxy"


def haproxy_config(port: int, stats_port: int, servers: dict[str, str], *, check_ms: int = 500) -> str:
    """The config text: ``servers`` maps a name to ``host:port``; the API on ``port``, stats on ``stats_port``."""
    lines = [
        "global",
        "    maxconn 1024",
        "defaults",
        "    mode http",
        "    option http-server-close",  # each request balanced on its own, whatever the client's keep-alive
        "    option redispatch",  # a refused connection's retry goes to another replica
        "    retries 2",
        "    timeout connect 1s",
        # a busy replica answers /health late (2 loaded cores): a check fails on a refused connection at once,
        # on a slow answer only after this
        "    timeout check 3s",
        "    timeout client 300s",  # a stream's gaps (a long prefill) and an idle SDK connection
        "    timeout server 300s",
        "    timeout http-request 10s",
        "    timeout http-keep-alive 10s",
        "    timeout queue 10s",
        "frontend api",
        f"    bind 127.0.0.1:{port}",
        "    default_backend gateways",
        "backend gateways",
        "    balance roundrobin",
        "    option httpchk GET /health",
        "    http-check expect status 200",
        f"    default-server inter {check_ms}ms fastinter {check_ms // 2}ms downinter {check_ms}ms fall 2 rise 1",
        *(f"    server {name} {address} check" for name, address in servers.items()),
        "listen stats",
        f"    bind 127.0.0.1:{stats_port}",
        "    stats enable",
        "    stats uri /stats",
    ]
    return "\n".join(lines) + "\n"


class HAProxy:
    """``haproxy -db -f <generated config>``; ``url`` is the API's address, ``states()`` each server's state."""

    def __init__(self, port: int, stats_port: int, servers: dict[str, str], *, check_ms: int = 500):
        self.port, self.stats_port, self.servers = port, stats_port, dict(servers)
        self.url = f"http://127.0.0.1:{port}"
        self._dir = Path(tempfile.mkdtemp(prefix="swarmserve-haproxy-"))
        self.config = self._dir / "haproxy.cfg"
        self.config.write_text(haproxy_config(port, stats_port, servers, check_ms=check_ms))
        self.log = self._dir / "haproxy.log"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which(HAPROXY) is not None

    def start(self, timeout: float = 20.0) -> HAProxy:
        check = subprocess.run([HAPROXY, "-c", "-q", "-f", str(self.config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejects its config: {check.stdout}{check.stderr}\n{self.config.read_text()}")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.config)], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                self.states()
                return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"haproxy did not listen within {timeout}s: {self.log.read_text()}")

    def stats(self) -> dict[str, dict[str, str]]:
        """The stats page's CSV row of each server (and ``BACKEND``): ``status``, ``lastchg`` (seconds since
        its state changed), ``econ`` (connections that failed), ``wredis`` (requests sent elsewhere) ..."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text.lstrip("# ")
        return {r["svname"]: r for r in csv.DictReader(io.StringIO(text)) if r["pxname"] == "gateways"}

    def states(self) -> dict[str, str]:
        """Each server's state as HAProxy sees it: ``UP``, ``DOWN``, ``UP 1/2`` (going down) and so on."""
        return {name: row["status"] for name, row in self.stats().items() if name in self.servers}

    def wait_states(self, want: dict[str, str], timeout: float = 30.0) -> float:
        """Wait until the servers named in ``want`` have those states; the seconds it took."""
        started = time.monotonic()
        while (states := self.states()) != {**states, **want}:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"haproxy's servers are {states}, not {want}, after {timeout}s")
            time.sleep(0.05)
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
