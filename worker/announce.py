"""Announcing this server's span: its signed ``ServerInfo`` stored under every block it holds.

The record schema, the signing scheme and the reads live in ``swarm_client.dht_records`` (clients need
them too); only servers write records, so the write lives here.
"""

from __future__ import annotations

import time

from hivemind.dht import DHT

from swarm_client.dht_records import ServerInfo, block_uids, owner_peer_id, record_subkey


def declare_span(dht: DHT, dht_prefix: str, start: int, end: int, info: ServerInfo, expiration: float) -> bool:
    """Store ``info`` under every block of ``[start, end)`` under our signed subkey; blocking."""
    peer_id = dht.peer_id.to_base58()
    subkey = record_subkey(peer_id)
    if owner_peer_id(subkey) != peer_id:
        raise ValueError(
            "this DHT's peer id is not derived from the record-signing key; create it with "
            "record_validators() and write_identity() or nobody will accept its records"
        )
    expiration_time = time.time() + expiration  # hivemind wants absolute DHT time
    value = info.to_wire()
    futures = [
        dht.store(uid, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)
        for uid in block_uids(dht_prefix, start, end)
    ]
    return all(bool(f.result()) for f in futures)
