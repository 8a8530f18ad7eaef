"""The ``swarmserve`` command: one module per subcommand group, each adding its parser and handler.

* ``tiny-model`` (cli/tiny_model.py), ``dht`` (cli/dht.py), ``worker`` (cli/worker.py): need only the
  library and the block server — a worker install has no web stack;
* ``gateway``, ``up`` (cli/gateway.py, cli/up.py) and ``status`` (cli/status.py).

Subcommands import their heavy modules lazily so ``swarmserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

from swarmserve import __version__
from swarmserve.cli import dht, gateway, status, tiny_model, up, worker
from swarmserve.cli.common import exit_now

__all__ = ["build_parser", "main"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (any case), got {text!r}")
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmserve", description="OpenAI-compatible LLM serving over a swarm")
    parser.add_argument("--version", action="version", version=f"swarmserve {__version__}")
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="INFO",
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="logging threshold of this process (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (tiny_model, dht, worker, gateway, up, status):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "tiny-model" in argv[:1]:  # its own parser (swarm_client.tiny_model) takes the rest
        args, rest = parser.parse_args(argv[:1]), argv[1:]
    else:
        args, rest = parser.parse_args(argv), []
    logging.basicConfig(
        level=getattr(logging, args.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt=getattr(args, "log_datefmt", None),  # `up`: HH:MM:SS, as its own lines
        stream=sys.stderr,
    )
    code = int(args.func(args, rest) or 0)
    if getattr(args, "exit_now", False):
        exit_now(code)
    return code
