"""The test suite's worker zygote (swarmserve/zygote.py): a child it forks is, to its caller, the process a
new interpreter would be — the same output lines and exit codes, its own session, its environment, signals
by pid and by group — and a child it would not fork starts a new interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from swarmserve import zygote as zygotes
from swarmserve.processes import DHT_READY, ChildProcess, child_env, swarmserve_argv
from swarmserve.zygote import ForkedChild, Zygote, ZygoteUnavailable

pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return child_env(1, OFFLINE)


@pytest.fixture(scope="module")
def zygote(env: dict[str, str]) -> Iterator[Zygote]:
    z = Zygote(env)
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def forking(zygote: Zygote, monkeypatch: pytest.MonkeyPatch) -> Zygote:
    """``ChildProcess.spawn`` forks from this module's zygote."""
    monkeypatch.setattr(zygotes, "_current", zygote)
    return zygote


def _run(zygote: Zygote, env: dict[str, str], *args: str) -> tuple[int, str]:
    child = zygote.spawn(swarmserve_argv(*args), env)
    assert isinstance(child, ForkedChild)
    out = child.stdout.read()
    return child.wait(30), out


def _fresh(env: dict[str, str], *args: str) -> tuple[int, str]:
    """The same command in a new interpreter, as ``ChildProcess`` starts one without a zygote."""
    done = subprocess.run(swarmserve_argv(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout


@pytest.mark.parametrize("args", [["--version"], ["worker", "--model", "m"], ["worker", "--blocks", "x"], ["nope"]])
def test_output_and_exit_code_are_a_new_interpreters(zygote: Zygote, env: dict[str, str], args: list[str]) -> None:
    assert _run(zygote, env, *args) == _fresh(env, *args)


def test_the_childs_environment_is_the_requests(zygote: Zygote, env: dict[str, str]) -> None:
    """``SWARMSERVE_ADAPTERS`` is the default of ``worker --adapters``, read by the child from the environment
    it was asked for (the zygote's own has none): a bad one stops it with the message a new process gives."""
    asked = dict(env, SWARMSERVE_ADAPTERS="=zygote-test")
    args = ("worker", "--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1")
    code, out = _run(zygote, asked, *args)
    assert (code, out) == (1, "swarmserve worker: invalid adapter name '': use 1-64 letters, digits, '.', '_' or "
                              "'-', starting with a letter or digit\n")  # fmt: skip
    assert _fresh(asked, *args) == (code, out)


def test_an_uncaught_exception_is_a_traceback_and_exit_1(zygote: Zygote, env: dict[str, str]) -> None:
    code, out = _run(zygote, env, "worker", "--model", "/nonexistent", "--initial-peers", "/ip4/127.0.0.1/tcp/1")
    assert code == 1, out
    assert "Traceback (most recent call last):" in out
    assert out.rstrip().splitlines()[-1].startswith("swarm_client.model_source.ModelNotFoundError: ")


def test_a_forked_child_is_a_process_of_its_own(forking: Zygote, env: dict[str, str]) -> None:
    dht = ChildProcess.spawn("dht", ["dht"], env)
    try:
        assert isinstance(dht.popen, ForkedChild)
        dht.wait_for(DHT_READY, timeout=60)
        assert os.getsid(dht.pid) == dht.pid and os.getpgid(dht.pid) == dht.pid  # its own session and group
        assert os.readlink(f"/proc/{dht.pid}/cwd") == os.getcwd()
        os.killpg(dht.pid, signal.SIGSTOP)  # frozen, as the frozen-server tests do
        time.sleep(0.3)
        assert _state(dht.pid) == "T" and dht.alive
        os.killpg(dht.pid, signal.SIGCONT)
        dht.popen.send_signal(signal.SIGTERM)  # by pid: it stops in order
        assert dht.popen.wait(30) == 0, dht.output
        assert dht.popen.poll() == 0 and not dht.alive
    finally:
        dht.kill()


def test_kill_by_pid_and_group_reports_the_signal(forking: Zygote, env: dict[str, str]) -> None:
    """``popen.kill()`` (the main process only, as the failover tests kill a worker) and ``kill()`` (its
    whole group); ``wait`` says -SIGKILL either way, as Popen does."""
    for kill in (lambda p: p.popen.kill(), lambda p: p.kill()):
        dht = ChildProcess.spawn("dht", ["dht"], env)
        try:
            dht.wait_for(DHT_READY, timeout=60)
            kill(dht)
            assert dht.popen.wait(10) == -signal.SIGKILL
        finally:
            dht.kill()
    early = ChildProcess.spawn("dht", ["dht"], env)  # its group exists once spawn returns, as with Popen
    early.kill()
    assert early.popen.wait(10) == -signal.SIGKILL


def test_another_environment_starts_a_new_interpreter(forking: Zygote, env: dict[str, str]) -> None:
    with pytest.raises(ZygoteUnavailable, match="OMP_NUM_THREADS"):
        forking.spawn(swarmserve_argv("--version"), dict(env, OMP_NUM_THREADS="2"))
    proc = ChildProcess.spawn("version", ["--version"], dict(env, OMP_NUM_THREADS="2"))
    assert isinstance(proc.popen, subprocess.Popen)
    assert proc.popen.wait(30) == 0
    with pytest.raises(ZygoteUnavailable, match="not a swarmserve command"):
        forking.spawn([sys.executable, "-c", "pass"], env)


def test_children_get_sigterm_when_the_zygote_dies(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    own = Zygote(env)
    monkeypatch.setattr(zygotes, "_current", own)
    dht = ChildProcess.spawn("dht", ["dht"], env)
    try:
        dht.wait_for(DHT_READY, timeout=60)
        assert own.proc is not None
        own.proc.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(dht.pid):
            time.sleep(0.1)
        assert not _alive(dht.pid), "the zygote's child outlived it"
        assert dht.popen.wait(10) == -1  # reaped by someone else: its code is unknown
        with pytest.raises(ZygoteUnavailable):  # and the next child starts a new interpreter
            own.spawn(swarmserve_argv("--version"), env)
    finally:
        dht.kill()
        own.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    try:
        return _state(pid) not in ("Z", "X")
    except OSError:
        return False
