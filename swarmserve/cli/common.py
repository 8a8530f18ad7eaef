"""Helpers shared by the subcommands: argument types, a help formatter that shows defaults, signals."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

__all__ = [
    "DEFAULT_MODEL",
    "HelpFormatter",
    "add_listen_flags",
    "blocks_arg",
    "exit_now",
    "interruptible",
    "port_arg",
    "require_gateway_extra",
    "stop_on_signals",
    "subcommand",
    "swarmserve_command",
]

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` lists each flag's default (where it has one worth showing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def subcommand(sub: argparse._SubParsersAction, name: str, help: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter, **kw)


def blocks_arg(value: str) -> tuple[int, int]:
    """``--blocks START:END``."""
    try:
        start, end = (int(x) for x in value.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--blocks expects START:END (e.g. 0:4), got {value!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"--blocks {value}: need 0 <= START < END")
    return start, end


def port_arg(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535")
    return port


def add_listen_flags(p: argparse.ArgumentParser, what: str, port: int) -> None:
    """``--host`` / ``--port`` of whatever this command listens with."""
    p.add_argument("--host", default="127.0.0.1", help=f"address {what} binds to (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_arg, default=port, help=f"port {what} listens on (0: any free port)")


def require_gateway_extra(command: str) -> None:
    """Exit with what to install when the web stack (the ``gateway`` extra) is missing: a worker-only
    install runs ``swarmserve worker`` but not ``gateway`` / ``up``."""
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"swarmserve {command} needs the gateway's web stack ({exc.name} is missing): "
            "pip install 'swarmserve[gateway]' (or 'swarmserve[all]')"
        ) from None


@contextmanager
def stop_on_signals(on_repeat: Callable[[], None] | None = None) -> Iterator[threading.Event]:
    """An event set by SIGINT / SIGTERM while inside; ``on_repeat`` runs on every signal after the first
    (a second Ctrl-C: no more patience). The previous handlers come back on exit."""
    stop = threading.Event()

    def handle(_signum: int, _frame: object) -> None:
        if stop.is_set() and on_repeat is not None:
            on_repeat()
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def interruptible(stop: threading.Event) -> Iterator[None]:
    """Inside, SIGINT / SIGTERM raise ``KeyboardInterrupt`` at once (and set ``stop``): for a long step in
    this thread that polls nothing, such as a first run's model conversion (a minute; its ``finally``
    removes its half-written files). ``stop_on_signals``' handlers come back on exit."""

    def handle(_signum: int, _frame: object) -> None:
        stop.set()
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_now(code: int) -> NoReturn:
    """End a long-running command (``worker``, ``up``) once its own clean-up is done, skipping the
    interpreter's teardown: a full garbage collection of torch's and transformers' heap, torch's operator
    finalizers and joins of executor threads that may still be inside a torch call took 1-8 s on a busy
    2-core machine, and none of it matters to a process whose sockets, DHT and children are already shut."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def swarmserve_command() -> str:
    """``swarmserve`` as a shell command that works when pasted anywhere: the console script beside this
    interpreter (a virtual environment's ``bin/``, which a new shell does not have on its PATH), else this
    interpreter with ``-m swarmserve``; absolute either way."""
    script = Path(sys.executable).parent / "swarmserve"  # not resolved: a venv's python is a symlink
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(str(Path(sys.executable).absolute()))} -m swarmserve"


def cache_tokens_arg(text: str) -> int | None:
    """``--cache-tokens``: a positive number of token slots, or ``auto`` (None: sized from free memory)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of token slots or 'auto', not {text!r}")
    return value
