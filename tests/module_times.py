"""Where a whole run's time goes, per test module: set-up, calls and teardown of each file's tests summed
(module fixtures included, since their set-up is charged to the first test that uses them), printed at the
end of a run of more than one module — the list issue 36's "which modules to make faster" starts from.

``--durations`` names single tests; a module that starts a swarm per parametrization or spends its time in
many short tests only shows here. ``SWARMSERVE_MODULE_TIMES=N`` sets how many modules are listed (default 25,
0: none); ``SWARMSERVE_MODULE_TIMES_FILE=PATH`` also writes every module's figures as TSV.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

__all__ = ["ModuleTimes"]


class ModuleTimes:
    """A pytest plugin: seconds per test file and phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.tests: dict[str, int] = defaultdict(int)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        self.seconds[module][report.when] += report.duration
        if report.when == "call":
            self.tests[module] += 1

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        limit = int(os.environ.get("SWARMSERVE_MODULE_TIMES", "25"))
        totals = {module: sum(phases.values()) for module, phases in self.seconds.items()}
        path = os.environ.get("SWARMSERVE_MODULE_TIMES_FILE")
        if path:
            with open(path, "w") as out:
                out.write("module\ttests\tsetup_s\tcall_s\tteardown_s\ttotal_s\n")
                for module, total in sorted(totals.items(), key=lambda kv: -kv[1]):
                    p = self.seconds[module]
                    out.write(
                        f"{module}\t{self.tests[module]}\t{p['setup']:.1f}\t{p['call']:.1f}\t"
                        f"{p['teardown']:.1f}\t{total:.1f}\n"
                    )
        if limit <= 0 or len(totals) < 2:
            return
        everything = sum(totals.values())
        terminalreporter.write_sep("=", f"slowest {min(limit, len(totals))} modules (set-up + calls + teardown)")
        for module, total in sorted(totals.items(), key=lambda kv: -kv[1])[:limit]:
            p = self.seconds[module]
            terminalreporter.write_line(
                f"{total:8.1f}s {100 * total / everything:5.1f}%  {module} ({self.tests[module]} tests; "
                f"set-up {p['setup']:.1f}s, calls {p['call']:.1f}s, teardown {p['teardown']:.1f}s)"
            )
        terminalreporter.write_line(f"{everything:8.1f}s in all, {len(totals)} modules")
