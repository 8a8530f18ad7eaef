"""The per-module time table at the end of a run (tests/module_times.py), run on a real inner pytest session
of two small test files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_modules_are_listed_slowest_first_with_their_phases(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.module_times import ModuleTimes\n\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(ModuleTimes(), 'module-times')\n"
    )
    (tmp_path / "test_slow.py").write_text(
        "import time, pytest\n\n"
        "@pytest.fixture(scope='module')\n"
        "def started():\n"
        "    time.sleep(0.4)\n"
        "    yield\n"
        "    time.sleep(0.2)\n\n"
        "def test_a(started):\n    time.sleep(0.1)\n\n"
        "def test_b(started):\n    pass\n"
    )
    (tmp_path / "test_fast.py").write_text("def test_c():\n    pass\n")
    table = tmp_path / "times.tsv"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SWARMSERVE_MODULE_TIMES_FILE": str(table)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "slowest 2 modules" in line)
    slow, fast = lines[header + 1], lines[header + 2]
    assert "test_slow.py (2 tests;" in slow and "test_fast.py (1 tests;" in fast, out
    rows = [row.split("\t") for row in table.read_text().splitlines()[1:]]
    assert rows[0][0] == "test_slow.py" and rows[0][1] == "2"
    setup, call, teardown, total = map(float, rows[0][2:])
    assert setup >= 0.4 and call >= 0.1 and teardown >= 0.2 and total >= 0.7
    assert float(rows[1][5]) < total
