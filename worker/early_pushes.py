"""Pushed steps that arrive before their session is open here.

A client opens every server of its chain at once and sends the first server its open and first step back to
back, so that server's push of the first step (the prefill) races the client's own open of the next server:
over a WAN they arrive within a few milliseconds of each other, and half the time the push came first and was
refused, which cost the prefill a whole client round trip at every server after the first. A push for a
session that is not open here is therefore held for a moment and delivered when the session opens, if its
push token matches the one the session is opened with (checked then: before, there is nothing to check against).

Bounded like everything strangers send: at most ``MAX_HELD`` steps of at most ``MAX_HELD_BYTES`` bytes each
(the client pushes nothing larger), each for ``HOLD_SECONDS``; past that a push is refused as before. Filling
the buffer with junk only makes other sessions' first pushes wait for the client's own copy, as without it.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

#: how long a push waits for its session to open (the client sends the open before the step that pushes)
HOLD_SECONDS = 2.0
#: steps held at once (a server's whole buffer), and the largest one held (the client's own push limit)
MAX_HELD = 32
MAX_HELD_BYTES = 2**18


class EarlyPushes:
    """Held pushed steps by session id, oldest first."""

    def __init__(self) -> None:
        self._held: OrderedDict[tuple[str, str], tuple[float, list[torch.Tensor], dict]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, session_id: str, tensors: list[torch.Tensor], metadata: dict) -> bool:
        """Keep a push for ``session_id`` (not open here yet); False when it is too large or the buffer full."""
        self._expire()
        if sum(t.numel() * t.element_size() for t in tensors) > MAX_HELD_BYTES or len(self._held) >= MAX_HELD:
            return False
        key = (session_id, str(metadata.get("step_id")))
        if key in self._held:
            return False  # one copy of a step is enough
        self._held[key] = (time.monotonic() + HOLD_SECONDS, tensors, metadata)
        return True

    def take(self, session_id: str) -> list[tuple[list[torch.Tensor], dict]]:
        """The pushes held for ``session_id`` (in arrival order), removed from the buffer."""
        self._expire()
        keys = [key for key in self._held if key[0] == session_id]
        return [self._held.pop(key)[1:] for key in keys]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._held:
            key, (until, _, _) = next(iter(self._held.items()))
            if until > now:
                return
            del self._held[key]
