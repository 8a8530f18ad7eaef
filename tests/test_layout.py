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


#: the gateway's sub-packages, each one concern (docs/architecture.md, "Where things are"), and the few
#: modules at its top: the app, its process, settings, errors and what every part shares
GATEWAY_PACKAGES = {
    "schema", "api", "responses", "routes", "decode", "speculation", "tools", "grammars", "affinity", "admission",
    "backends",
}
GATEWAY_TOP_MODULES = {
    "__init__", "app", "run", "server", "settings", "errors", "metrics", "access_log", "redis_client",
}


def _gateway_part(module: str) -> str:
    """``gateway.decode.engine`` → ``decode``; a top-level module is its own part (``gateway.errors`` → ``errors``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _gateway_imports(path: Path) -> set[str]:
    """The ``gateway.*`` modules ``path`` imports at run time (``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gateway."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gateway."))
    return found


def test_gateway_is_grouped_by_concern() -> None:
    """No flat modules creep back: every module lives in a named sub-package or is one of the few at the top;
    every sub-package says what it holds and imports nothing on import (``import gateway.x.y`` stays cheap)."""
    gateway = ROOT / "gateway"
    packages = {p.name for p in gateway.iterdir() if (p / "__init__.py").exists()}
    assert packages == GATEWAY_PACKAGES
    assert {p.stem for p in gateway.glob("*.py")} == GATEWAY_TOP_MODULES
    for name in sorted(packages):
        init = ast.parse((gateway / name / "__init__.py").read_text())
        assert ast.get_docstring(init), f"gateway/{name}/__init__.py: say what the package holds"
        assert not any(isinstance(n, ast.Import | ast.ImportFrom) for n in init.body), f"gateway/{name}/__init__.py"


def test_gateway_parts_import_one_way() -> None:
    """The gateway's parts form layers (schema and backends at the bottom, routes and the app on top): no part
    imports one that imports it back, so each can be read — and tested — from the bottom up."""
    edges: dict[str, set[str]] = {}
    for path in _modules("gateway"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        part = _gateway_part(module)
        edges.setdefault(part, set()).update(_gateway_part(m) for m in _gateway_imports(path))
    for part in edges:
        edges[part].discard(part)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(edges.get(node, ()))
        return False

    circles = sorted(f"{a} → {b}" for a, targets in edges.items() for b in targets if reaches(b, a))
    assert not circles, f"gateway parts importing each other: {circles}"


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
