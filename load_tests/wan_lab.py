"""The emulated-WAN benchmarks' lab (its hosts, the workers' spans, the delay scenarios) and its swarm: a DHT and
three workers in the network lab (tests/netlab.py), with a scenario's one-way delays; shared by bench_wan,
petals_wan and bench_speculation."""

from __future__ import annotations

from swarmserve.launcher import DHT_READY, WorkerProcess, child_env
from swarmserve.processes import wait_ready
from tests.netlab import NetLab

ENV = child_env(1, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
HOSTS = {"dht": "10.231.0.2", "client": "10.231.0.3", "s1": "10.231.0.11", "s2": "10.231.0.12", "s3": "10.231.0.13"}
SPANS = {"s1": "0:2", "s2": "2:4", "s3": "4:6"}
SERVERS = list(SPANS)
PORT = 31330
#: scenario -> (one-way ms for everything a host sends, {(source, destination): ms} overrides)
SCENARIOS: dict[str, tuple[dict[str, float], dict[tuple[str, str], float]]] = {
    "a": ({h: 25.0 for h in HOSTS}, {}),
    "b": ({"client": 40.0, "dht": 2.0, **dict.fromkeys(SERVERS, 2.0)},
          {(h, "client"): 40.0 for h in ("dht", *SERVERS)}),
    "c0": ({}, {}),
}  # fmt: skip


def start_lab_swarm(lab: NetLab, model: str, scenario: str, spans: dict[str, str] | None = None) -> tuple:
    """In ``lab``: the hosts, a DHT and the three workers serving ``spans`` (ready), then ``scenario``'s delays.
    Returns the namespaces by host, the DHT's multiaddr, its process and the workers."""
    spans = spans or SPANS
    hosts, pairs = SCENARIOS[scenario]
    ns = {h: lab.host(h, ip) for h, ip in HOSTS.items()}
    dht = lab.spawn(ns["dht"], "dht", ["dht", "--host", HOSTS["dht"], "--port", "31337", "--model", model], ENV)
    maddr = dht.wait_for(DHT_READY, timeout=120).split(DHT_READY, 1)[1].strip()
    workers = []
    for s in SERVERS:
        argv = ["worker", "--model", model, "--initial-peers", maddr, "--blocks", spans[s], "--host", HOSTS[s]]
        argv += f"--port {PORT} --torch-threads 1 --throughput 100".split()
        workers.append(lab.spawn(ns[s], s, argv, ENV, cls=WorkerProcess))
    wait_ready(workers, timeout=300)
    lab.delay(hosts)  # {} (c0): no delay process at all
    for (source, destination), ms in pairs.items():
        lab.delay_between(source, destination, ms)
    return ns, maddr, dht, workers
