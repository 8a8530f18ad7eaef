"""A pre-imported process that forks ``swarmserve`` children: the test suite's worker start-up without the
imports (opt-in: ``use_zygote``, which the tests' conftest calls; ``swarmserve up`` does not use it).

Every ``swarmserve worker`` spends most of its start-up importing torch, transformers and hivemind (about
3 s of CPU on a calm core of the 2-core CI machine). The zygote (``swarmserve/zygote_process.py``) is a
long-lived interpreter that imports them (its ``PRELOAD``) and nothing else — no thread of its own, no event
loop, no DHT, no p2p daemon — and forks one child per request. The child then is what ``python -m
swarmserve ARGS`` would be: it gets the request's argv, environment and working directory, a session of its
own (its process group, killed as one; it exists when ``spawn`` returns, as with ``Popen``), SIGTERM when
the zygote dies, ``/dev/null`` as stdin and the caller's pipe as stdout + stderr, and runs ``swarmserve``'s
``__main__`` as the interpreter would. Its exit status goes back to the caller, whose ``ForkedChild``
answers ``poll`` / ``wait`` / ``returncode`` / ``send_signal`` / ``kill`` / ``stdout`` as ``subprocess.Popen``
does: ``ChildProcess`` cannot tell the difference. What does differ: ``/proc/PID/cmdline`` and ``environ``
(``ps``) show the zygote's, not the child's (its ``os.environ`` and what it starts are the child's), and its
parent is the zygote, not the caller.

A child is forked only where that is the same as a new interpreter:

* the request's environment equals the zygote's but for ``_FREE_NAMES`` and ``SWARMSERVE_*`` (read only
  when used, never at import): the libraries imported here read theirs at import (Hugging Face's offline
  flags, OpenMP's and the BLAS's thread counts); any other difference starts a new interpreter;
* the zygote has one thread when it forks (``threading.active_count() == 1``, checked before every fork;
  the BLAS thread pools numpy and SciPy start at import are native and re-made after a fork by their
  ``pthread_atfork`` handlers, as for hivemind's own DHT process, which every worker forks after importing
  them); a command that is not ``python -m swarmserve …`` is not forked either;
* in the child, what a new interpreter would draw afresh is drawn afresh: ``random`` (CPython re-seeds it
  after a fork), numpy's global generator, multiprocessing's authentication key.

Protocol (a ``SOCK_SEQPACKET`` socket pair, one JSON message a packet): the caller sends ``{"id", "argv",
"env", "cwd"}`` with the write end of the child's output pipe attached (``SCM_RIGHTS``); the zygote answers
``{"id", "pid"}`` or ``{"id", "error"}`` (it would not fork: the caller starts a new interpreter instead),
and ``{"exit": pid, "code": returncode}`` (``Popen``'s: negative for a signal) when a child ends. Its end of
the socket closing ends the zygote; its death ends its children (SIGTERM, as a dying test process gives its
own children today).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "ForkedChild",
    "Zygote",
    "ZygoteUnavailable",
    "forkable_env_key",
    "forked",
    "parent_death_signal",
    "stop_zygote",
    "use_zygote",
]

#: environment variables that may differ between the zygote and a child it forks: nothing imported there
#: reads them at import (pytest's per-test marker; this project reads its own when it uses them; torch
#: reads its compiler's cache directory when it uses it, and sets it then: importing the worker does)
_FREE_PREFIXES = ("SWARMSERVE_",)
_FREE_NAMES = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
_PACKET = 1 << 20  # the largest message (an environment of a few KB)


def forkable_env_key(env: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """What must be equal between the zygote's environment and a child's for a fork to be a new process."""
    return frozenset((k, v) for k, v in env.items() if k not in _FREE_NAMES and not k.startswith(_FREE_PREFIXES))


def parent_death_signal() -> Callable[[], None] | None:
    """Linux: a function that makes the calling process get SIGTERM when its parent dies (for a ``Popen``'s
    ``preexec_fn`` or a forked child), so even ``kill -9`` of the parent leaves no worker behind."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_signal() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return set_signal


# ------------------------------------------------------------------------------------------- the caller
class ForkedChild:
    """The caller's handle on a child forked by the zygote: ``subprocess.Popen``'s interface, as far as
    ``ChildProcess`` and the tests use it (``pid``, ``args``, ``stdout``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``)."""

    def __init__(self, pid: int, args: Sequence[str], stdout: io.TextIOBase):
        self.pid = pid
        self.args = list(args)
        self.stdout = stdout
        self.stdin = self.stderr = None
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: an ended child's pid may belong to another process by now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedChild: pid {self.pid}, returncode {self.returncode}>"


class ZygoteUnavailable(RuntimeError):
    """The zygote would not fork this child (or is gone): start a new interpreter instead."""


class Zygote:
    """The caller's side: starts the zygote (``python -m swarmserve.zygote_process``) with ``env`` and asks it for
    children. ``spawn`` raises ``ZygoteUnavailable`` where a new interpreter must be started instead."""

    def __init__(self, env: Mapping[str, str], *, log_path: str | None = None, start_timeout: float = 180.0):
        self.env = dict(env)
        self.key = forkable_env_key(self.env)
        self.log_path = log_path or os.devnull
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.broken: str | None = None
        self.warned = False
        self._ids = itertools.count()
        self._replies: dict[int, dict[str, Any]] = {}
        self._children: dict[int, ForkedChild] = {}
        self._early_exits: dict[int, int] = {}
        self._lock = threading.Condition()
        self._send_lock = threading.Lock()
        self._started = False

    # the zygote gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG follows the thread):
    # a thread that lives as long as this process starts it
    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        done = threading.Event()
        threading.Thread(target=self._keep, args=(done,), name="swarmserve-zygote", daemon=True).start()
        done.wait()

    def _keep(self, done: threading.Event) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "swarmserve.zygote_process", str(theirs.fileno())],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,  # a terminal's Ctrl-C is for the caller, not for the zygote
                    preexec_fn=parent_death_signal(),
                )
        except OSError as exc:
            self.broken = f"could not start: {exc}"
            ours.close()
            return
        finally:
            theirs.close()
            done.set()
        self.sock = ours
        threading.Thread(target=self._read, name="swarmserve-zygote-replies", daemon=True).start()
        threading.Event().wait()  # hold this thread (and with it the zygote's parent-death signal) forever

    def _read(self) -> None:
        assert self.sock is not None
        while True:
            try:
                packet = self.sock.recv(_PACKET)
            except OSError:
                packet = b""
            if not packet:
                break
            message = json.loads(packet)
            with self._lock:
                if "exit" in message:
                    child = self._children.pop(message["exit"], None)
                    if child is None:  # ended before its spawn reply was read
                        self._early_exits[message["exit"]] = message["code"]
                    else:
                        child._set_exit(message["code"])
                else:
                    self._replies[message["id"]] = message
                self._lock.notify_all()
        with self._lock:  # the zygote is gone: its children got SIGTERM; their exit codes are not known
            self.broken = self.broken or f"the zygote exited ({self.proc.poll() if self.proc else None})"
            orphans, self._children = list(self._children.values()), {}
            self._lock.notify_all()
        for child in orphans:
            threading.Thread(target=_watch_orphan, args=(child,), daemon=True).start()

    def _request(self, message: dict[str, Any], fd: int, timeout: float) -> dict[str, Any]:
        assert self.sock is not None
        payload = json.dumps(message).encode()
        try:
            with self._send_lock:
                self.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, sys.byteorder))])
        except OSError as exc:
            raise ZygoteUnavailable(self.broken or f"the zygote is gone ({exc})") from None
        deadline = time.monotonic() + timeout
        with self._lock:
            while message["id"] not in self._replies:
                left = deadline - time.monotonic()
                if self.broken or left <= 0:
                    raise ZygoteUnavailable(self.broken or f"no answer within {timeout:.0f}s")
                self._lock.wait(min(left, 1.0))
            return self._replies.pop(message["id"])

    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> ForkedChild:
        """``python -m swarmserve argv[...]`` forked from the zygote (``argv`` as for ``Popen``: this
        interpreter, ``-m``, ``swarmserve``, its arguments), its stdout + stderr one text pipe."""
        if list(argv[:3]) != [sys.executable, "-m", "swarmserve"]:
            raise ZygoteUnavailable("not a swarmserve command")
        key = forkable_env_key(env)
        if key != self.key:
            differ = sorted({k for k, _ in key ^ self.key})
            raise ZygoteUnavailable(f"another environment: {', '.join(differ[:5])}{' …' if len(differ) > 5 else ''}")
        self.start()
        self._wait_ready()
        read_fd, write_fd = os.pipe()
        try:
            reply = self._request(
                {"id": next(self._ids), "argv": list(argv[3:]), "env": dict(env), "cwd": os.getcwd()},
                write_fd,
                timeout=60.0,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        if "error" in reply:
            os.close(read_fd)
            raise ZygoteUnavailable(reply["error"])
        stdout = open(read_fd, errors="replace")  # noqa: SIM115 (as Popen(text=True, errors="replace"))
        child = ForkedChild(reply["pid"], argv, stdout)
        with self._lock:
            if reply["pid"] in self._early_exits:
                child._set_exit(self._early_exits.pop(reply["pid"]))
            else:
                self._children[reply["pid"]] = child
        return child

    def _wait_ready(self) -> None:
        """Until the zygote has imported everything (it says ``ready`` once), or ``ZygoteUnavailable``."""
        with self._lock:
            deadline = time.monotonic() + self.start_timeout
            while self.broken or "ready" not in self._replies:
                if self.broken:
                    raise ZygoteUnavailable(self.broken)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.broken = f"not ready within {self.start_timeout:.0f}s"
                    raise ZygoteUnavailable(self.broken)
                self._lock.wait(min(left, 1.0))

    def close(self) -> None:
        """Close the socket: the zygote exits (children still running get SIGTERM)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes our reader; the zygote reads EOF
            self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _watch_orphan(child: ForkedChild) -> None:
    """A child of a zygote that died: reaped by someone else, so its exit code is unknown (-1) once gone."""
    while True:
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except (OSError, IndexError):
            break
        time.sleep(0.2)
    child._set_exit(-1)


# ------------------------------------------------------------------------------------------- opting in
_current: Zygote | None = None


def use_zygote(env: Mapping[str, str], log_path: str | None = None) -> None:
    """From now on, fork ``swarmserve`` children whose environment matches ``env`` from a pre-imported
    zygote, started at the first such child: the test suite's opt-in (its conftest), saving each worker its
    seconds of imports. Other children (``ChildProcess.spawn``) start new interpreters."""
    global _current
    if _current is None:
        _current = Zygote(env, log_path=log_path)


def stop_zygote() -> None:
    """Close the zygote (its children still running get SIGTERM); children start new interpreters again."""
    global _current
    zygote, _current = _current, None
    if zygote is not None:
        zygote.close()


def forked(argv: list[str], env: dict[str, str]) -> tuple[ForkedChild | None, str]:
    """``argv`` forked by the zygote in use, or None (start a new interpreter) and why: for the spawn log."""
    zygote = _current
    if zygote is None:
        return None, "exec"
    try:
        return zygote.spawn(argv, env), "zygote"
    except ZygoteUnavailable as exc:
        if zygote.broken and not zygote.warned:
            zygote.warned = True
            warnings.warn(f"swarmserve zygote: {zygote.broken}; children start new interpreters", stacklevel=3)
        return None, f"exec ({exc})"
