"""The emulated-WAN benchmarks' swarm (load_tests/bench_wan.py's hosts and scenarios): a DHT and three workers
in the network lab (tests/netlab.py), with a scenario's one-way delays; shared by bench_wan and bench_speculation."""

from __future__ import annotations

from swarmserve.launcher import DHT_READY, WorkerProcess
from swarmserve.processes import wait_ready
from tests.netlab import NetLab


def start_lab_swarm(lab: NetLab, model: str, scenario: str, spans: dict[str, str] | None = None) -> tuple:
    """In ``lab``: the hosts, a DHT and the three workers serving ``spans`` (ready), then ``scenario``'s delays.
    Returns the namespaces by host, the DHT's multiaddr, its process and the workers."""
    from load_tests.bench_wan import ENV, HOSTS, PORT, SCENARIOS, SERVERS, SPANS

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
