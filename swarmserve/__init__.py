"""swarmserve: the ``swarmserve`` command line (``swarmserve.cli``) and the local-swarm launcher
(``swarmserve.launcher``). The library is ``swarm_client``; the block server ``worker``; the HTTP API
``gateway``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("swarmserve")
except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
