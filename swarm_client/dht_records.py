"""What a block server announces on the DHT, and the two functions that write and read it.

Key: ``"{dht_prefix}.{block_index}"``; subkey: the server's peer id (base58); value: ``ServerInfo`` as a dict.
Records expire unless the server refreshes them, so a crashed server disappears by itself.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROTOCOL_VERSION = "1"


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


class ServerInfo(BaseModel):
    """The announced state of one server. Unknown fields are ignored so newer servers stay readable."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    state: ServerState
    start_block: int = Field(ge=0)
    end_block: int = Field(gt=0)
    throughput: float = Field(ge=0.0, description="tokens/s the server can push through one block")
    cache_tokens_left: int = Field(ge=0, default=0)
    version: str = PROTOCOL_VERSION
    dtype: str = "float32"
    public_name: str | None = None
    addrs: tuple[str, ...] = ()

    def to_wire(self) -> dict:
        data = self.model_dump(mode="json")
        data["state"] = int(self.state)
        data["addrs"] = list(self.addrs)
        return data

    @classmethod
    def from_wire(cls, value: object) -> ServerInfo | None:
        """Parse a record value; None (never an exception) for garbage, so one bad peer breaks nothing."""
        if not isinstance(value, dict):
            return None
        try:
            info = cls.model_validate(value)
        except (ValidationError, ValueError, TypeError):
            return None
        if info.end_block <= info.start_block:
            return None
        return info


@dataclass(frozen=True)
class RemoteSpanInfo:
    """One server's contiguous span ``[start, end)`` as seen by clients."""

    peer_id: str
    start: int
    end: int
    server_info: ServerInfo = field(compare=False)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def state(self) -> ServerState:
        return self.server_info.state


def block_uids(dht_prefix: str, start: int, end: int) -> list[str]:
    return [f"{dht_prefix}.{i}" for i in range(start, end)]


def declare_span(dht, dht_prefix: str, start: int, end: int, info: ServerInfo, expiration: float) -> bool:
    """Store ``info`` under every block of ``[start, end)`` (subkey = our peer id); blocking."""
    peer_id = dht.peer_id.to_base58()
    expiration_time = time.time() + expiration  # hivemind wants absolute DHT time
    futures = [
        dht.store(uid, subkey=peer_id, value=info.to_wire(), expiration_time=expiration_time, return_future=True)
        for uid in block_uids(dht_prefix, start, end)
    ]
    return all(bool(f.result()) for f in futures)


def fetch_block_records(dht, dht_prefix: str, num_blocks: int) -> list[dict[str, ServerInfo]]:
    """For each block, ``{peer_id: ServerInfo}`` of the valid, unexpired records found; blocking."""
    uids = block_uids(dht_prefix, 0, num_blocks)
    futures = [dht.get(uid, latest=True, return_future=True) for uid in uids]
    result: list[dict[str, ServerInfo]] = []
    for fut in futures:
        entry = fut.result()
        per_peer: dict[str, ServerInfo] = {}
        if entry is not None and isinstance(entry.value, dict):
            for subkey, item in entry.value.items():
                info = ServerInfo.from_wire(getattr(item, "value", None))
                if info is not None and isinstance(subkey, str):
                    per_peer[subkey] = info
        result.append(per_peer)
    return result


def spans_from_records(records: Sequence[dict[str, ServerInfo]]) -> dict[str, RemoteSpanInfo]:
    """Collapse per-block records into one span per peer (the span the peer announced)."""
    spans: dict[str, RemoteSpanInfo] = {}
    for block, per_peer in enumerate(records):
        for peer_id, info in per_peer.items():
            if not (info.start_block <= block < info.end_block):
                continue  # a record that lies about its own span is ignored for this block
            if peer_id not in spans:
                spans[peer_id] = RemoteSpanInfo(peer_id, info.start_block, info.end_block, info)
    return spans
