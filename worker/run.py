"""The worker process around a ``BlockServer``: signals, a stop during start-up, and a teardown that does
not wait on threads it no longer needs (``run_worker``)."""

from __future__ import annotations

import asyncio
import signal

from swarm_client.dht_records import ServerState
from worker.config import WorkerConfig
from worker.server import BlockServer

__all__ = ["run_worker"]


def run_worker(cfg: WorkerConfig) -> None:
    """Serve until SIGTERM / SIGINT, then leave: announce OFFLINE, drain, shut the DHT down.

    A signal during start-up abandons it at once: minutes of loading are not worth finishing only to be
    thrown away, and whoever sent it (``swarmserve up``'s Ctrl-C) kills us after a grace period anyway. A
    start-up step already in a thread (loading, measuring) cannot be interrupted, so this returns without
    waiting for it: the caller ends the process (``swarmserve.cli.common.exit_now``)."""

    async def main() -> None:
        server = BlockServer(cfg)
        loop = asyncio.get_running_loop()
        starting = asyncio.current_task()
        assert starting is not None

        def on_signal() -> None:
            if not server.stopping and server.state is ServerState.JOINING:
                starting.cancel()  # once: a second signal must not cut the clean-up below short
            server.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            await server.run()
        except asyncio.CancelledError:
            if not server.stopping:
                raise
            print("swarmserve worker: stopped before it was ready", flush=True)
        finally:  # a worker that dies of an exception must not leave its DHT process (and p2pd) orphaned
            await server.checker.close()
            if server.dht is not None and server.dht.is_alive():
                server.dht.shutdown()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main())
    finally:
        _cancel_pending(loop)
        # unlike asyncio.run, no wait for the default executor's threads: one may be inside a start-up step
        loop.close()
        asyncio.set_event_loop(None)


def _cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks still pending (announce, balance, stream handlers) and let them unwind."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=2.0))
    loop.run_until_complete(loop.shutdown_asyncgens())
