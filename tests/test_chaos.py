"""``load_tests/chaos.py`` in miniature: 2 streams for 9 s through a gateway, one SIGKILL of a replica.

The script starts its own swarm (a worker for blocks 0:2, two replicas of 2:4) and gateway; its JSON must
show no failed request and every text equal to the fault-free greedy reference, with the kill landing
while streams were in flight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_chaos_script_survives_a_replica_kill_with_exact_texts(tmp_path) -> None:
    out = tmp_path / "chaos.json"
    argv = ["--streams", "2", "--duration", "9", "--kill-every", "5", "--final-wait", "0", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "chaos.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["failed"] == 0 and report["error_samples"] == []
    assert report["mismatched"] == 0 and report["texts_equal"] is True
    assert report["requests"] >= 4
    assert report["kills"] == 1
    kill = report["per_kill"][0]
    assert kill["in_flight"] >= 1 and kill["stall_s"] is not None
    assert len(set(report["references"])) > 1  # the prompts lead to different texts
    assert out.with_suffix(".md").read_text().startswith("# Chaos")


@pytest.mark.timeout(420)
def test_chaos_under_a_saturated_cpu_bans_no_live_server_and_serves_afterwards(tmp_path) -> None:
    """Issue 35 in miniature: 4 streams, two SIGKILLs of a replica, busy processes beside the swarm. No request
    fails, no live server is banned twice (one backoff at most), and the gateway answers afterwards."""
    out = tmp_path / "chaos-load.json"
    argv = ["--streams", "4", "--duration", "30", "--kill-every", "12", "--final-wait", "120", "--cpu-burn", "2"]
    argv += ["--after-requests", "4", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "chaos.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["mismatched"] == 0 and report["kills"] == 2
    assert report["bans"]["healthy_escalations"] == 0, report["bans"]
    assert report["after"]["ok"] == report["after"]["requests"] == 4 and report["after"]["texts_equal"]
    assert report["cpu"]["processes"] == 2
