"""Model families: how to build blocks and the local head for each supported architecture."""

from __future__ import annotations

from transformers import PretrainedConfig

from swarm_client.families.base import KV, CacheLayout, Family, Head
from swarm_client.families.bloom import BloomFamily
from swarm_client.families.falcon import FalconFamily
from swarm_client.families.llama import LlamaFamily
from swarm_client.families.mixtral import MixtralFamily
from swarm_client.families.recurrent import recurrent_reason

_FAMILIES: list[Family] = [LlamaFamily(), MixtralFamily(), FalconFamily(), BloomFamily()]


def register_family(family: Family) -> None:
    _FAMILIES.append(family)


def supported_model_types() -> list[str]:
    return sorted(t for f in _FAMILIES for t in f.model_types)


def get_family(config: PretrainedConfig) -> Family:
    for family in _FAMILIES:
        if config.model_type in family.model_types:
            return family
    reason = recurrent_reason(config)
    if reason is not None:
        raise ValueError(
            f"model type {config.model_type!r} keeps a recurrent state per session ({reason}) beside or instead of "
            "a KV cache; swarmserve's servers hold only per-session KV caches, so it cannot be served yet. "
            f"Supported: {', '.join(supported_model_types())} (docs/families.md lists every model type)."
        )
    raise ValueError(
        f"model type {config.model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
    )


__all__ = ["KV", "CacheLayout", "Family", "Head", "get_family", "register_family", "supported_model_types"]
