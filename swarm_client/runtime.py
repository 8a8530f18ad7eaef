"""One background asyncio loop per process that owns all of the client's network I/O.

🤗 models are synchronous; hivemind is asyncio. Sync code submits coroutines here with ``run``;
async code (the gateway) can ``await`` them through ``arun`` without blocking its own loop.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


#: GIL switch interval of serving processes (CPython's default is 5 ms); ``SWARMSERVE_SWITCH_INTERVAL`` overrides
SERVING_SWITCH_INTERVAL = 0.0005


def tune_for_serving() -> float:
    """Shorten the GIL switch interval of a serving process (worker, gateway) and return it.

    Such a process runs an event-loop thread next to compute or engine threads. A thread that wants the GIL
    back (a message to hand on, a kernel that returned) waits up to a whole switch interval behind another
    thread's Python, and a decode step crosses threads several times. Measured with 8 streams through a
    2-worker swarm (medium model, 2 cores): 0.5 ms gave +7–9 % tokens/s over the default in three
    back-to-back pairs, and a single stream was no slower.
    """
    interval = float(os.environ.get("SWARMSERVE_SWITCH_INTERVAL", SERVING_SWITCH_INTERVAL))
    sys.setswitchinterval(interval)
    return interval


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="swarm-client-io", daemon=True)
            thread.start()
            _loop = loop
        return _loop


def on_io_loop() -> bool:
    """Whether the caller runs on the I/O loop itself (where ``run`` would deadlock)."""
    try:
        return asyncio.get_running_loop() is get_loop()
    except RuntimeError:
        return False


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the I/O loop and wait for it (from any thread but the I/O loop itself)."""
    loop = get_loop()
    if on_io_loop():
        raise RuntimeError("swarm_client.runtime.run called from the I/O loop; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


async def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` on the I/O loop from another event loop."""
    loop = get_loop()
    if asyncio.get_running_loop() is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
