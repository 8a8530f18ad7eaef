"""Reachability benchmark (issue 19): (a) a new client's first route and first token beside one unreachable
replica, in the network-namespace lab (root), with today's ping budget and with the old "wait for every ping"
(``ping_grace=ping_timeout``); (b) how long the step in flight takes when its server is SIGSTOPped (loopback).

    .venv/bin/python -m load_tests.bench_reachability [--reps 5] [--out load_tests/results/reachability-2026-12-06.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from swarm_client import AutoDistributedModelForCausalLM
from swarm_client.tiny_model import make_tiny_model
from tests.netlab import NetLab, unavailable
from tests.swarm_fixtures import Swarm
from tests.test_route_discovery import run_client, unreachable_replica_swarm

#: the old behaviour: route discovery waits for every new peer's ping (up to ping_timeout)
OLD = {"ping_grace": 3.0, "ping_grace_factor": 1e9}


def discovery(model: str, reps: int) -> dict:
    """(a): ``reps`` new clients per setting beside an unreachable replica of blocks 2:4."""
    out: dict = {"new": [], "old": []}
    with NetLab() as lab, unreachable_replica_swarm(lab, model) as (maddr, _workers):
        for _ in range(reps):
            for key, options in (("new", {}), ("old", OLD)):
                out[key].append(run_client(lab, model, maddr, timeout=120, options=options))
    return out


def failover(model: str, reps: int, stop_at: int = 6, new_tokens: int = 12) -> list[float]:
    """(b): seconds of the decode step during which the serving replica of blocks 2:4 is SIGSTOPped."""
    times = []
    s = Swarm(model)
    stopped: list[int] = []
    try:
        for span in ("0:2", "2:4", "2:4"):
            s.add_worker(blocks=span)
        for _ in range(reps):
            m = AutoDistributedModelForCausalLM.from_pretrained(model, initial_peers=[s.initial_peers])
            prompt = torch.tensor([[3, 14, 15, 92, 65]])
            with torch.inference_mode(), m.inference_session(max_length=64) as session:
                logits = m(prompt, session=session).logits
                for step in range(1, new_tokens):
                    token = logits[:, -1].argmax(-1, keepdim=True)
                    if step == stop_at:
                        hop = next(h for h in session.route if h.start <= 2 < h.end)
                        worker = next(w for w in s.workers if w.peer_id == hop.peer_id)
                        os.killpg(os.getpgid(worker.popen.pid), signal.SIGSTOP)
                        stopped.append(worker.popen.pid)
                        t0 = time.monotonic()
                    logits = m(token, session=session).logits
                    if step == stop_at:
                        times.append(time.monotonic() - t0)
            m.shutdown()
            s.add_worker(blocks="2:4")  # a fresh spare for the next round
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGCONT)
        s.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="load_tests/results/reachability-2026-12-06.json")
    args = parser.parse_args()
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama", family="llama", num_layers=4, seed=0))
    report: dict = {"reps": args.reps, "machine": f"{os.cpu_count()} cores, CPU, tiny llama (4 blocks)"}
    if (reason := unavailable()) is None:
        runs = discovery(model, args.reps)
        report["discovery"] = runs
        for key in ("new", "old"):
            ok = [r for r in runs[key] if "route_s" in r]
            report[f"route_s_median_{key}"] = statistics.median(r["route_s"] for r in ok) if ok else None
            first = [r["route_s"] + r["generate_s"] / 8 for r in ok if "generate_s" in r]
            report[f"first_token_s_median_{key}"] = round(statistics.median(first), 3) if first else None
    else:
        report["discovery"] = f"skipped: {reason}"
    report["failover_s"] = [round(t, 3) for t in failover(model, args.reps)]
    report["failover_s_median"] = statistics.median(report["failover_s"])
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "discovery"}, indent=2))


if __name__ == "__main__":
    main()
