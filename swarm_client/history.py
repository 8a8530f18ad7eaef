"""The inputs a session has sent to one hop, kept client-side so a replacement server can be replayed."""

from __future__ import annotations

import torch

from swarm_client.errors import SessionLost


class HistoryBuffer:
    """The hidden states sent to one hop, ``[B, length, H]``, appended in chunks (no quadratic copying).

    A session resumed from another request starts with an *unknown* prefix (the inputs were sent by
    someone else); such a hop can be extended but not replayed, so its failure ends the session.
    """

    def __init__(self, unknown_prefix: int = 0) -> None:
        self.chunks: list[torch.Tensor] = []
        self.unknown = unknown_prefix
        self.length = unknown_prefix

    def write(self, position: int, x: torch.Tensor) -> None:
        self.truncate(position)
        if position != self.length:
            raise SessionLost(f"history gap: writing at {position} but {self.length} tokens are recorded")
        self.chunks.append(x)
        self.length += x.shape[1]

    def truncate(self, position: int) -> None:
        if position >= self.length:
            return
        if position <= self.unknown:
            self.chunks, self.unknown, self.length = [], position, position
            return
        kept, total = [], self.unknown
        for chunk in self.chunks:
            if total + chunk.shape[1] <= position:
                kept.append(chunk)
                total += chunk.shape[1]
            else:
                if position > total:
                    kept.append(chunk[:, : position - total])
                break
        self.chunks, self.length = kept, position

    def read(self, position: int) -> torch.Tensor | None:
        if position == 0:
            return None
        if self.unknown > 0:
            raise SessionLost(
                f"a server of a resumed session failed and its first {self.unknown} inputs are not known here; "
                "start a new session (re-prefill)"
            )
        return torch.cat(self.chunks, dim=1)[:, :position]
