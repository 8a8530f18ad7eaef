"""The zygote process itself (``python -m swarmserve.zygote_process FD``): imports ``PRELOAD``, then forks
one ``swarmserve`` child per request on the socket ``FD`` and reports their exits. The caller's side, the
protocol and the rules for what may be forked are in ``swarmserve/zygote.py``."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from swarmserve.zygote import _PACKET, parent_death_signal

__all__ = ["PRELOAD", "main"]

#: what every ``swarmserve worker`` imports on its way to the ready line (``-X importtime`` of a worker)
PRELOAD = (
    "numpy",
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.modeling_layers",
    "transformers.tokenization_utils_base",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.falcon.modeling_falcon",
    "transformers.models.bloom.modeling_bloom",
    "hivemind.dht",
    "hivemind.p2p",
    "swarmserve.cli",
    "swarmserve.cli.worker",
    "swarm_client.config",
    "swarm_client.lora",
    "worker.config",
    "worker.run",
)

_REAP_EVERY = 0.05  # seconds between the zygote's checks for ended children


def _serve(sock: socket.socket, set_parent_death_signal: Callable[[], None] | None) -> dict[str, Any] | None:
    """The zygote's loop: fork a child per request, report each child's exit. Returns only in a forked
    child (its request, with ``fd`` the write end of its output pipe), or None once the caller is gone."""
    sock.send(json.dumps({"id": "ready"}).encode())
    children: set[int] = set()
    cwd = os.getcwd()
    while True:
        ready, _, _ = select.select([sock], [], [], _REAP_EVERY)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "code": _returncode(status)})
        if not ready:
            continue
        try:
            payload, fds, _, _ = socket.recv_fds(sock, _PACKET, 1)
        except OSError:
            payload, fds = b"", []
        if not payload:
            return None
        request = json.loads(payload)
        fd = fds[0]
        threads = threading.active_count()
        if threads != 1:
            os.close(fd)
            _send(sock, {"id": request["id"], "error": f"the zygote has {threads} threads: it would not fork"})
            continue
        zygote = os.getpid()
        started_r, started_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.close(started_r)
            _own_session(zygote, set_parent_death_signal)
            os.close(started_w)  # as Popen(start_new_session=True) returns: the session exists
            request.update(fd=fd, zygote_cwd=cwd)
            return request
        os.close(fd)
        os.close(started_w)
        os.read(started_r, 1)  # EOF once the child has its session (or died first: its exit comes next)
        os.close(started_r)
        children.add(pid)
        _send(sock, {"id": request["id"], "pid": pid})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the caller is gone; the next recv says so


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _own_session(zygote: int, set_parent_death_signal: Callable[[], None] | None) -> None:
    """In the forked child, first: a session (and process group) of its own, SIGTERM when the zygote dies."""
    os.setsid()
    if set_parent_death_signal is not None:
        set_parent_death_signal()
    if os.getppid() != zygote:  # the zygote died before the signal was asked for
        os._exit(1)


def _become(request: dict[str, Any]) -> None:
    """In the forked child: turn into ``python -m swarmserve ARGV`` started by the caller."""
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(request["fd"], 1)
    os.dup2(request["fd"], 2)
    os.close(request["fd"])
    os.chdir(request["cwd"])
    if sys.path and sys.path[0] == request["zygote_cwd"]:
        sys.path[0] = request["cwd"]  # ``python -m`` puts its working directory first
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_randomness()
    import swarmserve

    main = os.path.join(os.path.dirname(swarmserve.__file__), "__main__.py")
    sys.argv = [main, *request["argv"]]


def _fresh_randomness() -> None:
    """What a new interpreter draws at start-up, drawn again (CPython re-seeds ``random`` itself)."""
    import multiprocessing

    multiprocessing.current_process().authkey = os.urandom(32)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main(argv: list[str] | None = None) -> None:
    import importlib
    import runpy

    fd = int((argv if argv is not None else sys.argv[1:])[0])
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional part (a family's modeling file): the child imports what it needs
            print(f"swarmserve zygote: not preloaded: {name} ({exc})", flush=True)
    set_parent_death_signal = parent_death_signal()
    sys.stdout.flush()
    sys.stderr.flush()
    request = _serve(sock, set_parent_death_signal)
    if request is None:
        return
    _become(request)
    # as ``python -m swarmserve``: an exception here reaches the interpreter's top level (traceback, exit 1)
    runpy.run_module("swarmserve", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
