"""swarm_client: run 🤗 causal LMs whose transformer blocks are served by a hivemind swarm."""

from swarm_client.errors import (
    CacheExhaustedError,
    InvalidInputError,
    LengthExceededError,
    NoRouteError,
    PeerError,
    PeerTimeout,
    RemoteError,
    ServerBusyError,
    SessionAccessError,
    SessionLost,
    SessionNotFoundError,
    SessionTooLongError,
    SwarmBusyError,
    SwarmError,
)

__all__ = [
    "AutoDistributedModelForCausalLM",
    "CacheExhaustedError",
    "DistributedModelForCausalLM",
    "InvalidInputError",
    "LengthExceededError",
    "NoRouteError",
    "PeerError",
    "PeerTimeout",
    "RemoteError",
    "ServerBusyError",
    "SessionLost",
    "SessionAccessError",
    "SessionNotFoundError",
    "SessionTooLongError",
    "SwarmBusyError",
    "SwarmError",
]


def __getattr__(name: str):
    # lazy: importing the model pulls in transformers and hivemind, which the wire-level modules don't need
    if name in ("AutoDistributedModelForCausalLM", "DistributedModelForCausalLM"):
        from swarm_client import model

        return getattr(model, name)
    raise AttributeError(name)
