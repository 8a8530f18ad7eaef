"""Small shared helpers: DHT prefix naming, peer address parsing."""

from __future__ import annotations

import re
from pathlib import Path


def default_dht_prefix(name_or_path: str) -> str:
    """The DHT namespace of a model: its last path component, sanitized (``SmolLM2-135M-Instruct``).

    Servers and clients must agree on it; both default to this unless given ``--dht-prefix``.
    """
    name = Path(str(name_or_path).rstrip("/")).name or str(name_or_path)
    return re.sub(r"[^A-Za-z0-9_\-]", "-", name)


def parse_initial_peers(values: list[str] | str | None) -> list[str]:
    """Accept repeated flags, comma- or space-separated multiaddrs."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    peers = []
    for value in values:
        peers.extend(p for p in re.split(r"[\s,]+", value) if p)
    return peers
