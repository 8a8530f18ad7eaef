"""``swarmserve worker``: serve a span of transformer blocks to the swarm (``worker.run.run_worker``).

Imports only the library and the block server: a volunteer's install needs no web stack."""

from __future__ import annotations

import argparse
import os

from swarmserve.cli.common import add_listen_flags, blocks_arg, cache_tokens_arg, subcommand
from swarmserve.cli.dht import add_announce_flags, announced_maddrs

DTYPES = ["auto", "float32", "bfloat16", "float16"]
#: swarm_client.kernels.cpu_kernels.CPU_KERNELS, repeated so ``--help`` does not import torch (a test keeps them equal)
CPU_KERNELS = ["auto", "panels", "onednn", "torch"]
#: worker.quant.QUANT_CHOICES (repeated likewise; tests/test_quant.py keeps them equal)
QUANT_CHOICES = ["none", "int8", "nf4", "auto"]
FAULTS = "nan, hang, wrong-shape, noise, push-noise, slow"
#: protocol.MAX_STEP_TOKENS, message_cap.DEFAULT_MAX_MESSAGE_BYTES, uploads.DEFAULT_UPLOAD_BUDGET (repeated for the
#: same reason; tests/test_worker_hostile_units.py keeps them equal)
MAX_STEP_TOKENS = 1024
MAX_MESSAGE_BYTES = 64 * 2**20
MAX_UPLOAD_BYTES = 1024 * 2**20


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "worker", "serve a span of transformer blocks to the swarm")
    p.add_argument("--model", required=True, help="local path or 🤗 id")
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddr(s) of DHT peers")
    span = p.add_mutually_exclusive_group()
    span.add_argument("--blocks", type=blocks_arg, help="serve exactly blocks START:END")
    span.add_argument("--num-blocks", type=int, help="serve N blocks where the swarm is weakest")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="weights' dtype (auto: the checkpoint's)")
    p.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=CPU_KERNELS,
        help="on a float32 CPU server: our panel kernel for small batches (auto: where it builds, else oneDNN), "
        "oneDNN-packed projections, or plain torch",
    )
    p.add_argument(
        "--quant",
        default="none",
        choices=QUANT_CHOICES,
        help="weight-only quantization of the projections: int8 (per-channel scales) or nf4 (bitsandbytes' "
        "4-bit NormalFloat); CPU: our kernels, CUDA: bitsandbytes; auto: the most precise that fits the memory",
    )
    p.add_argument(
        "--adapters",
        nargs="+",
        default=os.environ.get("SWARMSERVE_ADAPTERS", "").split(),
        metavar="NAME=PATH",
        help="serve these PEFT LoRA adapters (directories or Hub ids) beside the base blocks; clients choose "
        "one per session (active_adapter), the gateway lists each as the model BASE:NAME "
        "(default: $SWARMSERVE_ADAPTERS, space-separated)",
    )
    p.add_argument(
        "--cache-tokens",
        type=cache_tokens_arg,
        default=None,
        metavar="N|auto",
        help="KV-cache budget in token slots; auto (default): what 80%% of the GPU's free memory (25%% of the "
        "RAM available on a CPU) holds after the weights, at most 8 context windows of the model",
    )
    p.add_argument("--session-ttl", type=float, default=300.0, help="keep a finished session's cache this long (s)")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="close a stream idle for this long (s)")
    p.add_argument("--max-sessions", type=int, default=4096, help="sessions of all peers together")
    p.add_argument(
        "--max-sessions-per-peer",
        type=int,
        default=1024,
        help="open sessions of one client peer (a gateway replica is one peer for all its users; "
        "past this it routes to other servers)",
    )
    p.add_argument(
        "--peer-cache-share",
        type=float,
        default=0.25,
        help="share of the cache one caller (its IP; its peer id on loopback) is sure of: beyond it, its idle "
        "sessions are evicted when the cache is full and a caller within its share needs room (1: never)",
    )
    p.add_argument(
        "--evict-idle-after",
        type=float,
        default=2.0,
        help="a session idle this long may be evicted for another caller's room (only beyond its share)",
    )
    p.add_argument(
        "--pressure-idle-timeout",
        type=float,
        default=30.0,
        help="close a stream idle this long while less than 10%% of the cache is free (s)",
    )
    p.add_argument(
        "--max-tensor-bytes", type=int, default=256 * 2**20, help="reject larger tensors before decoding them"
    )
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=MAX_STEP_TOKENS,
        help="tokens (batch x length) one inference step may carry",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        help="drop a stream whose next message announces more bytes than this, before reading it",
    )
    p.add_argument(
        "--max-upload-bytes",
        type=int,
        default=MAX_UPLOAD_BYTES,
        help="bytes of forward/backward uploads held at once; past this requests are answered busy",
    )
    add_listen_flags(p, "the server's libp2p transport", 0)
    add_announce_flags(p)
    p.add_argument(
        "--no-reachability-check",
        action="store_true",
        help="go ONLINE without asking peers to dial this server back first (a private swarm on one LAN); "
        "by default a server nobody can reach exits with what to fix instead of going ONLINE",
    )
    p.add_argument(
        "--relay",
        default="auto",
        choices=["auto", "off"],
        help="auto: if no peer can dial this server, serve through a public initial peer as a libp2p relay "
        "(checked before going ONLINE); off: exit with what to fix instead",
    )
    p.add_argument("--dht-prefix", default=None, help="DHT namespace (default: the model's basename)")
    p.add_argument("--update-period", type=float, default=5.0, help="seconds between DHT announcements")
    p.add_argument("--throughput", type=float, default=None, help="announce this tok/s instead of measuring")
    p.add_argument("--torch-threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    p.add_argument("--public-name", default=None, help="a name shown in `swarmserve status` and /swarm")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
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
        help=f"testing only: misbehave after AFTER inference steps (KIND: {FAULTS})",
    )
    p.set_defaults(func=run, exit_now=True)


def run(args: argparse.Namespace, rest: list[str]) -> int:
    import torch

    from swarm_client.config import parse_initial_peers
    from swarm_client.lora import parse_adapter_specs
    from worker.config import WorkerConfig
    from worker.run import run_worker

    if args.public_ip == "":  # docker-compose.yml passes --public-ip=$PUBLIC_IP: unset there, empty here
        raise SystemExit(
            "swarmserve worker: PUBLIC_IP is not set (--public-ip is empty). Set PUBLIC_IP to the address other "
            "machines reach this one at (its public IP, or the router's with TCP WORKER_PORT forwarded here): "
            "without it the worker would announce its container's private address, which nobody can dial. "
            "See docs/joining.md."
        )
    try:  # fail before loading anything: a wrong address would announce a server nobody reaches
        announced_maddrs(args.public_ip, args.port, args.announce_maddrs)
        adapters = parse_adapter_specs(args.adapters)
    except ValueError as exc:
        raise SystemExit(f"swarmserve worker: {exc}") from None
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    run_worker(
        WorkerConfig(
            model=args.model,
            initial_peers=parse_initial_peers(args.initial_peers),
            blocks=args.blocks,
            num_blocks=args.num_blocks,
            device=args.device,
            dtype=args.dtype,
            cpu_kernels=args.cpu_kernels,
            quant=args.quant,
            adapters=adapters,
            cache_tokens=args.cache_tokens,
            session_ttl=args.session_ttl,
            idle_timeout=args.idle_timeout,
            max_sessions=args.max_sessions,
            max_sessions_per_peer=args.max_sessions_per_peer,
            peer_cache_share=args.peer_cache_share,
            evict_idle_after=args.evict_idle_after,
            pressure_idle_timeout=args.pressure_idle_timeout,
            max_tensor_bytes=args.max_tensor_bytes,
            max_step_tokens=args.max_step_tokens,
            max_message_bytes=args.max_message_bytes,
            max_upload_bytes=args.max_upload_bytes,
            host=args.host,
            port=args.port,
            public_ip=args.public_ip,
            announce_maddrs=args.announce_maddrs,
            dht_prefix=args.dht_prefix,
            update_period=args.update_period,
            throughput=args.throughput,
            public_name=args.public_name,
            balance_quality=args.balance_quality,
            rebalance_period=args.rebalance_period,
            fault=args.fault,
            metrics_port=args.metrics_port,
            reachability_check=not args.no_reachability_check,
            relay=args.relay,
        )
    )
    return 0
