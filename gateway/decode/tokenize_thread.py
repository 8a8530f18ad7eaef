"""The one thread where request text becomes tokens: chat-template rendering, prompt tokenizing, the rate
limiter's token estimates. A prompt of megabytes takes seconds to tokenize (an 8 MiB body: ~10 s on a
laptop core); on the event loop that froze every stream the gateway was sending, so handlers ``await``
it here instead (HF fast tokenizers release the GIL while they work).

The thread owns a private deep copy of the tokenizer, ``TokenizeThread.tokenizer``: HF fast tokenizers are
not safe to use from two threads at once ("Already borrowed"), and the event loop keeps the backend's own
object for what it does per token (gateway/decode/detokenize.py: streams, logprobs). Code that uses the copy runs
through ``run``; ``own()`` hands the copy out only on this thread, so a slip is a loud error, not a rare
race. One thread, not a pool: prompts wait their turn, and the copy is never shared.

Even there, a thread only helps while the tokenizer lets go of the GIL: ``encode_lazily`` goes through the
Rust tokenizer's ``encode_batch_fast``, which does (its ``encode`` holds the GIL for the whole 10 s), and
counts tokens without making a Python int for each (turning 3.5 M ids into a list holds the GIL ~0.25 s,
and a prompt longer than the context window needs only its count).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["THREAD_NAME_PREFIX", "TokenizeThread", "encode_lazily", "tokens_past"]

#: the worker thread's name starts with this (tests look for it)
THREAD_NAME_PREFIX = "tokenize"
#: ``tokens_past`` counts only the first ``8 × (limit + 64)`` characters of a longer text
PREFIX_CHARS_PER_TOKEN, PREFIX_MARGIN_TOKENS = 8, 64

P = ParamSpec("P")
T = TypeVar("T")


class TokenizeThread:
    """A single worker thread with its own copy of ``tokenizer``; ``await run(fn, ...)`` calls ``fn`` there."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = _private_copy(tokenizer)
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX, initializer=self._register
        )

    def _register(self) -> None:
        self._thread = threading.current_thread()

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def own(self) -> Any:
        """The thread's tokenizer; only to code running on the thread (a RuntimeError elsewhere)."""
        if not self.on_thread():
            raise RuntimeError(
                f"the tokenize thread's tokenizer used from {threading.current_thread().name}: use TokenizeThread.run"
            )
        return self.tokenizer

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the thread, its result or exception here. A cancelled caller stops
        waiting; a call already running finishes (a tokenizer cannot be interrupted)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def encode_lazily(tokenizer: Any, text: str, *, add_special_tokens: bool) -> tuple[int, Callable[[], list[int]]]:
    """(how many tokens ``text`` is, a function that makes their ids), as ``tokenizer(text)`` would
    tokenize it; a fast tokenizer's ``backend_tokenizer`` counts with the GIL released."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        return len(ids), lambda: ids
    # without offsets: 2.4x faster on 8 MiB, and dropping the result holds the GIL 27 ms instead of 330
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    (encoding,) = encode([text], add_special_tokens=add_special_tokens)
    return len(encoding), lambda: list(encoding.ids)


def tokens_past(tokenizer: Any, text: str, limit: int, *, add_special_tokens: bool) -> int | None:
    """How many tokens just a prefix of ``text`` is, when that alone is more than ``limit`` (+ a margin for
    the word it cuts); None when ``text`` is short enough to count whole, or its prefix proves nothing.
    Bounds what a hostile prompt of megabytes costs the tokenize thread (every other prompt waits behind
    it) to what a prompt of the context window's size costs: ~25 ms for 8k tokens, not 3 s for 8 MiB."""
    cut = PREFIX_CHARS_PER_TOKEN * (limit + PREFIX_MARGIN_TOKENS)
    if len(text) <= cut:
        return None
    count, _ = encode_lazily(tokenizer, text[:cut], add_special_tokens=add_special_tokens)
    return count if count > limit + PREFIX_MARGIN_TOKENS else None


def _private_copy(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None
    try:
        mine = copy.deepcopy(tokenizer)
    except Exception as exc:  # a tokenizer that cannot be copied is shared with the loop: say so
        logger.warning("tokenizer %s cannot be deep-copied (%s): the tokenize thread shares it", type(tokenizer), exc)
        return tokenizer
    backend = getattr(mine, "backend_tokenizer", None)
    if backend is not None:  # encode_lazily calls it directly: no truncation or padding, as tokenizer(text)
        backend.no_truncation()
        backend.no_padding()
    return mine
