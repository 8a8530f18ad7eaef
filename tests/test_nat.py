"""A worker behind NAT, in network namespaces (tests/netlab.py; root only, skipped elsewhere with the reason).

Public side (one bridge): the DHT bootstrap, a worker of blocks 0:2 and the client. Behind a MASQUERADE
router: the only worker of blocks 2:4.
- With a port forward and ``--public-ip <router> --port <forwarded>``, it announces the router's address and
  the client generates through both workers directly: greedy tokens equal to the local 🤗 model's.
- Without (today's default behaviour: it announces its private address, and still goes ONLINE), what the
  client sees is recorded and printed, not asserted: it is the baseline for a reachability check.

Every wait is bounded; the lab's namespaces and everything running in them go when a test ends.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from swarmserve.launcher import DHT_READY, WORKER_READY, ChildProcess, WorkerProcess, child_env
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
def nat_swarm(model: str, forward: bool, *nat_worker_flags: str) -> Iterator[tuple[NetLab, str, WorkerProcess]]:
    """The lab with the DHT and worker 0:2 public, worker 2:4 behind the router; yields (lab, dht maddr,
    the NATed worker) once both workers are ONLINE."""
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
            w2 = lab.spawn(home, "w2", [*common, "--blocks", "2:4", "--host", "0.0.0.0", "--port", str(PORT),
                                        *nat_worker_flags], ENV, cls=WorkerProcess)  # fmt: skip
            procs.append(w2)
            for worker in (w1, w2):
                worker.wait_for(WORKER_READY, timeout=READY_TIMEOUT)
            yield lab, maddr, w2
        finally:
            for proc in reversed(procs):
                proc.stop(timeout=10)


def run_client(lab: NetLab, model: str, maddr: str, timeout: float) -> dict:
    client_ns = next(ns for ns in lab.public if ns.endswith("-client"))
    argv = lab.argv(client_ns, sys.executable, "-c", CLIENT, model, maddr, str(NEW_TOKENS), json.dumps(PROMPT))
    # output to a file, not a pipe: the client's p2p daemon inherits it and outlives the client (until the lab
    # goes), so a pipe would not reach EOF when the client exits
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=ENV)
        out.seek(0)
        text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the client printed no result (exit {done.returncode}):\n{text[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_worker_behind_nat_with_a_port_forward_and_public_ip_is_used_directly(tiny_llama, reference):
    with nat_swarm(tiny_llama, True, "--public-ip", ROUTER) as (lab, maddr, w2):
        announced = next(line for line in w2.lines if "announcing" in line)
        assert f"/ip4/{ROUTER}/tcp/{PORT}/p2p/" in announced and "10.232." not in announced, announced
        result = run_client(lab, tiny_llama, maddr, timeout=180)
        print(f"client through the NATed worker: {result}")
        assert result.get("tokens") == reference, (result, w2.tail(30))


def test_worker_behind_nat_announcing_its_private_address(tiny_llama, reference):
    """Today's behaviour without a port forward or --public-ip: recorded (printed), timings not asserted."""
    with nat_swarm(tiny_llama, False) as (lab, maddr, w2):
        announced = next(line for line in w2.lines if "announcing" in line)
        result = run_client(lab, tiny_llama, maddr, timeout=240)
        print(f"NATed worker announces: {announced}\nclient saw after {result['seconds']} s: {result}")
        # the worker went ONLINE all the same; the client either fails naming the unserved blocks or (once
        # reachability checks or relays exist) gets the right tokens
        assert result.get("tokens") == reference or "NoRouteError" in result.get("error", ""), result
