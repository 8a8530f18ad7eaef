"""A worker behind NAT with no port forward serves through a libp2p relay (worker/relay.py; root only).

The lab's public side is 11.231.0.0/24, not 10.x: go-libp2p builds circuit addresses only from a relay's
public addresses (load_tests/results/relay-findings-2026-12-06.md); nothing is routed off the machine, and the
NATed worker's own side stays private (10.232.0.0/24). Public: ``swarmserve dht`` (the relay: every hivemind
peer serves the circuit hop protocol), a worker of blocks 0:2 and the client. Behind a MASQUERADE router with no
forward and no ``--public-ip``: the only worker of blocks 2:4. Its start-up check finds it unreachable; it
restarts its DHT node behind the dht node as a relay, is dialed through the circuit by a checker and goes
ONLINE "relayed"; the client (dialing its peer id) generates greedy tokens equal to the local model's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from swarmserve.launcher import DHT_READY, WORKER_READY, ChildProcess, WorkerProcess
from tests.netlab import NetLab
from tests.test_nat import (  # noqa: F401 - _lab_or_skip and reference are fixtures used here
    ENV,
    PORT,
    READY_TIMEOUT,
    _lab_or_skip,
    peer_of,
    reference,
    run_client,
    swarm_status,
)

pytestmark = pytest.mark.slow

PUBLIC = "11.231.0"
ROUTER = f"{PUBLIC}.100"


@contextmanager
def relay_swarm(model: str) -> Iterator[tuple[NetLab, str, WorkerProcess, float]]:
    """Yields (lab, dht maddr, the NATed worker, seconds from its DHT node being up to its ready line)."""
    procs: list[ChildProcess] = []
    with NetLab(subnet=PUBLIC) as lab:
        try:
            dht_ns = lab.host("dht", f"{PUBLIC}.2")
            w1_ns = lab.host("w1", f"{PUBLIC}.3")
            lab.host("client", f"{PUBLIC}.4")
            _, home, _ = lab.nat("rtr", ROUTER)
            argv = ["dht", "--host", f"{PUBLIC}.2", "--port", "31337", "--model", model]
            dht = lab.spawn(dht_ns, "dht", argv, ENV)
            procs.append(dht)
            maddr = dht.wait_for(DHT_READY, timeout=60).split(DHT_READY, 1)[1].strip()
            common = ["worker", "--model", model, "--initial-peers", maddr, "--torch-threads", "1"]
            common += ["--update-period", "1", "--throughput", "100"]
            w1 = lab.spawn(w1_ns, "w1", [*common, "--blocks", "0:2", "--host", f"{PUBLIC}.3", "--port", str(PORT)],
                           ENV, cls=WorkerProcess)  # fmt: skip
            procs.append(w1)
            w1.wait_for(WORKER_READY, timeout=READY_TIMEOUT)
            w2 = lab.spawn(home, "w2", [*common, "--blocks", "2:4", "--host", "0.0.0.0", "--port", str(PORT)], ENV,
                           cls=WorkerProcess)  # fmt: skip
            procs.append(w2)
            deadline = time.monotonic() + READY_TIMEOUT  # timed from the DHT node up, not from Python's imports
            while not any("announcing" in line for line in w2.lines) and time.monotonic() < deadline:
                assert w2.popen.poll() is None, w2.tail(30)
                time.sleep(0.05)
            up_at = time.monotonic()
            w2.wait_for(WORKER_READY, timeout=READY_TIMEOUT)
            yield lab, maddr, w2, time.monotonic() - up_at
        finally:
            for proc in reversed(procs):
                proc.stop(timeout=10)


def test_worker_behind_nat_without_a_forward_serves_through_a_relay(tiny_llama, reference):  # noqa: F811
    with relay_swarm(tiny_llama) as (lab, maddr, w2, took):
        output = "\n".join(w2.lines)
        print(f"NATed worker ONLINE {took:.1f} s after its DHT node was up:")
        print(w2.tail(8))
        relay_line = next((line for line in w2.lines if "reachable through relay" in line), None)
        assert relay_line is not None and maddr.rsplit("/p2p/", 1)[1] in relay_line, output[-3000:]
        assert "10.232.0." in next(line for line in w2.lines if "announcing" in line)  # no forward, no public IP
        servers = {s["peer_id"]: s for s in swarm_status(lab, tiny_llama, maddr)["servers"]}
        assert servers[peer_of(w2)]["reachability"] == "relayed", servers
        assert servers[peer_of(w2)]["state"] == "ONLINE", servers
        result = run_client(lab, tiny_llama, maddr, timeout=180)
        print(f"client through the relayed worker: {result}")
        assert result.get("tokens") == reference, (result, w2.tail(30))
