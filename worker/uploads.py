"""A server-wide bound on the bytes of forward/backward uploads held at once.

Each ``rpc_forward`` / ``rpc_backward`` request is gathered whole before it runs (``worker.wire``): one
request is bounded by ``max_tensor_bytes`` per tensor, but many at once were not. Every such request
holds its bytes here from the moment they arrive until its answer is sent; one that would take the total
past the budget is refused as busy (``ServerBusyError``, reason ``uploads``): retry later or elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from swarm_client.errors import ServerBusyError

DEFAULT_UPLOAD_BUDGET = 1024 * 2**20


class UploadBudget:
    def __init__(self, max_bytes: int = DEFAULT_UPLOAD_BUDGET):
        self.max_bytes = max_bytes
        self.held = 0
        self.refused = 0

    @contextmanager
    def hold(self) -> Iterator[UploadHold]:
        """Bytes one request takes as they arrive (``UploadHold.add``), all given back when it ends."""
        hold = UploadHold(self)
        try:
            yield hold
        finally:
            self.held -= hold.total


class UploadHold:
    def __init__(self, budget: UploadBudget):
        self.budget = budget
        self.total = 0

    def add(self, size: int) -> None:
        budget = self.budget
        if budget.held + size > budget.max_bytes:
            budget.refused += 1
            raise ServerBusyError(
                f"this server is receiving {budget.held} bytes of other uploads (its limit is {budget.max_bytes}); "
                "retry later or route to another server",
                details={"reason": "uploads"},
            )
        budget.held += size
        self.total += size
