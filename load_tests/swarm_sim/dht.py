"""The DHT as the swarm's code sees it: per-block ``{peer: ServerInfo}`` records, each with an expiry.

A write is one ``store`` of one block key (``worker.announce.declare_span`` stores one key per block); a read
is one ``get`` of one block key (``swarm_client.dht_records.fetch_block_records`` gets all ``num_blocks``
keys). Both are counted, with the bytes of the records read, for the DHT-load figures. Network delays of the
DHT itself are not modelled: a write is visible at once.
"""

from __future__ import annotations

import json

from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, spans_from_records


class SimDHT:
    """Records of ``num_blocks`` block keys; ``version`` grows with every write (for caches of views)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._records: list[dict[str, tuple[ServerInfo, float]]] = [{} for _ in range(num_blocks)]
        self.writes = 0
        self.reads = 0
        self.bytes_read = 0
        self.version = 0
        self._record_bytes: dict[int, int] = {}

    def store(self, block: int, peer_id: str, info: ServerInfo, expires: float) -> None:
        self._records[block][peer_id] = (info, expires)
        self.writes += 1
        self.version += 1

    def records(self, now: float, count_read: bool = True) -> list[dict[str, ServerInfo]]:
        """What ``fetch_block_records`` returns at ``now``: the unexpired records of every block."""
        result = []
        for per_peer in self._records:
            expired = [peer for peer, (_, expires) in per_peer.items() if expires <= now]
            for peer in expired:
                del per_peer[peer]
            result.append({peer: info for peer, (info, _) in per_peer.items()})
        if count_read:
            self.reads += self.num_blocks
            self.bytes_read += sum(len(r) for r in result) * self._bytes_of_record(result)
        return result

    def spans(self, now: float, count_read: bool = True) -> dict[str, RemoteSpanInfo]:
        """The swarm view a client or a joining server builds: ``spans_from_records`` of a full read."""
        return spans_from_records(self.records(now, count_read))

    def _bytes_of_record(self, result: list[dict[str, ServerInfo]]) -> int:
        """Size of one record on the wire (JSON of ``ServerInfo.to_wire`` + a ~300-byte owner subkey)."""
        key = 0
        if key not in self._record_bytes:
            sample = next((info for per_peer in result for info in per_peer.values()), None)
            if sample is None:
                return 0
            self._record_bytes[key] = len(json.dumps(sample.to_wire())) + 300
        return self._record_bytes[key]
