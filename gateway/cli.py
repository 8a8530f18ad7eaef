"""The ``swarmserve`` command: tiny-model, dht, worker, gateway, up, status.

Subcommands import their modules lazily so ``swarmserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _parse_blocks(value: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in value.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--blocks expects START:END (e.g. 0:4), got {value!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"--blocks {value}: need 0 <= START < END")
    return start, end


def _add_dht(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dht", help="run a bootstrap DHT node and print its multiaddr")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--model", default=None, help="check records of this model's blocks (its DHT prefix)")
    p.add_argument("--dht-prefix", default=None, help="check records under this prefix")
    p.add_argument("--identity-path", default=None, help="peer id key file (made if missing)")
    p.set_defaults(func=_cmd_dht)


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve a span of transformer blocks to the swarm")
    p.add_argument("--model", required=True, help="local path or 🤗 id")
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddr(s) of DHT peers")
    span = p.add_mutually_exclusive_group()
    span.add_argument("--blocks", type=_parse_blocks, help="serve exactly blocks START:END")
    span.add_argument("--num-blocks", type=int, help="serve N blocks where the swarm is weakest")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=["auto", "panels", "onednn", "torch"],  # worker.cpu_kernels.CPU_KERNELS (no torch import here)
        help="on a float32 CPU server: our panel kernel for small batches (auto: where it builds, else oneDNN), "
        "oneDNN-packed projections, or plain torch",
    )
    p.add_argument("--cache-tokens", type=int, default=16384, help="KV-cache budget in token slots")
    p.add_argument(
        "--session-ttl", type=float, default=300.0, help="keep a finished session's cache this long (s)"
    )
    p.add_argument("--idle-timeout", type=float, default=300.0, help="close a stream idle for this long (s)")
    p.add_argument("--max-sessions", type=int, default=4096, help="sessions of all peers together")
    p.add_argument("--max-sessions-per-peer", type=int, default=256, help="open sessions of one client peer")
    p.add_argument(
        "--max-tensor-bytes", type=int, default=256 * 2**20, help="reject larger tensors before decoding them"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dht-prefix", default=None, help="DHT namespace (default: the model's basename)")
    p.add_argument("--update-period", type=float, default=5.0, help="seconds between DHT announcements")
    p.add_argument("--throughput", type=float, default=None, help="announce this tok/s instead of measuring")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--public-name", default=None)
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)"
    )
    p.add_argument(
        "--balance-quality",
        type=float,
        default=0.75,
        help="with --num-blocks: move only if the swarm's weakest block gets 1/Q times stronger (0 < Q <= 1)",
    )
    p.add_argument(
        "--rebalance-period",
        type=float,
        default=60.0,
        help="with --num-blocks: seconds between checks whether to move to weaker blocks (0: never move)",
    )
    p.add_argument(
        "--fault",
        default=None,
        metavar="KIND[:AFTER]",
        help="testing only: misbehave after AFTER inference steps (KIND: nan, hang, wrong-shape, noise)",
    )
    p.set_defaults(func=_cmd_worker)


def _add_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tiny-model", help="write a small random-weight model with a real tokenizer", add_help=False
    )
    p.set_defaults(func=_cmd_tiny_model)


def _cmd_tiny_model(args: argparse.Namespace, rest: list[str]) -> int:
    from swarm_client.tiny_model import main as tiny_main

    return tiny_main(rest)


def _cmd_dht(args: argparse.Namespace, rest: list[str]) -> int:
    import signal
    import threading

    from hivemind.dht import DHT

    from swarm_client.config import default_dht_prefix, parse_initial_peers
    from swarm_client.dht_records import record_validators

    prefix = args.dht_prefix or (default_dht_prefix(args.model) if args.model else None)
    identity = {"identity_path": args.identity_path} if args.identity_path else {}
    dht = DHT(
        initial_peers=parse_initial_peers(args.initial_peers),
        host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
        start=True,
        record_validators=record_validators(prefix),  # signatures always; the schema once we know the keys
        **identity,
    )
    for maddr in dht.get_visible_maddrs():
        print(f"initial_peers: {maddr}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    dht.shutdown()
    return 0


def _cmd_worker(args: argparse.Namespace, rest: list[str]) -> int:
    import torch

    from swarm_client.config import parse_initial_peers
    from worker.server import WorkerConfig, run_worker

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    cfg = WorkerConfig(
        model=args.model,
        initial_peers=parse_initial_peers(args.initial_peers),
        blocks=args.blocks,
        num_blocks=args.num_blocks,
        device=args.device,
        dtype=args.dtype,
        cpu_kernels=args.cpu_kernels,
        cache_tokens=args.cache_tokens,
        session_ttl=args.session_ttl,
        idle_timeout=args.idle_timeout,
        max_sessions=args.max_sessions,
        max_sessions_per_peer=args.max_sessions_per_peer,
        max_tensor_bytes=args.max_tensor_bytes,
        host=args.host,
        port=args.port,
        dht_prefix=args.dht_prefix,
        update_period=args.update_period,
        throughput=args.throughput,
        public_name=args.public_name,
        balance_quality=args.balance_quality,
        rebalance_period=args.rebalance_period,
        fault=args.fault,
        metrics_port=args.metrics_port,
    )
    run_worker(cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmserve", description="OpenAI-compatible LLM serving over a swarm"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tiny_model(sub)
    _add_dht(sub)
    _add_worker(sub)
    try:
        from gateway.cli_gateway import add_gateway_commands
    except ImportError:  # pragma: no cover - only while the gateway package is being built
        pass
    else:
        add_gateway_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "tiny-model":
        args, rest = parser.parse_known_args(argv[:1]), argv[1:]
        args = args[0]
    else:
        args, rest = parser.parse_args(argv), []
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.func(args, rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
