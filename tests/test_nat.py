"""A worker behind NAT, in network namespaces (tests/netlab.py; root only, skipped elsewhere with the reason).

Public side (one bridge): the DHT bootstrap, a worker of blocks 0:2 and the client. Behind a MASQUERADE
router: the only worker of blocks 2:4.
- With a port forward and ``--public-ip <router> --port <forwarded>``, it announces the router's address and
  the client generates through both workers directly: greedy tokens equal to the local 🤗 model's.
  Its start-up reachability check (worker/reachability.py) finds it "direct", as ``swarmserve status`` shows.
- Without, it announces its private address: the swarm's peers cannot dial it back, so it never goes
  ONLINE and exits non-zero within 30 s, naming the fix (a port forward and ``--public-ip``).

Every wait is bounded; the lab's namespaces and everything running in them go when a test ends.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from swarmserve.launcher import DHT_READY, WORKER_READY, ChildProcess, WorkerProcess, child_env, swarmserve_argv
from tests.conftest import require_or_skip
from tests.netlab import NetLab, unavailable

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _lab_or_skip() -> None:
    """Skip where no lab can run — or fail, naming what to install, when ``SWARMSERVE_REQUIRE`` has netns."""
    if (reason := unavailable()) is not None:
        require_or_skip("netns", reason)


PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 12
ENV = child_env(1, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
ROUTER, PORT = "10.231.0.100", 31330
READY_TIMEOUT = 150.0

#: the client, run inside the lab: greedy tokens or the error it got, and how long it took, as one JSON line
CLIENT = r"""
import json, os, sys, time
import torch
from swarm_client import AutoDistributedModelForCausalLM
model_path, peer, n, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), torch.tensor([json.loads(sys.argv[4])])
t0 = time.monotonic()
try:
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[peer])
    out = model.generate(prompt, max_new_tokens=n, do_sample=False)
    result = {"tokens": out[0, prompt.shape[1]:].tolist()}
except Exception as exc:
    result = {"error": f"{type(exc).__name__}: {exc}"}
result["seconds"] = round(time.monotonic() - t0, 2)
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)  # no waiting on the p2p daemon's shutdown
"""


@pytest.fixture(scope="module")
def reference(local_llama) -> list[int]:
    prompt = torch.tensor([PROMPT])
    return local_llama.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT) :].tolist()


@contextmanager
def nat_swarm(
    model: str, forward: bool, *nat_worker_flags: str, wait: bool = True
) -> Iterator[tuple[NetLab, str, WorkerProcess]]:
    """The lab with the DHT and worker 0:2 public, worker 2:4 behind the router; yields (lab, dht maddr,
    the NATed worker) once both workers are ONLINE (without ``wait``: the public one; the NATed one is
    started once it is, ``started_at`` set to ``time.monotonic()`` then)."""
    procs: list[ChildProcess] = []
    with NetLab() as lab:
        try:
            dht_ns = lab.host("dht", "10.231.0.2")
            w1_ns = lab.host("w1", "10.231.0.3")
            lab.host("client", "10.231.0.4")
            _, home, _ = lab.nat("rtr", ROUTER, forward=[PORT] if forward else [])
            dht = lab.spawn(dht_ns, "dht", ["dht", "--host", "10.231.0.2", "--port", "31337", "--model", model], ENV)
            procs.append(dht)
            maddr = dht.wait_for(DHT_READY, timeout=60).split(DHT_READY, 1)[1].strip()
            common = ["worker", "--model", model, "--initial-peers", maddr, "--torch-threads", "1"]
            common += ["--update-period", "1", "--throughput", "100"]
            w1 = lab.spawn(w1_ns, "w1", [*common, "--blocks", "0:2", "--host", "10.231.0.3", "--port", str(PORT)], ENV,
                           cls=WorkerProcess)  # fmt: skip
            procs.append(w1)
            w1.wait_for(WORKER_READY, timeout=READY_TIMEOUT)
            started_at = time.monotonic()
            w2 = lab.spawn(home, "w2", [*common, "--blocks", "2:4", "--host", "0.0.0.0", "--port", str(PORT),
                                        *nat_worker_flags], ENV, cls=WorkerProcess)  # fmt: skip
            procs.append(w2)
            w2.started_at = started_at
            if wait:
                w2.wait_for(WORKER_READY, timeout=READY_TIMEOUT)
            yield lab, maddr, w2
        finally:
            for proc in reversed(procs):
                proc.stop(timeout=10)


def run_in_client_host(lab: NetLab, script: str, args: list[str], timeout: float) -> dict:
    """Run ``python -c script *args`` on the lab's client host; its last ``RESULT <json>`` line, parsed."""
    client_ns = next(ns for ns in lab.public if ns.endswith("-client"))
    argv = lab.argv(client_ns, sys.executable, "-c", script, *args)
    # output to a file, not a pipe: the client's p2p daemon inherits it and outlives the client (until the lab
    # goes), so a pipe would not reach EOF when the client exits
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=ENV)
        out.seek(0)
        text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the client printed no result (exit {done.returncode}):\n{text[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def run_client(lab: NetLab, model: str, maddr: str, timeout: float) -> dict:
    return run_in_client_host(lab, CLIENT, [model, maddr, str(NEW_TOKENS), json.dumps(PROMPT)], timeout)


def swarm_status(lab: NetLab, model: str, maddr: str) -> dict:
    """``swarmserve status --json``, run on the public side."""
    client_ns = next(ns for ns in lab.public if ns.endswith("-client"))
    argv = lab.argv(client_ns, *swarmserve_argv("status", "--initial-peers", maddr, "--model", model, "--json"))
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: see run_client
        subprocess.run(argv, stdout=out, stderr=subprocess.DEVNULL, text=True, timeout=60, env=ENV)
        out.seek(0)
        text = out.read()
    return json.loads(text[text.index("{") :])


def peer_of(worker: WorkerProcess) -> str:
    return next(line for line in worker.lines if "announcing" in line).rsplit("/p2p/", 1)[1].split()[0]


def test_worker_behind_nat_with_a_port_forward_and_public_ip_is_used_directly(tiny_llama, reference):
    with nat_swarm(tiny_llama, True, "--public-ip", ROUTER) as (lab, maddr, w2):
        announced = next(line for line in w2.lines if "announcing" in line)
        assert f"/ip4/{ROUTER}/tcp/{PORT}/p2p/" in announced and "10.232." not in announced, announced
        result = run_client(lab, tiny_llama, maddr, timeout=180)
        print(f"client through the NATed worker: {result}")
        assert result.get("tokens") == reference, (result, w2.tail(30))
        servers = {s["peer_id"]: s for s in swarm_status(lab, tiny_llama, maddr)["servers"]}
        assert servers[peer_of(w2)]["reachability"] == "direct", servers


def test_worker_behind_nat_announcing_its_private_address_refuses_to_go_online(tiny_llama):
    """No port forward, no --public-ip: the swarm cannot dial it back, so it exits naming the fix."""
    with nat_swarm(tiny_llama, False, wait=False) as (lab, maddr, w2):
        # timed from its DHT node being up (the "announcing" line): what comes before is Python importing
        # torch and hivemind, which takes many seconds on 2 loaded cores and is no part of the check
        deadline = time.monotonic() + READY_TIMEOUT
        while not any("announcing" in line for line in w2.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        up_at = time.monotonic()
        w2.wait_for(re.compile("--no-reachability-check"), timeout=60)  # the message's last line
        rc = w2.popen.wait(timeout=30)
        took, total = time.monotonic() - up_at, time.monotonic() - w2.started_at
        output = "\n".join(w2.lines)
        print(f"NATed worker exited {rc} {took:.1f} s after its DHT node was up ({total:.1f} s after start):")
        print(w2.tail(20))
        assert rc != 0 and took < 30, (rc, took, output[-3000:])
        assert not any(line.startswith(WORKER_READY) for line in w2.lines), output[-3000:]
        assert "NOT REACHABLE" in output and "could NOT dial us" in output, output[-3000:]
        assert f"forward TCP port {PORT}" in output and "--public-ip" in output, output[-3000:]
        assert "--no-reachability-check" in output
        status = swarm_status(lab, tiny_llama, maddr)
        assert all(s["state"] != "ONLINE" for s in status["servers"] if s["peer_id"] == peer_of(w2)), status
        assert status["missing_blocks"] == [2, 3], status
