"""One background asyncio loop per process that owns all of the client's network I/O.

🤗 models are synchronous; hivemind is asyncio. Sync code submits coroutines here with ``run``;
async code (an HTTP server, say) can ``await`` them through ``arun`` without blocking its own loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


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
