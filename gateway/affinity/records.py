"""What the session-affinity store keeps and how it finds it: records, claims, and the pure functions of
prefix matching (chained prefix hashes, common prefix, whether a match is worth taking). The design is in
``gateway/affinity/sessions.py``'s docstring."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "MAX_CANDIDATES",
    "AffinityRecord",
    "Claim",
    "StoreUnavailable",
    "common_prefix",
    "prefix_hashes",
    "worth_taking",
]

#: tokens per indexed prefix block: finer finds more, costs one index key per block per record
DEFAULT_BLOCK_TOKENS = 16
#: index hits tried per lookup (each is one record read)
MAX_CANDIDATES = 4


class StoreUnavailable(Exception):
    """The store cannot be reached right now; callers serve without reuse."""


# ------------------------------------------------------------------------------------------ pure functions


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_hashes(token_ids: Sequence[int], block_tokens: int, salt: bytes = b"") -> list[str]:
    """``[h_1, h_2, …]``: the chained hash of ``token_ids[:k·B]`` for every whole block ``k``."""
    out: list[str] = []
    digest = hashlib.blake2b(salt, digest_size=16).digest()
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        block = token_ids[end - block_tokens : end]
        digest = hashlib.blake2b(digest + struct.pack(f"<{block_tokens}I", *block), digest_size=16).digest()
        out.append(digest.hex())
    return out


def worth_taking(common: int, record_tokens: int, block_tokens: int) -> bool:
    """Resume a record found by prefix only if it saves at least one block and at least as many tokens as
    the rollback destroys (see the module docstring)."""
    return common >= block_tokens and common >= record_tokens - common


# ------------------------------------------------------------------------------------------------- records


@dataclass
class AffinityRecord:
    """One resumable session: what is cached where."""

    rid: str
    #: the backend's state to resume from (JSON-able; the swarm's: hops with peer and server session ids)
    state: dict[str, Any]
    #: the tokens whose keys and values the caches hold, in order
    token_ids: list[int]
    #: the gateway replica that wrote the record (informational: any replica can resume it)
    replica: str
    #: unix time of the write
    last_used: float = field(default_factory=time.time)
    keyed: bool = False

    @property
    def cached_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> str:
        return json.dumps(
            {
                "rid": self.rid,
                "replica": self.replica,
                "last_used": self.last_used,
                "keyed": self.keyed,
                "cached_tokens": self.cached_tokens,
                "state": self.state,
                "token_ids": self.token_ids,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> AffinityRecord:
        data = json.loads(text)
        return cls(
            rid=str(data["rid"]),
            state=dict(data["state"]),
            token_ids=[int(t) for t in data["token_ids"]],
            replica=str(data.get("replica", "")),
            last_used=float(data.get("last_used", 0.0)),
            keyed=bool(data.get("keyed", False)),
        )


@dataclass
class Claim:
    """A request's hold on a record id: the record it took (None: nothing to resume, start afresh) and the
    tokens that record shares with the prompt. ``save`` writes the session back under ``rid``."""

    rid: str
    keyed: bool
    record: AffinityRecord | None = None
    common: int = 0
    #: whose conversations the record belongs to (an API key's id, or a client's identity): records of one
    #: owner are invisible to another (``AffinityStore.claim``)
    owner: str = ""
