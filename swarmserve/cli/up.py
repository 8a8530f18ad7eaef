"""``swarmserve up``: the embedded default — a DHT in this process, N worker children splitting the model's
blocks evenly (``swarmserve.launcher.LocalSwarm``) and the gateway, with one command.

Ctrl-C / SIGTERM stops all of it: the gateway first (no new sessions), then the client closes its
sessions (servers free their caches), then the workers drain (SIGTERM → OFFLINE → exit, killed with their
process group after ``--grace``), the DHT last. A second Ctrl-C kills the workers at once.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import time

from swarmserve.cli.common import (
    DEFAULT_MODEL,
    add_listen_flags,
    cache_tokens_arg,
    interruptible,
    require_gateway_extra,
    stop_on_signals,
    subcommand,
    swarmserve_command,
)
from swarmserve.cli.gateway import (
    add_client_flags,
    add_limit_flags,
    add_speculation_flags,
    client_options,
    limit_settings,
    speculation_settings,
    trust_settings,
)
from swarmserve.cli.worker import DTYPES

UP_PREFIX = "swarmserve up:"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "up", "DHT + N block servers + gateway on this machine, with one command")
    p.add_argument("--model", default=DEFAULT_MODEL, help="local path or 🤗 id")
    p.add_argument(
        "--served-model-name",
        dest="model_id",
        default=None,
        help="the model name clients send and /v1/models shows (default: --model, or its directory's name)",
    )
    p.add_argument("--workers", type=int, default=2, help="block servers; the model's blocks are split evenly")
    add_listen_flags(p, "the HTTP API", 8000)
    p.add_argument("--device", default="cpu", help="workers' device: cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="workers' weights (auto: the checkpoint's)")
    p.add_argument(
        "--cache-tokens",
        type=cache_tokens_arg,
        default=None,
        metavar="N|auto",
        help="KV-cache budget of each worker in token slots (default auto: sized from free memory, see worker)",
    )
    p.add_argument("--torch-threads", type=int, default=None, help="threads per worker (default: CPU cores / workers)")
    p.add_argument("--throughput", type=float, default=None, help="workers announce this tok/s instead of measuring")
    p.add_argument(
        "--adapters",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="every worker also serves these PEFT LoRA adapters; the gateway lists each as the model MODEL:NAME",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the workers")
    p.add_argument("--grace", type=float, default=15.0, help="seconds a worker may drain before it is killed")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the workers' logs")
    add_client_flags(p)
    add_speculation_flags(p)
    add_limit_flags(p)
    p.set_defaults(func=run, exit_now=True, log_datefmt="%H:%M:%S")


def say(message: str) -> None:
    """One line of ``up``'s own, stamped ``HH:MM:SS`` (its log lines carry the same clock)."""
    print(f"{time.strftime('%H:%M:%S')} {UP_PREFIX} {message}", flush=True)


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None: checked before minutes of worker startup."""
    if port == 0:
        return None
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def curl_example(base_url: str, model: str) -> str:
    """A ready-to-paste streaming chat request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a haiku about a swarm of servers."}],
        "max_tokens": 64,
        "stream": True,
    }
    return f"curl -N {base_url}/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"


def status_example(maddr: str, model: str) -> str:
    """The ``swarmserve status`` command for this swarm, ready to paste into any shell (a new terminal has
    no virtual environment active, so the command names the ``swarmserve`` this one runs from)."""
    return f"{swarmserve_command()} status --initial-peers {maddr} --model {shlex.quote(model)}"


def run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.workers < 1:
        say("error: --workers must be at least 1")
        return 2
    require_gateway_extra("up")
    from swarmserve.launcher import LocalSwarm

    # the DHT forks a process: before torch and transformers start threads here, and before our signal
    # handlers (its process keeps the default ones)
    swarm = LocalSwarm(args.model, echo=args.verbose, grace=args.grace, say=say, own_session=True)

    def kill_workers() -> None:  # a second Ctrl-C: no more patience
        for w in swarm.workers:
            w.kill()

    with stop_on_signals(on_repeat=kill_workers) as stop:
        try:
            return _serve(args, swarm, stop)
        finally:
            started = bool(swarm.workers)
            swarm.close()
            if started:
                say("stopped")


def _serve(args: argparse.Namespace, swarm, stop) -> int:
    from gateway.backends.adapters import public_model_id
    from gateway.run import GatewayConfig, quiet_http_logs, serving_gateway
    from gateway.settings import GatewaySettings
    from swarm_client.model_source import ModelNotFoundError, resolve_model_path
    from swarm_client.sequence_manager import AUTO_GROUPS
    from swarmserve.launcher import WorkerStartError, split_blocks

    quiet_http_logs()
    say(f"DHT at {swarm.initial_peers}")
    say(f"resolving model {args.model}")
    try:
        with interruptible(stop):  # a first run converts the default model: Ctrl-C must not wait a minute
            model_dir = resolve_model_path(args.model)
    except ModelNotFoundError as exc:
        say(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        say("interrupted while preparing the model")
        return 0
    if (busy := port_in_use(args.host, args.port)) is not None:
        say(f"error: cannot listen on {args.host}:{args.port} ({busy}); pick another --port")
        return 2
    from swarm_client.lora import parse_adapter_specs

    try:
        adapters = [spec.name for spec in parse_adapter_specs(args.adapters)]
    except ValueError as exc:
        say(f"error: {exc}")
        return 2
    swarm.model = str(model_dir)
    spans = split_blocks(swarm.num_blocks, args.workers)
    swarm.threads = args.torch_threads  # None: the cores shared evenly
    say(
        f"{swarm.num_blocks} blocks from {model_dir}; {len(spans)} worker(s): "
        + ", ".join(f"{a}:{b}" for a, b in spans)
    )
    extra = ["--device", args.device, "--dtype", args.dtype, "--cache-tokens", str(args.cache_tokens or "auto")]
    if args.throughput is not None:
        extra += ["--throughput", str(args.throughput)]
    if adapters:
        extra += ["--adapters", *args.adapters]
    try:
        swarm.cover(len(spans), *extra, timeout=args.ready_timeout, stop=stop)
    except InterruptedError:
        say("interrupted before the swarm was ready")
        return 0
    except WorkerStartError as exc:
        say(f"error: {exc}")
        return 1

    # one pipeline group per server of a route: while one worker computes a group, the next another
    groups = args.pipeline_groups
    if groups == AUTO_GROUPS and len(spans) > 1:
        say("sessions dealt into one pipeline group per server of their route (--pipeline-groups)")
    elif groups != AUTO_GROUPS and groups > 1:
        say(f"sessions dealt into {groups} pipeline groups (--pipeline-groups)")
    settings = GatewaySettings(
        model=args.model,
        host=args.host,
        port=args.port,
        initial_peers=swarm.maddrs,
        **limit_settings(args),
        **trust_settings(args),
        **speculation_settings(args),
    )
    if settings.trusted_peers:
        say(f"trust policy: only {', '.join(settings.trusted_peers)} may serve the first and the last block")
    cfg = GatewayConfig(
        settings, model_id=args.model_id, dht_prefix=swarm.prefix, client_options=client_options(args, settings)
    )
    with serving_gateway(cfg, dht=swarm.dht, log_level="warning") as (server, _backend):
        served_name = public_model_id(args.model_id or args.model)  # the name /v1/models and every answer show
        say(f"gateway ready; OpenAI base URL: {server.base_url}  (model: {served_name!r})")
        if adapters:
            say("LoRA adapters, each a model: " + ", ".join(f"{served_name}:{name}" for name in adapters))
        say(f"chat page: {server.url}/chat  (swarm status: {server.url}/swarm)")
        say("try:")
        print(f"  {curl_example(server.base_url, served_name)}", flush=True)
        print(f"  {status_example(swarm.initial_peers, args.model)}", flush=True)
        say("Ctrl-C to stop")
        code = _watch(swarm, stop)
        say("shutting down")
    return code


def _watch(swarm, stop) -> int:
    """Until Ctrl-C (0) or a worker dies (1, with its last lines)."""
    while not stop.wait(0.5):
        dead = [w for w in swarm.workers if not w.alive]
        if dead:
            time.sleep(0.2)  # let the reader thread take the last lines
            say(f"error: {dead[0].name} {dead[0].how_it_ended()}; its last lines:\n{dead[0].tail()}")
            return 1
    return 0
