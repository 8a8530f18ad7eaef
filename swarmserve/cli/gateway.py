"""``swarmserve gateway``: the OpenAI-compatible server over an existing swarm (``gateway.run``), and the
client and limit flags it shares with ``swarmserve up``."""

from __future__ import annotations

import argparse
from typing import Any

from swarm_client.precision import MIN_PRECISIONS
from swarmserve.cli.common import add_listen_flags, blocks_arg, require_gateway_extra, stop_on_signals, subcommand


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "gateway", "serve the OpenAI-compatible API over an existing swarm")
    p.add_argument("--model", required=True, help="local path or 🤗 id of the model the swarm serves")
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddr(s) of DHT peers")
    p.add_argument("--dht-prefix", default=None, help="DHT namespace (default: the model's basename)")
    p.add_argument(
        "--served-model-name",
        "--model-id",
        dest="model_id",
        default=None,
        help="the model name clients send and /v1/models shows, as vLLM's flag (default: --model, or its "
        "directory's name when --model is a path)",
    )
    p.add_argument(
        "--adapter-alias",
        nargs="+",
        default=None,
        metavar="NAME=ALIAS",
        help="another model name for a served LoRA adapter: requests for model ALIAS run adapter NAME (MODEL_ID:NAME "
        "always does; also: SWARMSERVE_ADAPTER_ALIASES)",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="affinity store, rate-limit counters and stored /v1/responses, shared by replicas (default: memory)",
    )
    p.add_argument(
        "--replica-id",
        default=None,
        metavar="NAME",
        help="this replica's name: the x-swarm-replica header of every answer and the writer of its affinity "
        "records (also: SWARMSERVE_REPLICA_ID; default: host, pid and a random suffix)",
    )
    add_listen_flags(p, "the HTTP API", 8000)
    add_client_flags(p)
    p.add_argument(
        "--local-blocks",
        type=local_blocks_arg,
        default=None,
        metavar="START:END",
        help="run blocks START:END in the gateway itself (e.g. on its GPU), a zero-latency hop of every route; "
        "the swarm serves the rest (default: none)",
    )
    p.add_argument("--device", default="cpu", help="device of the --local-blocks: cpu, cuda or cuda:N")
    add_speculation_flags(p)
    add_limit_flags(p)
    p.set_defaults(func=run)


def local_blocks_arg(text: str) -> tuple[int, int]:
    """``--local-blocks START:END`` (checked against the model's block count when it loads)."""
    try:
        return blocks_arg(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--blocks", "--local-blocks")) from None


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


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """How the gateway's client drives the swarm."""
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
    p.add_argument(
        "--push",
        choices=("auto", "on", "off"),
        default="auto",
        help="server-to-server push: each server sends its output straight on to the next (default auto: where "
        "the measured RTT to a later server of the chain is 5 ms or more; the x-swarm-push header says which)",
    )
    p.add_argument(
        "--min-precision",
        choices=MIN_PRECISIONS,
        default="any",
        help="the least precise server weights a route may use: full (no quantized server), int8, nf4, or any "
        "(default); servers announce theirs (swarmserve worker --quant)",
    )
    p.add_argument(
        "--trusted-peers",
        default=None,
        metavar="PEER,PEER",
        help="trust policy: comma-separated peer ids of the only servers allowed to run the model's first and "
        "last block, which see the activations closest to the text (also: SWARMSERVE_TRUSTED_PEERS; "
        "default: any server)",
    )


def trust_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``GatewaySettings`` trust-policy field, where the flag is given (else the env / default)."""
    return {} if args.trusted_peers is None else {"trusted_peers": args.trusted_peers}


def client_options(args: argparse.Namespace, settings: Any = None) -> dict[str, Any]:
    """``ClientConfig`` options from the flags, and the trust policy of ``settings`` (flag, env or default)."""
    push = {"auto": "auto", "on": True, "off": False}[getattr(args, "push", "auto")]
    options = {"pipeline_groups": args.pipeline_groups, "step_bundles": args.step_bundles, "push": push}
    if getattr(args, "min_precision", "any") != "any":
        options["min_precision"] = args.min_precision
    if getattr(args, "local_blocks", None) is not None:  # ``swarmserve gateway`` only; not ClientConfig options
        options.update(local_blocks=args.local_blocks, device=args.device)
    if settings is not None and settings.trusted_peers:
        options["trusted_peers"] = list(settings.trusted_peers)
    return options


def add_speculation_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding at the head (gateway/speculation/verify.py); unset flags leave the env / defaults."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculation",
        choices=("auto", "off", "prompt-lookup", "draft-model"),
        default=None,
        help="guess several tokens and check them in one trip along the chain, exactly (the same tokens as "
        "without): auto (default) uses --draft-model when given, else prompt lookup, and guesses only while "
        "it pays; off: only requests that ask (their 'speculation' field)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="a small local 🤗 causal LM with the served model's tokenizer that drafts; the served model's own "
        "path with --draft-layers N is self-speculation (its first N layers + its head)",
    )
    g.add_argument("--draft-layers", type=int, default=None, metavar="N", help="keep the draft model's first N layers")
    g.add_argument(
        "--draft-quant",
        choices=("none", "int8", "nf4"),
        default=None,
        help="quantize the draft model's projections (CPU; the workers' kernels): a cheaper draft, the same "
        "output (guesses are checked); int8 kept 95-100%% of SmolLM2's own guesses at 0.6x its time per token",
    )
    g.add_argument(
        "--max-draft-tokens", type=int, default=None, metavar="K", help="most guesses per step, 1-16 (default 8)"
    )


def speculation_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``GatewaySettings`` speculation fields of the flags given on the command line."""
    fields = {
        "speculation": None if args.speculation is None else args.speculation.replace("-", "_"),
        "draft_model": args.draft_model,
        "draft_layers": args.draft_layers,
        "draft_quant": args.draft_quant,
        "max_draft_tokens": args.max_draft_tokens,
    }
    return {k: v for k, v in fields.items() if v is not None}


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Access control and limits of the gateway; unset flags leave the ``SWARMSERVE_*`` env / defaults."""
    g = p.add_argument_group("access control and limits")
    g.add_argument(
        "--api-keys-file", default=None, help="API keys, one per line, # comments (also: SWARMSERVE_API_KEYS)"
    )
    g.add_argument("--rate-limit-rpm", type=int, default=None, help="requests per minute per key (0: none)")
    g.add_argument("--rate-limit-tpm", type=int, default=None, help="tokens (prompt + max_tokens) per minute per key")
    g.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (413 above)")
    g.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=None,
        help="choices decoding at once, streamed or not; n=16 takes 16 (default: 8 per CPU core, at most "
        "backend threads, at least max choices; 0: no limit)",
    )
    g.add_argument("--max-queued", type=int, default=None, help="streams waiting for a slot (503 beyond)")


def limit_settings(args: argparse.Namespace) -> dict[str, Any]:
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


def run(args: argparse.Namespace, rest: list[str]) -> int:
    require_gateway_extra("gateway")
    from gateway.run import GatewayConfig, run_gateway
    from gateway.settings import GatewaySettings
    from swarm_client.config import parse_initial_peers

    settings = GatewaySettings(
        model=args.model,
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        initial_peers=parse_initial_peers(args.initial_peers),
        **limit_settings(args),
        **trust_settings(args),
        **speculation_settings(args),
        **({"adapter_aliases": args.adapter_alias} if args.adapter_alias else {}),
        **({"replica_id": args.replica_id} if args.replica_id else {}),
    )
    cfg = GatewayConfig(
        settings, model_id=args.model_id, dht_prefix=args.dht_prefix, client_options=client_options(args, settings)
    )
    with stop_on_signals() as stop:
        return run_gateway(cfg, stop)
