"""The house plan, checked: imports flow ``gateway → swarm_client ← worker`` (the command line on top),
modules stay small, and a worker runs from an install without the web stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swarmserve", "swarm_client", "worker", "gateway")
MAX_LINES = 400
#: the ``gateway`` extra: a worker-only install has none of these
WEB_STACK = ("fastapi", "starlette", "sse_starlette", "uvicorn", "httpx", "redis", "pydantic_settings", "tiktoken")


def _modules(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """Top-level package names ``path`` imports (absolute imports; relative ones stay inside a package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("swarm_client", {"worker", "gateway", "swarmserve"}),  # the library depends on neither side
        ("worker", {"gateway", "swarmserve"}),
        ("gateway", {"worker", "swarmserve"}),
    ],
)
def test_imports_flow_one_way(package: str, forbidden: set[str]) -> None:
    wrong = {str(p.relative_to(ROOT)): sorted(_imported(p) & forbidden) for p in _modules(package)}
    assert not {k: v for k, v in wrong.items() if v}


def test_modules_stay_small() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules(*PACKAGES, "load_tests")}
    assert not {path: n for path, n in sizes.items() if n > MAX_LINES}, f"split modules over {MAX_LINES} lines"


_WITHOUT_WEB_STACK = f"""
import sys
from importlib.abc import MetaPathFinder

class NoWebStack(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {WEB_STACK!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: a worker-only install)", name=name)

sys.meta_path.insert(0, NoWebStack())
"""


def _run_without_web_stack(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_WEB_STACK + code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_worker_runs_without_the_web_stack() -> None:
    """Everything ``swarmserve worker`` and the Python client load, from an install without ``[gateway]``."""
    result = _run_without_web_stack(
        "import worker.server, worker.handler, swarm_client.model, swarmserve.launcher\n"
        "from swarm_client import AutoDistributedModelForCausalLM\n"
        "from swarmserve.cli import main\n"
        "try:\n"
        "    main(['worker', '--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print('loaded:', sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{WEB_STACK!r}))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "--cache-tokens" in result.stdout
    assert "loaded: []" in result.stdout


def test_gateway_commands_say_what_to_install_without_the_web_stack() -> None:
    for argv in (["gateway", "--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], ["up", "--model", "m"]):
        result = _run_without_web_stack(f"from swarmserve.cli import main\nmain({argv!r})\n")
        assert result.returncode != 0
        assert "pip install 'swarmserve[gateway]'" in result.stderr, result.stderr
