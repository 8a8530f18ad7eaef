"""How many KV-cache token slots a worker offers: ``--cache-tokens N``, or (the default, ``auto``) what its
memory holds for the model it serves.

A fixed default decided how long a conversation could be whatever the hardware: 16,384 slots on a server of
a 131,072-token model with memory to spare, so one Open WebUI chat with its tool list filled a server and
every later turn failed (issue 40). ``auto`` sizes the cache from the memory free once the span's weights are
loaded — a share of it (``GPU_SHARE`` of the GPU's free memory; ``CPU_SHARE`` of the RAM available, since a
volunteer's machine runs other things) divided by the span's KV bytes per token — and caps it at
``CONTEXTS_PER_SERVER`` full context windows of the model. Caches grow as sessions need them, so the slots
are a budget, not an allocation made at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil
import torch

from swarm_client.families.base import CacheLayout

__all__ = ["CacheSize", "auto_cache_tokens", "model_context", "resolve_cache_tokens"]

#: the share of the GPU's free memory (after the weights) an ``auto`` cache may grow into
GPU_SHARE = 0.8
#: the share of available RAM an ``auto`` cache may grow into (the machine runs other programs)
CPU_SHARE = 0.25
#: at most this many full context windows per server: enough for several long conversations at once
CONTEXTS_PER_SERVER = 8
#: a model config without a context length (ALiBi models such as BLOOM): count it as this long
DEFAULT_CONTEXT = 2048
#: fewer slots than this is no useful server: say so instead of serving prompts nobody can send
MIN_TOKENS = 256


@dataclass(frozen=True)
class CacheSize:
    tokens: int
    #: how the number was found, for the worker's ready line
    how: str


def model_context(config: Any) -> int:
    """The model's context window from its config (``max_position_embeddings`` and its older names)."""
    for name in ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT


def free_memory(device: torch.device) -> tuple[int, float, str]:
    """(bytes free, the share an ``auto`` cache may use, where) on ``device``."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), GPU_SHARE, f"{device} free"
    return int(psutil.virtual_memory().available), CPU_SHARE, "RAM available"


def auto_cache_tokens(bytes_per_token: int, free_bytes: int, share: float, context: int) -> int:
    """The slots ``share`` of ``free_bytes`` holds at ``bytes_per_token``, at most ``CONTEXTS_PER_SERVER``
    context windows."""
    by_memory = int(free_bytes * share) // max(1, bytes_per_token)
    return min(by_memory, CONTEXTS_PER_SERVER * context)


def resolve_cache_tokens(
    requested: int | None, layout: CacheLayout, dtype: torch.dtype, num_layers: int, device: torch.device, config: Any
) -> CacheSize:
    """``requested`` as given, or the ``auto`` size for this span on this device (see the module's doc)."""
    if requested is not None:
        return CacheSize(requested, "--cache-tokens")
    per_token = layout.bytes_per_token(dtype) * num_layers
    free, share, where = free_memory(torch.device(device))
    context = model_context(config)
    tokens = auto_cache_tokens(per_token, free, share, context)
    if tokens < MIN_TOKENS:
        raise SystemExit(
            f"not enough memory for a KV cache: {share:.0%} of {free / 2**30:.1f} GiB {where} holds {tokens} token "
            f"slots at {per_token / 1024:.1f} KiB per token for these {num_layers} blocks; serve fewer blocks "
            "(--num-blocks), free memory, or set --cache-tokens"
        )
    capped = tokens == CONTEXTS_PER_SERVER * context
    how = (
        f"auto: {CONTEXTS_PER_SERVER} × the {context}-token context"
        if capped
        else f"auto: {share:.0%} of {free / 2**30:.1f} GiB {where} at {per_token / 1024:.1f} KiB per token"
    )
    return CacheSize(tokens, how)
