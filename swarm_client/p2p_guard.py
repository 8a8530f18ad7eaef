"""Keeps hivemind's unary calls alive: a guarded reader for the p2p daemon's persistent connection.

hivemind 1.1.12 (``p2p_daemon_bindings.control.ControlClient``) reads every unary answer (``rpc_info``: our
pings, ``rpc_push``, DHT calls) on one persistent connection, in one task that resolves the caller's future
with ``set_result``. A call cancelled from outside (``task.cancel()`` from a task step: a liveness probe
dropped because its step answered) has its future cancelled one loop iteration later by the outer
``wait_for``; when the answer is read in that same iteration — likely on a saturated loop, where a step's
answer and its ping's land together — ``set_result`` raises ``InvalidStateError`` and the reader task dies
silently. From then on every unary call of that process times out while streams (``rpc_inference``, one
connection each) keep working: the gateway banned every live server "behind NAT" until it was restarted
(issue 35; ``tests/test_unary_wedge.py`` holds the race).

``install()`` replaces the reader with one that skips answers nobody waits for any more and, when the daemon
closes the connection, fails the calls in flight at once instead of leaving them to their timeouts.
``unary_reader_alive`` lets a watchdog see a dead reader (``SequenceManager`` then opens a new client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from uuid import UUID

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings import control
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError, read_pbmsg_safe
from hivemind.proto import p2pd_pb2 as p2pd_pb
from hivemind.utils.asyncio import cancel_task_if_running

__all__ = ["install", "uninstalled", "unary_reader_alive"]

logger = logging.getLogger(__name__)

_ORIGINAL = control.ControlClient._read_from_persistent_conn


def _settle(future: asyncio.Future | None, result: object = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless its caller gave up on it already (cancelled: the answer came too late)."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _guarded_read(self: control.ControlClient, reader: asyncio.StreamReader) -> None:
    """hivemind's ``_read_from_persistent_conn``, except that a late answer is dropped, not fatal, and a closed
    connection fails the calls still waiting (they would otherwise wait for their own timeouts)."""
    try:
        while True:
            resp = p2pd_pb.PersistentConnectionResponse()
            try:
                await read_pbmsg_safe(reader, resp)
            except asyncio.IncompleteReadError:
                break
            try:
                _dispatch(self, UUID(bytes=resp.callId), resp)
            except Exception:  # one malformed message must not end every later call's answers
                logger.exception("p2p daemon message could not be dispatched")
    finally:
        closed = P2PDaemonError("the p2p daemon closed the persistent connection")
        for future in list(self._pending_calls.values()):
            _settle(future, error=closed)


def _dispatch(self: control.ControlClient, call_id: UUID, resp: p2pd_pb.PersistentConnectionResponse) -> None:
    pending = self._pending_calls.get(call_id)
    if resp.HasField("callUnaryResponse"):
        answer = resp.callUnaryResponse
        if answer.HasField("response"):
            _settle(pending, answer.response)
        elif answer.HasField("error"):
            _settle(pending, error=P2PHandlerError(answer.error.decode(errors="ignore")))
    elif resp.HasField("requestHandling"):
        task = asyncio.create_task(self._handle_persistent_request(call_id, resp.requestHandling))
        self._handler_tasks[call_id] = task
    elif call_id in self._handler_tasks and resp.HasField("cancel"):
        cancel_task_if_running(self._handler_tasks[call_id])
    elif resp.HasField("daemonError"):
        _settle(pending, error=P2PDaemonError(resp.daemonError.message))
    else:
        _settle(pending, None)


def install() -> None:
    """Use the guarded reader in every ``ControlClient`` opened from now on (idempotent)."""
    control.ControlClient._read_from_persistent_conn = _guarded_read


@contextlib.contextmanager
def uninstalled() -> Iterator[None]:
    """hivemind's own reader for a while (the test that shows why the guard exists)."""
    control.ControlClient._read_from_persistent_conn = _ORIGINAL
    try:
        yield
    finally:
        install()


def unary_reader_alive(p2p: P2P) -> bool:
    """Whether ``p2p``'s unary answers are still read (False: every unary call would time out)."""
    client = getattr(p2p, "_client", None)
    ctl = getattr(client, "control", None)
    task = getattr(ctl, "_read_task", None)
    return task is not None and not task.done()
