"""Serving processes shorten the GIL switch interval (swarm_client.runtime.tune_for_serving)."""

from __future__ import annotations

import subprocess
import sys

from swarm_client.runtime import SERVING_SWITCH_INTERVAL, tune_for_serving


def test_tune_for_serving_sets_the_interval_and_honours_the_override(monkeypatch):
    before = sys.getswitchinterval()
    try:
        monkeypatch.delenv("SWARMSERVE_SWITCH_INTERVAL", raising=False)
        assert tune_for_serving() == SERVING_SWITCH_INTERVAL
        assert abs(sys.getswitchinterval() - SERVING_SWITCH_INTERVAL) < 1e-9
        monkeypatch.setenv("SWARMSERVE_SWITCH_INTERVAL", "0.002")
        assert tune_for_serving() == 0.002
        assert abs(sys.getswitchinterval() - 0.002) < 1e-9
    finally:
        sys.setswitchinterval(before)


def test_the_cli_tunes_serving_commands_only():
    """``swarmserve worker`` reaches its own code with the short interval; other commands keep the default."""
    code = (
        "import sys\n"
        "import gateway.cli as cli\n"
        "cli._cmd_worker = lambda args, rest: print(sys.getswitchinterval()) or 0\n"
        "cli._cmd_dht = lambda args, rest: print(sys.getswitchinterval()) or 0\n"
        "cli.main(sys.argv[1:])\n"
    )
    def interval(*argv: str) -> float:
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.strip().splitlines()[-1])

    assert abs(interval("worker", "--model", "m", "--initial-peers", "x") - SERVING_SWITCH_INTERVAL) < 1e-9
    assert abs(interval("dht") - 0.005) < 1e-9
