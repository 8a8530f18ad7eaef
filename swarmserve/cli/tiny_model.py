"""``swarmserve tiny-model OUT``: a small random-weight model with a real tokenizer (swarm_client.tiny_model)."""

from __future__ import annotations

import argparse

from swarmserve.cli.common import subcommand


def add_parser(sub: argparse._SubParsersAction) -> None:
    # its own parser takes every argument after the subcommand (swarmserve tiny-model --help shows them)
    p = subcommand(sub, "tiny-model", "write a small random-weight model with a real tokenizer", add_help=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, rest: list[str]) -> int:
    from swarm_client.tiny_model import main as tiny_main

    return tiny_main(rest)
