"""The gateway's subcommands of ``swarmserve`` (``gateway/cli.py`` calls ``add_gateway_commands``):

* ``gateway`` — the OpenAI-compatible server over an existing swarm (``SwarmBackend``);
* ``up`` — the embedded default: a DHT in this process, N worker child processes splitting the model's
  blocks evenly, and the gateway, with one command; Ctrl-C / SIGTERM stops all of it;
* ``status`` — a table of blocks × servers read from the DHT; exit code 1 when some block has no server.

Shutdown order matters: the gateway stops first (no new sessions), then the client closes its sessions
(servers free their caches), then the workers drain (SIGTERM → announce OFFLINE → exit, killed after a
grace period, together with their process group so no p2pd daemon outlives them), the DHT last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WORKER_READY = "swarmserve worker ready:"
UP_PREFIX = "swarmserve up:"
#: the last line Python prints for an uncaught exception: ``FileNotFoundError: no model.safetensors…``
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)")

__all__ = [
    "WorkerProcess",
    "add_gateway_commands",
    "render_status",
    "split_blocks",
]


# ---------------------------------------------------------------------------------------------- parsers
def add_gateway_commands(sub: argparse._SubParsersAction) -> None:
    _add_gateway(sub)
    _add_up(sub)
    _add_status(sub)


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="serve the OpenAI-compatible API over an existing swarm")
    p.add_argument("--model", required=True, help="local path or 🤗 id of the model the swarm serves")
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddr(s) of DHT peers")
    p.add_argument("--dht-prefix", default=None, help="DHT namespace (default: the model's basename)")
    p.add_argument("--model-id", default=None, help="the name clients use (default: --model)")
    p.add_argument(
        "--redis-url", default=None, help="session-affinity store and rate-limit counters (default: memory)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_pipeline_flags(p)
    _add_limit_flags(p)
    p.set_defaults(func=_cmd_gateway)


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="DHT + N block servers + gateway on this machine, with one command")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"local path or 🤗 id (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--workers", type=int, default=2, help="block servers; the model's blocks are split evenly"
    )
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=int, default=8000, help="gateway port (0: any free port)")
    p.add_argument("--device", default="cpu", help="workers' device: cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--cache-tokens", type=int, default=16384, help="KV-cache budget of each worker (tokens)")
    p.add_argument(
        "--torch-threads", type=int, default=None, help="threads per worker (default: CPU cores / workers)"
    )
    p.add_argument(
        "--throughput", type=float, default=None, help="workers announce this tok/s instead of measuring"
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the workers")
    p.add_argument("--grace", type=float, default=15.0, help="seconds a worker may drain before it is killed")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the workers' logs")
    _add_pipeline_flags(p)
    _add_limit_flags(p)
    p.set_defaults(func=_cmd_up)


def pipeline_groups_arg(text: str) -> int | str:
    """``--pipeline-groups``: "auto" or a number of groups in [1, MAX_PIPELINE_GROUPS]."""
    from swarm_client.protocol import MAX_PIPELINE_GROUPS
    from swarm_client.sequence_manager import AUTO_GROUPS, check_pipeline_groups

    try:
        return check_pipeline_groups(text if text == AUTO_GROUPS else int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a number in [1, {MAX_PIPELINE_GROUPS}], got {text!r}"
        ) from exc


def _add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pipeline-groups",
        type=pipeline_groups_arg,
        default="auto",
        metavar="auto|N",
        help="deal sessions into groups that servers batch apart, so consecutive servers of a chain compute "
        "at the same time (default auto: as many groups as a session's route has servers; 1: off)",
    )
    p.add_argument(
        "--step-bundles",
        action="store_true",
        help="send the steps of all sessions bound for one server as one message per hop, where the server "
        "supports it (measured neutral to +30 %% on one machine; default: one stream per session)",
    )


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Access control and limits of the gateway; unset flags leave the ``SWARMSERVE_*`` env / defaults."""
    g = p.add_argument_group("access control and limits")
    g.add_argument(
        "--api-keys-file", default=None, help="API keys, one per line, # comments (also: SWARMSERVE_API_KEYS)"
    )
    g.add_argument("--rate-limit-rpm", type=int, default=None, help="requests per minute per key (0: none)")
    g.add_argument(
        "--rate-limit-tpm", type=int, default=None, help="tokens (prompt + max_tokens) per minute per key"
    )
    g.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (413 above)")
    g.add_argument(
        "--max-concurrent-streams", type=int, default=None, help="streaming requests at once (0: no limit)"
    )
    g.add_argument("--max-queued", type=int, default=None, help="streams waiting for a slot (503 beyond)")


def _limit_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``GatewaySettings`` fields of the flags given on the command line."""
    fields = {
        "api_keys_file": args.api_keys_file,
        "rate_limit_rpm": args.rate_limit_rpm,
        "rate_limit_tpm": args.rate_limit_tpm,
        "max_body_bytes": args.max_body_bytes,
        "max_concurrent_streams": args.max_concurrent_streams,
        "max_queued_streams": args.max_queued,
    }
    return {k: v for k, v in fields.items() if v is not None}


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="blocks × servers of a swarm; exit code 1 when a block is not served")
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddr(s) of DHT peers")
    p.add_argument("--model", default=None, help="local path or 🤗 id: gives the block count and DHT prefix")
    p.add_argument("--dht-prefix", default=None, help="DHT namespace (default: the model's basename)")
    p.add_argument("--num-blocks", type=int, default=None, help="the model's block count (without --model)")
    p.add_argument("--json", action="store_true", help="print the swarm state as JSON")
    p.set_defaults(func=_cmd_status)


# ---------------------------------------------------------------------------------------------- helpers
def split_blocks(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    """``[0, num_blocks)`` in ``parts`` contiguous spans whose sizes differ by at most one (earlier ones
    larger): 30 blocks, 4 parts → 0:8, 8:16, 16:23, 23:30."""
    if num_blocks < 1 or parts < 1:
        raise ValueError(f"cannot split {num_blocks} blocks into {parts} parts")
    parts = min(parts, num_blocks)
    base, extra = divmod(num_blocks, parts)
    spans, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def _say(message: str) -> None:
    print(f"{UP_PREFIX} {message}", flush=True)


def _short(peer_id: str, keep: int = 8) -> str:
    return peer_id if len(peer_id) <= 2 * keep + 1 else f"{peer_id[:keep]}…{peer_id[-keep:]}"


def _quiet_http_logs() -> None:
    """httpx logs every request at INFO: the server's own /health probe would show up in the output."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def _port_in_use(host: str, port: int) -> str | None:
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


def _child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _installed_signal_handlers(on_signal: Callable[[int], None]) -> dict[int, Any]:
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda signum, _frame: on_signal(signum))
    return previous


def _restore_signal_handlers(previous: Mapping[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def curl_example(base_url: str, model: str) -> str:
    """A ready-to-paste streaming chat request."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a haiku about a swarm of servers."}],
        "max_tokens": 64,
        "stream": True,
    }
    return (
        f"curl -N {base_url}/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(json.dumps(body))}"
    )


# ---------------------------------------------------------------------------------------------- workers
def _parent_death_signal() -> Callable[[], None] | None:
    """Linux: a child that gets SIGTERM when its parent dies, so even ``kill -9`` of ``swarmserve up``
    leaves no worker behind (its own session keeps it out of reach of the terminal's Ctrl-C)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_signal() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return set_signal


@dataclass
class WorkerProcess:
    """A ``swarmserve worker`` child in its own session (process group): a terminal's Ctrl-C reaches only
    the parent, which stops the children in order, and killing the group also takes the worker's DHT
    process and p2pd daemon. Its output is kept (the last lines) for error reports."""

    name: str
    span: tuple[int, int]
    popen: subprocess.Popen
    echo: bool = False
    lines: deque = field(default_factory=lambda: deque(maxlen=400))
    ready: threading.Event = field(default_factory=threading.Event)
    peer_id: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    last_output_at: float = field(default_factory=time.monotonic)
    saw_traceback: bool = False

    @classmethod
    def spawn(
        cls, name: str, span: tuple[int, int], args: Sequence[str], env: dict[str, str], echo: bool = False
    ):
        popen = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "worker", *args, "--blocks", f"{span[0]}:{span[1]}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
        )
        proc = cls(name, span, popen, echo)
        threading.Thread(target=proc._read, name=f"{name}-log", daemon=True).start()
        return proc

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            self.last_output_at = time.monotonic()
            self.saw_traceback |= line.startswith("Traceback (most recent call last):")
            if self.echo:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            if line.startswith(WORKER_READY) and not self.ready.is_set():
                if " as peer " in line:
                    self.peer_id = line.split(" as peer ", 1)[1].split(";", 1)[0].strip()
                self.ready.set()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def crashed(self, quiet_s: float = 10.0) -> bool:
        """Exited, or printed a traceback as its last words and went quiet: a worker whose main thread
        died can hang at exit waiting for its DHT process, so its exit code may never come. Only for
        startup: a serving worker may log a handled exception and then rightly stay quiet."""
        if not self.alive:
            return True
        if not self.saw_traceback or not self.lines:
            return False
        last = self.lines[-1]
        uncaught = bool(_EXCEPTION_LINE.match(last))
        return uncaught and time.monotonic() - self.last_output_at > quiet_s

    def tail(self, n: int = 30) -> str:
        return "\n".join(f"    {line}" for line in list(self.lines)[-n:])

    def terminate(self) -> None:
        if self.alive:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the worker's process group (it, its DHT process, its p2pd)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


def stop_workers(workers: Sequence[WorkerProcess], grace: float) -> None:
    """SIGTERM all (they drain in parallel), wait up to ``grace`` seconds, then kill each process group."""
    for w in workers:
        w.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _say(f"{w.name} did not stop within {grace:.0f}s; killing it")
    for w in workers:
        w.kill_group()


def _wait_ready(workers: Sequence[WorkerProcess], stop: threading.Event, timeout: float) -> str | None:
    """Wait until every worker printed its ready line; None, or why not (a worker died, timeout, signal)."""
    deadline = time.monotonic() + timeout
    reported: set[str] = set()
    last_progress = time.monotonic()
    while True:
        for w in workers:
            if w.ready.is_set() and w.name not in reported:
                reported.add(w.name)
                took = time.monotonic() - w.started_at
                _say(f"{w.name} (blocks {w.span[0]}:{w.span[1]}) ready in {took:.1f}s as peer {w.peer_id}")
            elif not w.ready.is_set() and w.crashed():
                time.sleep(0.2)  # let the reader thread take the last lines
                how = "crashed" if w.alive else f"exited with code {w.popen.returncode}"
                return f"{w.name} {how} before it was ready; its last lines:\n{w.tail()}"
        if len(reported) == len(workers):
            return None
        if stop.is_set():
            return "interrupted"
        if time.monotonic() > deadline:
            waiting = [w for w in workers if not w.ready.is_set()]
            return f"workers not ready after {timeout:.0f}s: " + "; ".join(
                f"{w.name}, last lines:\n{w.tail(10)}" for w in waiting
            )
        if time.monotonic() - last_progress > 15:
            last_progress = time.monotonic()
            for w in workers:
                if not w.ready.is_set():
                    last = w.lines[-1] if w.lines else "(no output yet)"
                    _say(f"still waiting for {w.name} ({time.monotonic() - w.started_at:.0f}s): {last[:150]}")
        stop.wait(0.1)


# ---------------------------------------------------------------------------------------------- commands
def _cmd_gateway(args: argparse.Namespace, rest: list[str]) -> int:
    from gateway.app import create_app
    from gateway.server import BackgroundServer
    from gateway.settings import GatewaySettings
    from gateway.swarm_backend import SwarmBackend
    from swarm_client.config import parse_initial_peers

    _quiet_http_logs()
    peers = parse_initial_peers(args.initial_peers)
    settings = GatewaySettings(
        model=args.model,
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        initial_peers=peers,
        **_limit_settings(args),
    )
    stop = threading.Event()
    previous = _installed_signal_handlers(lambda _sig: stop.set())
    backend = SwarmBackend(
        args.model,
        peers,
        model_id=args.model_id or args.model,
        dht_prefix=args.dht_prefix,
        pipeline_groups=args.pipeline_groups,
        step_bundles=args.step_bundles,
    )
    server = None
    try:
        server = BackgroundServer(
            create_app(backend, settings), settings.host, settings.port, log_level=settings.log_level
        ).start(wait_healthy=False)
        state = backend.swarm_state()
        missing = state["missing_blocks"]
        coverage = "all blocks served" if not missing else f"blocks {missing} not served yet (/health is 503)"
        print(
            f"swarmserve gateway ready: {backend.model_id} ({backend.dht_prefix}, "
            f"{backend.num_blocks} blocks, {len(state['spans'])} servers; {coverage}); "
            f"OpenAI base URL: {server.base_url}",
            flush=True,
        )
        stop.wait()
        print("swarmserve gateway: shutting down", flush=True)
    finally:
        if server is not None:
            server.stop()
        backend.close()
        _restore_signal_handlers(previous)
    return 0


def _cmd_up(args: argparse.Namespace, rest: list[str]) -> int:
    if args.workers < 1:
        print("swarmserve up: --workers must be at least 1", file=sys.stderr)
        return 2
    # the DHT forks a process: do it before torch and transformers start threads in this one
    from hivemind.dht import DHT

    from swarm_client.config import default_dht_prefix
    from swarm_client.dht_records import mark_validated, record_validators

    # the swarm's bootstrap node: it stores the servers' records, so it checks their signatures and schema
    validators = record_validators(default_dht_prefix(args.model))
    dht = DHT(
        initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators, start=True
    )
    mark_validated(dht)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    stop = threading.Event()
    workers: list[WorkerProcess] = []

    def on_signal(signum: int) -> None:
        if stop.is_set():  # a second Ctrl-C: no more patience
            for w in workers:
                w.kill_group()
        stop.set()

    previous = _installed_signal_handlers(on_signal)
    try:
        return _run_up(args, dht, maddrs, stop, workers)
    finally:
        _restore_signal_handlers(previous)


def _run_up(
    args: argparse.Namespace, dht: Any, maddrs: list[str], stop: threading.Event, workers: list[WorkerProcess]
) -> int:
    from gateway.app import create_app
    from gateway.server import BackgroundServer
    from gateway.settings import GatewaySettings
    from gateway.swarm_backend import SwarmBackend
    from swarm_client.config import default_dht_prefix
    from swarm_client.model_source import ModelNotFoundError, resolve_model_path
    from swarm_client.sequence_manager import AUTO_GROUPS

    _quiet_http_logs()
    server = backend = None
    code = 0
    try:
        _say(f"DHT at {maddrs[0]}")
        _say(f"resolving model {args.model}")
        try:
            model_dir = resolve_model_path(args.model)
        except ModelNotFoundError as exc:
            _say(f"error: {exc}")
            return 2
        if (busy := _port_in_use(args.host, args.port)) is not None:
            _say(f"error: cannot listen on {args.host}:{args.port} ({busy}); pick another --port")
            return 2
        from transformers import AutoConfig

        num_blocks = int(AutoConfig.from_pretrained(model_dir).num_hidden_layers)
        spans = split_blocks(num_blocks, args.workers)
        prefix = default_dht_prefix(args.model)
        threads = args.torch_threads or max(1, (os.cpu_count() or 1) // len(spans))
        _say(
            f"{num_blocks} blocks from {model_dir}; {len(spans)} worker(s): "
            + ", ".join(f"{a}:{b}" for a, b in spans)
        )
        worker_args = [
            "--model", str(model_dir), "--initial-peers", *maddrs, "--dht-prefix", prefix,
            "--device", args.device, "--dtype", args.dtype, "--cache-tokens", str(args.cache_tokens),
            "--torch-threads", str(threads),
        ]  # fmt: skip
        if args.throughput is not None:
            worker_args += ["--throughput", str(args.throughput)]
        env = _child_env(threads)
        for i, span in enumerate(spans):
            w = WorkerProcess.spawn(f"worker {i + 1}/{len(spans)}", span, worker_args, env, echo=args.verbose)
            workers.append(w)
            _say(f"{w.name} (blocks {span[0]}:{span[1]}) starting, pid {w.pid}")
        failure = _wait_ready(workers, stop, args.ready_timeout)
        if failure == "interrupted":
            _say("interrupted before the swarm was ready")
            return 0
        if failure is not None:
            _say(f"error: {failure}")
            return 1

        # one pipeline group per server of a route: while one worker computes a group, the next another
        groups = args.pipeline_groups
        if groups == AUTO_GROUPS and len(spans) > 1:
            _say("sessions dealt into one pipeline group per server of their route (--pipeline-groups)")
        elif groups != AUTO_GROUPS and groups > 1:
            _say(f"sessions dealt into {groups} pipeline groups (--pipeline-groups)")
        backend = SwarmBackend(
            args.model,
            maddrs,
            model_id=args.model,
            dht_prefix=prefix,
            dht=dht,
            pipeline_groups=groups,
            step_bundles=args.step_bundles,
        )
        settings = GatewaySettings(
            model=args.model, host=args.host, port=args.port, initial_peers=maddrs, **_limit_settings(args)
        )
        app = create_app(backend, settings)
        server = BackgroundServer(app, args.host, args.port, log_level="warning").start(timeout=120)
        served_name = Path(str(args.model).rstrip("/")).name
        _say(f"gateway ready; OpenAI base URL: {server.base_url}  (model: {served_name!r})")
        _say("try:")
        print(f"  {curl_example(server.base_url, served_name)}", flush=True)
        _say("Ctrl-C to stop")

        while not stop.wait(0.5):
            dead = [w for w in workers if not w.alive]
            if dead:
                w = dead[0]
                time.sleep(0.2)
                how = "crashed" if w.alive else f"exited with code {w.popen.returncode}"
                _say(f"error: {w.name} {how}; its last lines:\n{w.tail()}")
                code = 1
                break
        _say("shutting down")
    finally:
        if server is not None:
            server.stop()
        if backend is not None:
            backend.close()
        if workers:
            stop_workers(workers, args.grace)
        dht.shutdown()
        if workers or server is not None:
            _say("stopped")
    return code


def _cmd_status(args: argparse.Namespace, rest: list[str]) -> int:
    from hivemind.dht import DHT

    from swarm_client.config import default_dht_prefix, parse_initial_peers
    from swarm_client.dht_records import fetch_block_records, spans_from_records

    if args.model is None and (args.dht_prefix is None or args.num_blocks is None):
        print("swarmserve status: give --model, or both --dht-prefix and --num-blocks", file=sys.stderr)
        return 2
    num_blocks = args.num_blocks
    if num_blocks is None:
        from swarm_client.model_source import ModelNotFoundError

        try:
            num_blocks = _num_blocks(args.model)
        except ModelNotFoundError as exc:
            print(f"swarmserve status: {exc}", file=sys.stderr)
            return 2
    prefix = args.dht_prefix or default_dht_prefix(args.model)
    dht = DHT(initial_peers=parse_initial_peers(args.initial_peers), client_mode=True, start=True)
    try:
        spans = spans_from_records(fetch_block_records(dht, prefix, num_blocks))
    finally:
        dht.shutdown()
    text, missing = render_status(prefix, num_blocks, spans, as_json=args.json)
    print(text, flush=True)
    return 1 if missing else 0


def _num_blocks(model: str) -> int:
    """The model's depth; a local directory's config.json is read directly (importing transformers
    costs seconds, which a status probe should not pay)."""
    config_file = Path(model).expanduser() / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(config.get(key), int):
                return int(config[key])
    from transformers import AutoConfig

    from swarm_client.model_source import resolve_model_path

    return int(AutoConfig.from_pretrained(resolve_model_path(model)).num_hidden_layers)


def render_status(
    prefix: str, num_blocks: int, spans: Mapping[str, Any], *, as_json: bool = False
) -> tuple[str, list]:
    """The swarm as a table (one row per server, one column per block) plus coverage; also the missing
    blocks. ``spans``: peer id → ``RemoteSpanInfo``. Pure, so it is tested without a swarm."""
    from swarm_client.dht_records import ServerState
    from swarm_client.routing import coverage, format_blocks, missing_blocks

    missing = missing_blocks(spans, num_blocks)
    per_block = coverage(spans, num_blocks)
    ordered = sorted(spans.values(), key=lambda s: (s.start, s.end, s.peer_id))
    if as_json:
        payload = {
            "dht_prefix": prefix,
            "num_blocks": num_blocks,
            "missing_blocks": missing,
            "servers": [
                {
                    "peer_id": s.peer_id,
                    "start": s.start,
                    "end": s.end,
                    "state": ServerState(s.state).name,
                    "throughput": s.server_info.throughput,
                    "cache_tokens_left": s.server_info.cache_tokens_left,
                    "public_name": s.server_info.public_name,
                }
                for s in ordered
            ],
            "blocks": per_block,
        }
        return json.dumps(payload, indent=2), missing

    lines = [f"swarm {prefix!r}: {num_blocks} blocks, {len(ordered)} server(s)"]
    header = f"{'server':<19} {'blocks':>9}  {'state':<7} {'throughput':>12} {'cache left':>10}  map"
    ruler = "".join(str(b // 10 % 10) if b % 10 == 0 else " " for b in range(num_blocks))
    lines += [header, f"{'':<65}{ruler}".rstrip()]
    lines.append(f"{'':<65}{''.join(str(b % 10) for b in range(num_blocks))}")
    for s in ordered:
        state = ServerState(s.state)
        mark = {ServerState.ONLINE: "█", ServerState.JOINING: "j"}.get(state, "x")
        row = "".join(mark if s.start <= b < s.end else "·" for b in range(num_blocks))
        name = s.server_info.public_name or _short(s.peer_id)
        lines.append(
            f"{name[:19]:<19} {f'{s.start}:{s.end}':>9}  {state.name:<7} "
            f"{s.server_info.throughput:>8.1f} t/s {s.server_info.cache_tokens_left:>10}  {row}"
        )
    counts = "".join(str(min(len(p), 9)) if p else "!" for p in per_block)
    lines.append(f"{'servers per block (ONLINE)':<65}{counts}")
    if missing:
        lines.append(f"NOT COVERED: {format_blocks(missing)} (no ONLINE server); requests will get 503")
    else:
        lines.append("fully covered: every block has an ONLINE server")
    return "\n".join(lines), missing
