"""The images built and docker-compose.yml run as a volunteer runs them, against a real Docker engine.

One module fixture builds the gateway, CPU worker and (test-only) Redis images on the local Debian base
(``scripts/docker_base.sh``: no image registry is reachable here), with the CPU torch wheel served from this
machine's disk instead of a multi-GB CUDA download, then brings up the compose file with the tiny model mounted
at ``/models/tiny``: Redis, the DHT, the gateway and one ``worker-cpu`` as the first machine does, and a second
``worker-cpu`` in its own compose project that joins the way the compose file's comments tell another machine to
(``INITIAL_PEERS=/ip4/<first machine>/tcp/31337/p2p/… PUBLIC_IP=<this machine>``). The tests then talk to it
only from outside: HTTP, the openai SDK, ``docker compose exec|stop|run``, ``docker kill``.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import require_or_skip
from tests.gateway_fixtures import chat_prompt_ids, eos_bias, greedy_reference, greedy_without_eos

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
OVERRIDE = ROOT / "tests" / "docker" / "compose.test.yml"
BASE_IMAGE = os.environ.get("SWARMSERVE_BASE_IMAGE", "swarmserve-base:bookworm")
IMAGES = {  # tag (the one docker-compose.yml names) → (Dockerfile, build context)
    "swarmserve-gateway:0.1.0": (ROOT / "docker" / "Dockerfile.gateway", ROOT),
    "swarmserve-worker-cpu:0.1.0": (ROOT / "docker" / "Dockerfile.worker-cpu", ROOT),
    "swarmserve-redis:test": (ROOT / "tests" / "docker" / "Dockerfile.redis", ROOT / "tests" / "docker"),
}
MAX_TOKENS = 12
WHEEL_PORT = 31998  # serves the host's torch wheel to `docker build --network host`
STOP_GRACE_S = 30  # docker-compose.yml's stop_grace_period for the workers
TIMELINE: list[tuple[str, float]] = []  # (event, seconds since the fixture began): printed as it goes
T0 = [0.0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_address(project: str) -> str:
    """This machine's address as the other "machine" (a second compose project) reaches it: the first project's
    bridge gateway, where the published ports answer. Not the address of the default route: here that is in
    192.0.2.0/24 (TEST-NET), which the workers' reachability checkers refuse to dial as neither public nor on a
    network they share (worker/dial_policy.py), as a real PUBLIC_IP would be."""
    fmt = "{{(index .IPAM.Config 0).Gateway}}"
    return run(["docker", "network", "inspect", "--format", fmt, f"{project}_default"]).strip()


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 600, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(cmd)} → {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


@functools.cache
def compose_cmd() -> list[str]:
    """Compose v2 (``docker compose``) where installed, else Debian's ``docker-compose`` (v1.29)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    require_or_skip("docker", "neither `docker compose` nor `docker-compose` is installed")


def docker_ready() -> None:
    """The engine answers, started through scripts/docker_base.sh when we may; else skip (or fail)."""
    if not shutil.which("docker"):
        require_or_skip("docker", "no docker CLI")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.geteuid() != 0 or not shutil.which("dockerd"):
            require_or_skip("docker", "the Docker engine is not running and cannot be started here")
        proc = subprocess.run([str(ROOT / "scripts" / "docker_base.sh"), "dockerd"], capture_output=True, text=True)
        if proc.returncode:
            require_or_skip("docker", f"dockerd did not start: {proc.stderr[-500:]}")
    compose_cmd()


def torch_wheel_dir() -> tuple[str, Path | None]:
    """The host's torch version and the directory pip finds its CPU wheel in (``find-links``), if any."""
    import torch

    version = torch.__version__.split("+")[0]
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        config = subprocess.run(["pip", "config", "list"], capture_output=True, text=True).stdout
        links += [v for k, v in re.findall(r"^(\S*find-links)='([^']*)'", config, flags=re.M)]
    except OSError:
        pass
    for link in links:
        for part in link.split():
            path = Path(part.removeprefix("file://"))
            if path.is_dir() and any(path.glob(f"torch-{version}*-cp311-*.whl")):
                return version, path
    return version, None


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    model_dir: Path
    gateway_url: str
    initial_peers: str  # as the first machine's services dial the DHT (/dns4/dht/...)
    public_peers: str  # as another machine dials it (/ip4/<host>/tcp/31337/...)
    second: str = ""  # the compose project of the second machine's worker
    second_env: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, project: str | None = None, env: dict | None = None, **kw) -> str:
        base = [*compose_cmd(), "-p", project or self.project, "-f", "docker-compose.yml", "-f", str(OVERRIDE)]
        return run([*base, "--profile", "cpu", *args], env=env or self.env, **kw)

    def model_id(self) -> str:
        with urllib.request.urlopen(f"{self.gateway_url}/v1/models", timeout=10) as r:
            return json.load(r)["data"][0]["id"]

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.gateway_url}/v1", api_key="none", timeout=60, max_retries=0)


def mark(event: str) -> None:
    TIMELINE.append((event, time.monotonic() - T0[0]))
    print(f"[docker-compose timeline] {TIMELINE[-1][1]:7.1f} s  {event}", flush=True)


def build_images() -> None:
    subprocess.run([str(ROOT / "scripts" / "docker_base.sh"), "base"], check=True, timeout=900)
    mark("base image ready")
    version, wheels = torch_wheel_dir()
    args = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", f"TORCH_VERSION={version}"]
    server = None
    if wheels is not None:  # pip in the build reaches this server through the host network
        handler = functools.partial(QuietHandler, directory=str(wheels))
        try:  # a fixed port: the link is a build argument, and a new value would rebuild every layer after it
            server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
        except OSError:  # taken (another run): correct, only not cached
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        link = f"http://127.0.0.1:{server.server_address[1]}/"
        args += ["--build-arg", "TORCH_INDEX_URL=", "--build-arg", f"PIP_FIND_LINKS={link}"]
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    try:
        for tag, (dockerfile, context) in IMAGES.items():
            started = time.monotonic()
            cmd = ["docker", "build", "--network", "host", "-q", "-f", str(dockerfile), "-t", tag, *args, str(context)]
            run(cmd, env=env, timeout=1500)
            mark(f"built {tag} in {time.monotonic() - started:.0f} s")
    finally:
        if server is not None:
            server.shutdown()


def wait_for(predicate, timeout: float, what: str, logs=None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(2)
    raise AssertionError(f"{what} not within {timeout:.0f} s (last: {last!r})\n{logs() if logs else ''}")


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    docker_ready()
    T0[0] = time.monotonic()
    TIMELINE.clear()
    build_images()

    from swarm_client.tiny_model import make_tiny_model

    model_dir = Path(tempfile.mkdtemp(prefix="swarmserve-docker-model-"))
    make_tiny_model(model_dir / "tiny", family="llama", num_layers=4, seed=0)
    for path in [model_dir, *model_dir.rglob("*")]:  # the containers' user (uid 1000) reads it
        path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
    project = f"swarmtest{os.getpid()}"
    ports = {"GATEWAY_PORT": free_port(), "WORKER_PORT": free_port(), "SECOND_PORT": free_port()}
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("INITIAL_PEERS", "PUBLIC_IP", "MODEL")},
        "MODEL": "/models/tiny",
        "SWARMSERVE_TEST_MODEL_DIR": str(model_dir / "tiny"),
        "GATEWAY_PORT": str(ports["GATEWAY_PORT"]),
        "WORKER_PORT": str(ports["WORKER_PORT"]),
        "CACHE_TOKENS": "4096",
    }
    s = Stack(project, env, model_dir / "tiny", f"http://127.0.0.1:{ports['GATEWAY_PORT']}", "", "")
    s.second = f"{project}m2"
    try:
        # the first machine, as docker-compose.yml's comments say: redis + dht, read the DHT's address, then the rest
        s.compose("up", "-d", "--no-build", "redis", "dht")
        logs = wait_for(
            lambda: re.search(r"initial_peers: (\S+)", s.compose("logs", "dht", check=False)),
            120,
            "the DHT's initial_peers line",
            lambda: s.compose("logs", check=False),
        )
        peer_id, ip = logs.group(1).rsplit("/p2p/", 1)[1], host_address(project)
        s.initial_peers = f"/dns4/dht/tcp/31337/p2p/{peer_id}"
        s.public_peers = f"/ip4/{ip}/tcp/31337/p2p/{peer_id}"
        mark("redis + dht up")
        s.env.update(INITIAL_PEERS=s.initial_peers, PUBLIC_IP=ip)
        s.compose("up", "-d", "--no-build", "gateway", "worker-cpu")
        # another machine joins: its own compose project, the first machine's public DHT address
        s.second_env = {
            **env,
            "INITIAL_PEERS": s.public_peers,
            "PUBLIC_IP": ip,
            "WORKER_PORT": str(ports["SECOND_PORT"]),
        }
        s.compose("up", "-d", "--no-build", "worker-cpu", project=s.second, env=s.second_env)
        mark("gateway + 2 workers started")
        wait_for(
            lambda: health(s.gateway_url)[0] == 200,
            300,
            "gateway /health 200",
            lambda: (
                s.compose("logs", "--tail", "40", check=False)
                + s.compose("logs", "--tail", "40", project=s.second, env=s.second_env, check=False)
            ),
        )
        mark("gateway healthy (every block covered)")
        yield s
    finally:
        for project_name, penv in ((s.second, s.second_env or env), (project, s.env)):
            s.compose("down", "-v", "--remove-orphans", "-t", "5", project=project_name, env=penv, check=False)
        shutil.rmtree(model_dir, ignore_errors=True)
        mark("down")


def conversation(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"You are a terse assistant ({tag})."}]


def stream_text(s: Stack, messages: list[dict]) -> str:
    stream = s.client().chat.completions.create(
        model=s.model_id(), messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def expected_text(s: Stack, messages: list[dict]) -> str:
    return greedy_reference(chat_prompt_ids(messages, s.model_dir), MAX_TOKENS, s.model_dir).text


def test_health_and_streamed_chat_equal_local_greedy(stack: Stack) -> None:
    status, body = health(stack.gateway_url)
    assert status == 200 and body["status"] == "ok" and body["missing_blocks"] == [], body
    messages = conversation("stream") + [{"role": "user", "content": "Name three colors."}]
    assert stream_text(stack, messages) == expected_text(stack, messages)


def test_status_inside_the_gateway_container_shows_every_block_covered(stack: Stack) -> None:
    status = ["swarmserve", "status", "--model", "/models/tiny", "--initial-peers", stack.initial_peers]
    out = stack.compose("exec", "-T", "gateway", *status)
    assert "fully covered: every block has an ONLINE server" in out, out


def test_second_turn_reuses_the_cache(stack: Stack) -> None:
    client, model = stack.client(), stack.model_id()
    messages = conversation("cache") + [{"role": "user", "content": "Count to five."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And back to one."},
    ]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage
    assert second.choices[0].message.content == expected_text(stack, messages)


def test_images_run_as_non_root(stack: Stack) -> None:
    for tag in IMAGES:
        if "redis" not in tag:
            assert run(["docker", "image", "inspect", "--format", "{{.Config.User}}", tag]).strip() == "swarm"
    assert stack.compose("exec", "-T", "gateway", "id", "-u").strip() == "1000"
    assert stack.compose("exec", "-T", "worker-cpu", "id", "-u").strip() == "1000"


def test_health_checks_report_healthy(stack: Stack) -> None:
    """The images' HEALTHCHECKs: the gateway's /health (every block covered), a worker's /metrics (served only
    once it announced itself ONLINE)."""

    def status(service: str, project: str, env: dict) -> str:
        (container,) = stack.compose("ps", "-q", service, project=project, env=env).split()
        return run(["docker", "inspect", "--format", "{{.State.Health.Status}}", container]).strip()

    services = [("gateway", stack.project, stack.env), ("worker-cpu", stack.project, stack.env)]
    services.append(("worker-cpu", stack.second, stack.second_env))
    wait_for(lambda: all(status(*s) == "healthy" for s in services), 90, "healthy containers")
    mark("gateway and both workers healthy")


def test_worker_without_public_ip_exits_with_the_explanation(stack: Stack) -> None:
    env = {k: v for k, v in stack.env.items() if k != "PUBLIC_IP"}
    proc = subprocess.run(
        [*compose_cmd(), "-p", stack.project, "-f", "docker-compose.yml", "-f", str(OVERRIDE), "--profile", "cpu",
         "run", "--rm", "--no-deps", "-T", "worker-cpu"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "PUBLIC_IP is not set" in out and "expected one argument" not in out, out


def _serving_peer(stack: Stack, project: str, env: dict) -> str:
    logs = stack.compose("logs", "--no-color", "worker-cpu", project=project, env=env, check=False)
    return re.findall(r"swarmserve worker ready: .* as peer (\S+);", logs)[-1]


def test_killing_the_serving_worker_mid_stream_keeps_the_text(stack: Stack) -> None:
    """``docker kill`` of the worker container holding a stream's session (read from ``x-swarm-route``): the
    gateway fails over to the other machine's worker and the streamed text equals the local greedy text; tokens
    keep coming after the kill, so the generation did outlive it. The killed worker is started again after."""
    machines = {
        _serving_peer(stack, stack.project, stack.env): (stack.project, stack.env),
        _serving_peer(stack, stack.second, stack.second_env): (stack.second, stack.second_env),
    }
    messages = conversation("kill") + [{"role": "user", "content": "Tell me a long story."}]
    long_reply = 600
    _, expected = greedy_without_eos(chat_prompt_ids(messages, stack.model_dir), long_reply, stack.model_dir)
    raw = stack.client().chat.completions.with_raw_response.create(
        model=stack.model_id(), messages=messages, max_tokens=long_reply, temperature=0, stream=True,
        logit_bias=eos_bias(stack.model_dir),
    )  # fmt: skip
    serving = raw.headers["x-swarm-route"].split("[")[0]
    assert serving in machines, (raw.headers["x-swarm-route"], machines)
    text, arrivals, killed_at, killed = "", [], 0.0, None
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        arrivals.append(time.monotonic())
        if killed is None and len(text) >= 20:
            project, env = machines[serving]
            (container,) = stack.compose("ps", "-q", "worker-cpu", project=project, env=env).split()
            run(["docker", "kill", container])
            killed, killed_at = (project, env), time.monotonic()
            mark("serving worker killed mid-stream")
    assert killed is not None, "the stream ended before the kill"
    later = [t for t in arrivals if t > killed_at]
    tail_s = arrivals[-1] - killed_at
    print(f"{len(arrivals)} chunks, {len(later)} after the kill; the stream ended {tail_s:.2f} s after it")
    assert tail_s > 0.5, tail_s  # tokens kept being made after the kill: the reply went on elsewhere
    assert text == expected
    project, env = killed
    stack.compose("up", "-d", "--no-build", "worker-cpu", project=project, env=env)
    (container,) = stack.compose("ps", "-q", "worker-cpu", project=project, env=env).split()
    health_of = ["docker", "inspect", "--format", "{{.State.Health.Status}}", container]
    wait_for(lambda: run(health_of).strip() == "healthy", 180, "the killed worker ONLINE again")
    mark("killed worker started again")


def test_stopping_the_second_worker_drains_within_the_grace_period_and_chat_goes_on(stack: Stack) -> None:
    started = time.monotonic()
    stack.compose("stop", "worker-cpu", project=stack.second, env=stack.second_env, timeout=STOP_GRACE_S + 30)
    took = time.monotonic() - started
    state = run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={stack.second}",
                 "--format", "{{.Status}}"])  # fmt: skip
    assert took < STOP_GRACE_S and "Exited (137)" not in state, (took, state)  # drained, not killed
    mark(f"second worker stopped in {took:.1f} s")
    messages = conversation("after-stop") + [{"role": "user", "content": "Say hello."}]
    assert stream_text(stack, messages) == expected_text(stack, messages)
