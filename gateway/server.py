"""Running the app under uvicorn: ``serve`` (blocking, signals handled: the CLI) and ``BackgroundServer``
(a thread on a pre-bound socket: tests and the embedded ``swarmserve up``)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from gateway.settings import GatewaySettings

__all__ = ["BackgroundServer", "serve"]


def serve(app: FastAPI, settings: GatewaySettings) -> None:
    """Serve until SIGINT/SIGTERM."""
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, proxy_headers=False)


class BackgroundServer:
    """uvicorn serving ``app`` from a daemon thread.

    The socket is bound before the thread starts (``port=0``: a free port, no race with other processes),
    ``start()`` returns once ``/health`` answers 200 and raises if the server died or never got healthy;
    ``stop()`` asks uvicorn to exit, then forces it.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"):
        self.app = app
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        # proxy_headers off: uvicorn would otherwise believe X-Forwarded-For from any local peer; which proxies
        # name the client is the gateway's own setting (``trusted_proxies``, gateway/admission/ratelimit.py)
        config = uvicorn.Config(
            app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5, proxy_headers=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"gateway:{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What the OpenAI SDK wants as ``base_url``."""
        return f"{self.url}/v1"

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # surfaced by start()
            self._error = exc

    def start(self, timeout: float = 30.0, *, wait_healthy: bool = True) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"gateway server exited during startup: {self._error!r}")
            if self._server.started:
                if not wait_healthy:
                    return self
                try:
                    r = httpx.get(f"{self.url}/health", timeout=2.0)
                    if r.status_code == 200:
                        return self
                    last = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"gateway at {self.url} not healthy after {timeout}s (last: {last})")

    def stop(self, timeout: float = 10.0) -> None:
        # set the flag rather than calling handle_exit(): sse-starlette patches handle_exit to end *every*
        # stream in the process, which would break other servers still running in it
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
