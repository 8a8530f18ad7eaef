"""Session affinity: which server-side KV caches hold which token sequences, so a follow-up request resumes
them and sends the servers only its new tokens.

A *record* describes one session whose caches the servers keep after its request ended (workers keep a
finished session for ``--session-ttl`` seconds): the backend's exported state (for the swarm: the peer id
and server session id of every hop, ``InferenceSession.export_state()``), the token ids the caches hold,
the replica that wrote it, and when. Any replica can resume it: the state names the servers directly.

Keys (one namespace per served model, ``swarmserve:affinity:<hash>``; the same layout in memory and Redis):

- ``{ns}:rec:{rid}`` → the record as JSON, expiring after ``ttl_s`` (the servers' session TTL).
- ``{ns}:pfx:{h_k}`` → ``rid`` for every ``k`` with ``k·B ≤ len(tokens)``: the record indexed under the
  hash of each of its ``B``-token-aligned prefixes (``B = block_tokens``). Hashes chain,
  ``h_k = blake2b(h_{k-1} ‖ tokens[(k-1)B : kB])``, so all of a prompt's hashes cost one pass.

Lookup. A request names its session (``X-Session-Id`` or ``user``): then its record is ``k:<hash of the
key>``, private to that key and not indexed. Otherwise the prompt's own prefix hashes are looked up, deepest
first, in one ``MGET``: in a chat, the prompt of turn N+1 starts with the prompt and completion of turn N,
so the deepest hit is this conversation's previous turn. Hits are verified on the token ids (a record may
have moved on since its entries were written; a hash may collide), the exact common prefix counted, and a
record is taken only if ``common ≥ B`` and ``common ≥ len(record) − common``: resuming rolls the caches back
to ``common``, destroying the record's tail, so a conversation that merely shares a system prompt with
another one (a sibling, not a continuation) starts its own session instead of thrashing the other's — unless
the shared part is worth more than what it would destroy.

Claiming is taking. A request *removes* the record it resumes (``GETDEL``: atomic in Redis, a ``pop`` in
memory) and writes it back, with its new state and tokens, after its session was closed with the caches
kept. So two concurrent requests never drive one server session — the second finds nothing and starts a
fresh session (no reuse, no waiting) — and a record can never describe caches someone changed since: a
request that fails, or whose write-back fails (Redis gone), leaves no record, and its caches expire on the
servers. Locks with expiry (``SET NX PX``) would leave a stale record behind exactly in those cases.

Failure: ``RedisAffinityStore`` treats an unreachable Redis as "no record" and "not saved": requests keep
being served without reuse. It logs the outage once, skips Redis for ``retry_interval_s`` at a time instead
of paying a connection timeout per request, and logs once more when Redis answers again.

The code, by job: ``gateway/affinity/records.py`` (records, claims, prefix hashing and matching),
``gateway/affinity/store.py`` (the lookup/claim/save logic and the in-memory store),
``gateway/affinity/redis_store.py`` (the Redis store); this module picks one (``create_store``) and is the import
path for all of them.
"""

from __future__ import annotations

from gateway.affinity.records import (
    DEFAULT_BLOCK_TOKENS,
    MAX_CANDIDATES,
    AffinityRecord,
    Claim,
    StoreUnavailable,
    common_prefix,
    prefix_hashes,
    worth_taking,
)
from gateway.affinity.redis_store import RedisAffinityStore
from gateway.affinity.store import AffinityStore, InMemoryAffinityStore

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "MAX_CANDIDATES",
    "AffinityRecord",
    "AffinityStore",
    "Claim",
    "InMemoryAffinityStore",
    "RedisAffinityStore",
    "StoreUnavailable",
    "common_prefix",
    "create_store",
    "prefix_hashes",
    "worth_taking",
]


def create_store(
    *,
    redis_url: str | None,
    namespace: str,
    ttl_s: float,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> AffinityStore:
    """Redis when a URL is given (replicas share it), else this process's memory."""
    if redis_url:
        return RedisAffinityStore(redis_url, namespace=namespace, ttl_s=ttl_s, block_tokens=block_tokens)
    return InMemoryAffinityStore(namespace=namespace, ttl_s=ttl_s, block_tokens=block_tokens)
