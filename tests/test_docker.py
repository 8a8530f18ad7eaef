"""docker-compose.yml and the Dockerfiles, checked without a Docker engine.

Each service's command is interpolated the way Compose does it and parsed by the real
``swarmserve.cli.build_parser()``, so the images run exactly the CLI the other tests run.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from swarmserve.cli import build_parser
from swarmserve.cli.dht import announced_maddrs

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_PEER = "/ip4/10.0.0.5/tcp/31337/p2p/QmSoo6CLTKrjQioNvX5WxFG5v3iXhE1cdv82uBx2Z5x9DR"
SAMPLE_ENV = {
    "MODEL": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "INITIAL_PEERS": SAMPLE_PEER,
    "NUM_BLOCKS": "12",
    "PUBLIC_IP": "198.51.100.23",
}
_VAR = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax: ``$VAR``, ``${VAR}``, ``${VAR:-dflt}``, ``${VAR-dflt}``, ``${VAR:?err}``."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg, value = m.group("op"), m.group("arg") or "", env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return arg if value is None else value
        if op in (":?", "?") and not value:
            raise KeyError(f"{name}: {arg}")
        return value or ""

    return _VAR.sub(sub, text)


def resolve(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(x, env) for x in node]
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    return node


def compose(env: dict[str, str] | None = None) -> dict:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return resolve(raw, SAMPLE_ENV if env is None else env)


def argv(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def parse(service: dict):
    args = argv(service)
    assert args[0] == "swarmserve", args
    return build_parser().parse_args(args[1:])


@pytest.fixture(scope="module")
def services() -> dict:
    return compose()["services"]


def test_services_and_pinned_images(services: dict) -> None:
    assert {"redis", "dht", "gateway", "worker"} <= set(services)
    for name, service in services.items():
        image = service.get("image")
        assert image and ":" in image and not image.endswith(":latest"), (name, image)
        if "build" in service:
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name


def test_redis_is_health_checked_and_the_gateway_waits_for_it(services: dict) -> None:
    assert services["redis"]["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_dht_command(services: dict) -> None:
    args = parse(services["dht"])
    assert (args.command, args.host, args.port) == ("dht", "0.0.0.0", 31337)
    assert args.identity_path.startswith("/data/dht/")  # a stable peer id for INITIAL_PEERS
    assert any(v.split(":")[1] == "/data/dht" for v in services["dht"]["volumes"])
    assert "31337:31337" in services["dht"]["ports"]


def test_gateway_command_and_healthcheck(services: dict) -> None:
    gateway = services["gateway"]
    args = parse(gateway)
    assert args.command == "gateway" and args.model == SAMPLE_ENV["MODEL"]
    assert args.initial_peers == [SAMPLE_PEER]
    assert (args.redis_url, args.host, args.port) == ("redis://redis:6379/0", "0.0.0.0", 8000)
    assert any("/health" in part for part in gateway["healthcheck"]["test"])
    assert gateway["ports"] == ["8000:8000"]


def test_worker_command_gpu_and_weights_cache(services: dict) -> None:
    worker = services["worker"]
    args = parse(worker)
    assert args.command == "worker" and args.model == SAMPLE_ENV["MODEL"]
    assert args.initial_peers == [SAMPLE_PEER] and args.num_blocks == 12
    assert (args.device, args.host) == ("cuda", "0.0.0.0")
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    env = worker["environment"]
    assert env["MODEL"] == SAMPLE_ENV["MODEL"] and env["INITIAL_PEERS"] == SAMPLE_PEER
    hf_home = env["HF_HOME"]
    volume, mount = worker["volumes"][0].split(":")[:2]
    assert mount == hf_home and volume in compose()["volumes"]
    assert "depends_on" not in worker  # `docker compose up worker` joins whatever swarm INITIAL_PEERS names
    assert f"{args.port}:{args.port}" in worker["ports"]


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_workers_serve_the_adapters_of_the_environment(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = compose({**SAMPLE_ENV, "ADAPTERS": "chat=user/chat-lora sql=user/sql-lora"})["services"][name]
    monkeypatch.setenv("SWARMSERVE_ADAPTERS", service["environment"]["SWARMSERVE_ADAPTERS"])
    assert parse(service).adapters == ["chat=user/chat-lora", "sql=user/sql-lora"]
    monkeypatch.setenv("SWARMSERVE_ADAPTERS", compose()["services"][name]["environment"]["SWARMSERVE_ADAPTERS"])
    assert parse(compose()["services"][name]).adapters == []  # unset: none


def test_gateway_shares_the_weights_cache(services: dict) -> None:
    worker_volume = services["worker"]["volumes"][0]
    assert worker_volume in services["gateway"]["volumes"]  # the gateway loads the embeddings and LM head
    assert services["gateway"]["environment"]["HF_HOME"] == worker_volume.split(":")[1]


def test_cpu_worker_profile(services: dict) -> None:
    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu
    assert parse(cpu).device == "cpu"


def test_defaults_fill_in_and_missing_peers_fail_loudly() -> None:
    services = compose({"INITIAL_PEERS": SAMPLE_PEER, "PUBLIC_IP": "198.51.100.23"})["services"]
    assert parse(services["worker"]).model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    services = compose({"PUBLIC_IP": "198.51.100.23"})["services"]
    with pytest.raises(SystemExit):  # no silent single-node swarm: --initial-peers needs a value
        parse(services["worker"])


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
@pytest.mark.parametrize("port", [None, "31400"])
def test_worker_announces_a_reachable_address_from_the_environment(name: str, port: str | None) -> None:
    """In Docker's bridge network a worker sees only its container's address: it must announce PUBLIC_IP and a
    port that the host publishes to the very port it listens on, on every interface."""
    env = {**SAMPLE_ENV, **({"WORKER_PORT": port} if port else {})}
    service = compose(env)["services"][name]
    args = parse(service)
    announced = announced_maddrs(args.public_ip, args.port, args.announce_maddrs)
    assert announced == [f"/ip4/{env['PUBLIC_IP']}/tcp/{port or 31330}"]
    assert args.host == "0.0.0.0"  # the published port reaches the listener through the container's interface
    published = [p.split(":") for p in service["ports"]]
    assert [str(args.port), str(args.port)] in published  # host port announced == container port listened on


def test_worker_without_public_ip_refuses_to_start() -> None:
    """No PUBLIC_IP: the worker exits saying what to set, rather than announce an address only this host can dial
    (tests/test_docker_compose.py sees the same from a real container)."""
    from swarmserve.cli.worker import run

    env = {k: v for k, v in SAMPLE_ENV.items() if k != "PUBLIC_IP"}
    services = compose(env)["services"]
    for name in ("worker", "worker-cpu"):
        args = parse(services[name])
        assert args.public_ip == ""
        with pytest.raises(SystemExit, match="PUBLIC_IP is not set"):
            run(args, [])
    parse(services["dht"]), parse(services["gateway"])  # the rest of the stack still starts without it


# ------------------------------------------------------------------------------------ Dockerfiles
def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (ROOT / "docker" / name).read_text()
    text = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    pairs = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            pairs.append((instruction.upper(), rest.strip()))
    return pairs


@pytest.mark.parametrize("name", ["Dockerfile.gateway", "Dockerfile.worker", "Dockerfile.worker-cpu"])
def test_dockerfile(name: str) -> None:
    steps = dockerfile(name)
    args = {}
    for instruction, rest in steps:
        if instruction == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
    (base,) = [interpolate(rest, args) for instruction, rest in steps if instruction == "FROM"]
    repo, _, tag = base.partition(":")
    assert tag and tag != "latest", base
    if name == "Dockerfile.worker":
        assert "cuda" in tag and repo == "pytorch/pytorch", base
    else:
        assert repo == "python" and "slim" in tag, base

    assert steps.index(("ARG", f"BASE_IMAGE={args['BASE_IMAGE']}")) < steps.index(("FROM", "${BASE_IMAGE}"))
    runs = " ".join(rest for instruction, rest in steps if instruction == "RUN")
    # the dependencies with only the extra its role needs (a worker image has no web stack), read from
    # pyproject.toml before the code is copied, so a code-only change rebuilds only the last layers
    extra = "gateway" if name == "Dockerfile.gateway" else "worker"
    assert f"optional-dependencies']['{extra}']" in runs or f"d['{extra}']" in runs, runs
    copies = [rest for instruction, rest in steps if instruction == "COPY"]
    assert copies == ["pyproject.toml /app/", ". /app"], copies
    assert re.search(r"pip install --no-deps --no-build-isolation /app(\s|$)", runs), runs
    if name != "Dockerfile.worker":
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"  # not multi-GB CUDA wheels
        assert '"torch==${TORCH_VERSION}"' in runs
    assert ("USER", "swarm") in steps  # not root
    (check,) = [rest for instruction, rest in steps if instruction == "HEALTHCHECK"]
    assert ("/health" if name == "Dockerfile.gateway" else "/metrics") in check
    (cmd,) = [rest for instruction, rest in steps if instruction in ("CMD", "ENTRYPOINT")]
    command = json.loads(cmd)
    assert command[0] == "swarmserve"
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert command[1] in commands
    assert any(i == "ENV" and "HF_HOME=" in rest for i, rest in steps)


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv"} <= ignored


@pytest.mark.parametrize(
    ("public_ip", "port", "maddrs", "error"),
    [
        ("198.51.100.23", 0, [], "fixed --port"),
        ("not-an-ip", 31330, [], "not an IP address"),
        (None, 0, ["/ip4/198.51.100.23/tcp/0"], "explicit, non-zero port"),
        (None, 0, ["/ip4/198.51.100.23"], "explicit, non-zero port"),
        (None, 0, ["198.51.100.23:31330"], "not a multiaddr"),
    ],
)
def test_announce_flags_refuse_what_nobody_could_dial(public_ip, port, maddrs, error) -> None:
    with pytest.raises(ValueError, match=error):
        announced_maddrs(public_ip, port, maddrs)


def test_announce_flags_build_the_addresses() -> None:
    assert announced_maddrs(None, 0, []) == []  # hivemind announces what it listens on
    assert announced_maddrs("2001:db8::7", 31330, ["/dns4/home.example.org/tcp/31330"]) == [
        "/dns4/home.example.org/tcp/31330",
        "/ip6/2001:db8::7/tcp/31330",
    ]
