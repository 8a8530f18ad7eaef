"""``swarmserve`` child processes: started in their own process group, output read line by line, ready by a
line they print, stopped in order.

* ``ChildProcess`` — a ``swarmserve SUBCOMMAND`` child in its own session (process group), so a terminal's
  Ctrl-C reaches only the parent, which stops the children in order, and killing the group also takes the
  child's hivemind DHT process and p2pd daemon. Its output is read in a thread (the last lines kept for
  error reports); ``wait_for`` waits for a line, ``ready`` is set by the child's ready line.
* ``WorkerProcess`` — a ``swarmserve worker``: ready once it prints ``WORKER_READY``, which names its peer id.
* ``wait_ready`` / ``stop_processes`` — start-up and teardown of several at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, overload

from swarmserve.zygote import forked as _forked
from swarmserve.zygote import parent_death_signal as _parent_death_signal
from swarmserve.zygote import stop_zygote, use_zygote

__all__ = [
    "DHT_READY",
    "WORKER_READY",
    "ChildProcess",
    "WorkerProcess",
    "WorkerStartError",
    "child_env",
    "forks_in_their_own_session",
    "popen_child",
    "stop_processes",
    "stop_zygote",
    "swarmserve_argv",
    "use_zygote",
    "wait_ready",
]

WORKER_READY = "swarmserve worker ready:"
#: a file to append one JSON line to per child started and per child ready (``ChildProcess._log_spawn``)
SPAWN_LOG_ENV = "SWARMSERVE_SPAWN_LOG"
DHT_READY = "initial_peers:"
#: the last line Python prints for an uncaught exception: ``FileNotFoundError: no model.safetensors…``
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)")

Say = Callable[[str], None]


class WorkerStartError(RuntimeError):
    """A worker died, hung or was interrupted before it was ready; the message quotes its last lines."""


def swarmserve_argv(*args: str) -> list[str]:
    """The command line of a ``swarmserve`` child, run by this interpreter (no console script needed)."""
    return [sys.executable, "-m", "swarmserve", *args]


def child_env(threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: unbuffered output, ``threads`` BLAS/OpenMP threads."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


_detach_forks = False
_set_parent_death_signal = _parent_death_signal()


def _detach_if_asked() -> None:
    if _detach_forks:
        os.setsid()
        if _set_parent_death_signal is not None:
            _set_parent_death_signal()


os.register_at_fork(after_in_child=_detach_if_asked)


@contextmanager
def forks_in_their_own_session() -> Iterator[None]:
    """Processes forked inside (hivemind's DHT process, and with it its p2pd daemon) start a session of their
    own, like ``ChildProcess``: a terminal's Ctrl-C, sent to its whole foreground group, reached the p2pd of
    ``up``'s own DHT, which then could not shut down in order (3 s of grace, then killed, with an error from
    the daemon). They still get SIGTERM if we die; we stop them ourselves, last."""
    global _detach_forks
    _detach_forks = True
    try:
        yield
    finally:
        _detach_forks = False


# ---------------------------------------------------------------------------------------------- processes
def popen_child(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """A child process as ``ChildProcess`` reads it: output (stderr with it) as text lines, no stdin, a session
    of its own (killed as a group), SIGTERMed when its parent dies."""
    return subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,
        preexec_fn=_parent_death_signal(),
    )


class ChildProcess:
    """A ``swarmserve`` child in its own process group, its output collected line by line."""

    ready_prefix: str | None = None

    def __init__(self, name: str, popen: subprocess.Popen | Any, *, echo: bool = False, keep_lines: int = 5000):
        self.name = name
        self.popen = popen
        self.echo = echo
        self.ready = threading.Event()
        self.ready_line: str | None = None
        self.started_at = self.last_output_at = time.monotonic()
        self.saw_traceback = False
        self._lines: deque[str] = deque(maxlen=keep_lines)
        self._count = 0  # lines read so far (the deque keeps only the last ``keep_lines``)
        self._cursor = 0  # the first line ``wait_for`` has not looked at yet
        self._eof = False
        self._changed = threading.Condition()

    @classmethod
    def spawn(cls, name: str, args: Sequence[str], env: dict[str, str] | None = None, *, echo: bool = False, **kw: Any):
        """Start ``swarmserve *args`` and read its output in a daemon thread."""
        argv, env = swarmserve_argv(*args), env if env is not None else child_env()
        popen, how = _forked(argv, env)
        if popen is None:
            popen = popen_child(argv, env)
        proc = cls(name, popen, echo=echo, **kw)
        proc._log_spawn(args, how=how)
        threading.Thread(target=proc._read, name=f"{name}-log", daemon=True).start()
        return proc

    # ------------------------------------------------------------------------------------------ spawn log
    def _log_spawn(self, args: Sequence[str], **extra: Any) -> None:
        """With ``SWARMSERVE_SPAWN_LOG`` set (a file), one JSON line per child started and one when it is
        ready (seconds since the start, CPU seconds it used so far): what a test run's start-ups cost."""
        self._spawn_log = os.environ.get(SPAWN_LOG_ENV)
        if self._spawn_log:
            self._append_spawn_log({"event": "spawn", "command": args[0] if args else "", **extra})

    def _append_spawn_log(self, record: dict[str, Any]) -> None:
        record = {"t": round(time.time(), 3), "pid": self.pid, "name": self.name, **record}
        try:
            with open(self._spawn_log, "a") as f:  # type: ignore[arg-type]
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass

    def _log_ready(self) -> None:
        if getattr(self, "_spawn_log", None):
            took = round(time.monotonic() - self.started_at, 3)
            self._append_spawn_log({"event": "ready", "ready_s": took, "cpu_s": _cpu_seconds(self.pid)})

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.rstrip("\n")
            with self._changed:
                self._lines.append(line)
                self._count += 1
                self.last_output_at = time.monotonic()
                self.saw_traceback |= line.startswith("Traceback (most recent call last):")
                self._changed.notify_all()
            if self.echo:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            if self.ready_prefix and line.startswith(self.ready_prefix) and not self.ready.is_set():
                self.ready_line = line
                self._on_ready(line)
                self.ready.set()
                self._log_ready()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def _on_ready(self, line: str) -> None:
        """Hook for subclasses: parse the ready line."""

    # ------------------------------------------------------------------------------------------ output
    @property
    def lines(self) -> list[str]:
        """The last lines printed (all of them unless there were more than ``keep_lines``)."""
        with self._changed:
            return list(self._lines)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def tail(self, n: int = 30, indent: str = "    ") -> str:
        return "\n".join(f"{indent}{line}" for line in self.lines[-n:])

    @overload
    def wait_for(self, pattern: str, timeout: float = ...) -> str: ...
    @overload
    def wait_for(self, pattern: re.Pattern[str], timeout: float = ...) -> re.Match[str]: ...

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float = 120.0) -> str | re.Match[str]:
        """The next line (after those earlier calls looked at) starting with ``pattern`` (a str) or matching
        it (a compiled regex: the match). Raises if the child exits or stays silent on it for ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                first = self._count - len(self._lines)
                for index in range(max(self._cursor, first), self._count):
                    line = self._lines[index - first]
                    found = pattern.search(line) if isinstance(pattern, re.Pattern) else line.startswith(pattern)
                    if found:
                        self._cursor = index + 1
                        return found if isinstance(found, re.Match) else line
                self._cursor = self._count
                left = deadline - time.monotonic()
                if self._eof:
                    raise RuntimeError(
                        f"{self.name} exited (rc={self.popen.poll()}) before printing {_show(pattern)}:\n"
                        + self.tail(40, "")
                    )
                if left <= 0:
                    raise TimeoutError(
                        f"{self.name} did not print {_show(pattern)} within {timeout}s:\n" + self.tail(40, "")
                    )
                self._changed.wait(min(left, 0.5))

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def crashed(self, quiet_s: float = 10.0) -> bool:
        """Exited, or printed a traceback as its last words and went quiet: a worker whose main thread
        died can hang at exit waiting for its DHT process, so its exit code may never come. Only for
        startup: a serving worker may log a handled exception and then rightly stay quiet."""
        if not self.alive:
            return True
        lines = self.lines
        if not self.saw_traceback or not lines:
            return False
        return bool(_EXCEPTION_LINE.match(lines[-1])) and time.monotonic() - self.last_output_at > quiet_s

    def how_it_ended(self) -> str:
        return "crashed" if self.alive else f"exited with code {self.popen.returncode}"

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        if self.alive:
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """``sig``, up to ``timeout`` s to exit, then SIGKILL for whatever is left of its process group."""
        self.terminate(sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the whole group: the child, its DHT process and its p2pd daemon (a machine dying)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass

    kill_group = kill


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` itself (Linux ``/proc``), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def _show(pattern: str | re.Pattern[str]) -> str:
    return repr(pattern.pattern if isinstance(pattern, re.Pattern) else pattern)


class WorkerProcess(ChildProcess):
    """A ``swarmserve worker`` child; ``peer_id`` comes from its ready line (``… as peer <id>; …``)."""

    ready_prefix = WORKER_READY

    def __init__(self, *args: Any, span: tuple[int, int] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.span = span
        self.peer_id: str | None = None

    def _on_ready(self, line: str) -> None:
        if " as peer " in line:
            self.peer_id = line.split(" as peer ", 1)[1].split(";", 1)[0].strip()

    @property
    def span_text(self) -> str:
        return f"{self.span[0]}:{self.span[1]}" if self.span else "(its own choice)"


def stop_processes(procs: Iterable[ChildProcess], grace: float, say: Say | None = None) -> None:
    """SIGTERM all (they drain in parallel), wait up to ``grace`` seconds, then kill each process group."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if say is not None:
                say(f"{p.name} did not stop within {grace:.0f}s; killing it")
    for p in procs:
        p.kill()


def wait_ready(
    workers: Sequence[WorkerProcess],
    timeout: float,
    *,
    stop: threading.Event | None = None,
    say: Say | None = None,
    progress_every: float = 15.0,
) -> None:
    """Until every worker printed its ready line. Raises ``WorkerStartError`` (a worker died or hung, the
    timeout passed) or ``InterruptedError`` (``stop`` was set). With ``say``: each ready worker, and every
    ``progress_every`` seconds the last line of those still loading."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout
    reported: set[str] = set()
    last_progress = time.monotonic()
    while True:
        for w in workers:
            if w.ready.is_set() and w.name not in reported:
                reported.add(w.name)
                if say is not None:
                    took = time.monotonic() - w.started_at
                    say(f"{w.name} (blocks {w.span_text}) ready in {took:.1f}s as peer {w.peer_id}")
            elif not w.ready.is_set() and w.crashed():
                time.sleep(0.2)  # let the reader thread take the last lines
                raise WorkerStartError(f"{w.name} {w.how_it_ended()} before it was ready; its last lines:\n{w.tail()}")
        if len(reported) == len(workers):
            return
        if stop.is_set():
            raise InterruptedError("interrupted before the workers were ready")
        if time.monotonic() > deadline:
            waiting = [w for w in workers if not w.ready.is_set()]
            raise WorkerStartError(
                f"workers not ready after {timeout:.0f}s: "
                + "; ".join(f"{w.name}, last lines:\n{w.tail(10)}" for w in waiting)
            )
        if say is not None and time.monotonic() - last_progress > progress_every:
            last_progress = time.monotonic()
            for w in workers:
                if not w.ready.is_set():
                    last = (w.lines or ["(no output yet)"])[-1]
                    say(f"still waiting for {w.name} ({time.monotonic() - w.started_at:.0f}s): {last[:150]}")
        stop.wait(0.1)
