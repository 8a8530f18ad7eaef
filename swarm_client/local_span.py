"""Blocks the client holds itself (``from_pretrained(..., local_blocks="0:12", device=...)``).

Only the span's tensors are read. ``SequenceManager.make_route`` puts the span on every route as one hop on
the pseudo peer ``routing.LOCAL_PEER`` and routes only the other blocks to servers, so sessions, failover of
the remote hops, hidden states, slices of ``model.blocks`` and backward work as without it. The local hop is
never pinged, banned, spot-checked or pushed to. Compute runs on one thread of its own (never on the I/O
loop, whose other sessions keep talking to their servers meanwhile).

Training: ``span.blocks`` (``model.manager.local.blocks``) is an ``nn.ModuleList``; parameters in it that
require grad (LoRA weights injected with PEFT, or the blocks' own after ``requires_grad_(True)``) get their
gradients in ``backward``, when the loss's backward crosses the local hop (``examples/lora_training.py``).

KV caches: one per session, ``[B, Hkv, capacity, D]`` per layer, grown on demand up to the session's
``max_length`` within a budget of ``max_cache_tokens`` (tokens × batch rows, over every session); a session
closed frees its cache, one closed with ``keep`` stays resumable for ``keep_ttl`` seconds (the gateway's
detach / resume), and a new session that needs the room evicts the oldest kept ones first. No room left is
``SwarmBusyError``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig

from swarm_client.errors import InvalidInputError, SessionNotFoundError, SwarmBusyError
from swarm_client.families import Family
from swarm_client.families.base import CacheLayout
from swarm_client.model_source import ensure_shards
from swarm_client.routing import LOCAL_PEER, RouteHop
from swarm_client.weights import load_tensors

__all__ = ["LOCAL_PEER", "LocalSession", "LocalSpan", "parse_local_blocks"]

#: default cache budget of the local blocks, in tokens × batch rows over all sessions
DEFAULT_CACHE_TOKENS = 2**16
#: how long a session closed with ``keep`` stays resumable
DEFAULT_KEEP_TTL = 300.0
#: smallest cache allocation (tokens); caches double from there up to the session's max_length
MIN_CAPACITY = 64


def parse_local_blocks(value: str | tuple[int, int] | range | None, num_blocks: int) -> tuple[int, int] | None:
    """``"a:b"``, ``(a, b)`` or ``range(a, b)`` → ``(a, b)`` with ``0 <= a < b <= num_blocks``; None stays None."""
    if value is None:
        return None
    try:
        if isinstance(value, str):
            start, end = (int(x) for x in value.split(":"))
        elif isinstance(value, range):
            start, end = value.start, value.stop
        else:
            start, end = (int(x) for x in value)
    except (TypeError, ValueError):
        raise ValueError(f"local_blocks expects 'START:END' or (START, END), got {value!r}") from None
    if not 0 <= start < end <= num_blocks:
        raise ValueError(
            f"local_blocks {start}:{end} is not a block range of this model: need 0 <= START < END <= "
            f"{num_blocks} (it has {num_blocks} blocks)"
        )
    return start, end


@dataclass
class _Cache:
    """One session's KV cache over blocks ``[start, end)`` of the span."""

    start: int
    end: int
    batch_size: int
    max_length: int
    #: per layer (keys, values), each ``[batch, kv_heads, capacity, head_dim]``
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    capacity: int = 0
    position: int = 0
    kept_until: float | None = None  # closed with ``keep``: resumable until then

    @property
    def tokens(self) -> int:
        return self.capacity * self.batch_size


class LocalSpan:
    """Blocks ``[start, end)`` in this process: stateless forward / backward and per-session KV caches."""

    def __init__(
        self,
        blocks: list[nn.Module],
        start: int,
        layout: CacheLayout,
        dtype: torch.dtype,
        device: torch.device,
        max_cache_tokens: int = DEFAULT_CACHE_TOKENS,
        keep_ttl: float = DEFAULT_KEEP_TTL,
    ):
        #: an ``nn.Module``, so PEFT can put LoRA layers into the blocks in place (they train: see ``backward``)
        self.blocks = nn.ModuleList(blocks)
        self.start, self.end = start, start + len(blocks)
        self.layout, self.dtype, self.device = layout, dtype, device
        self.max_cache_tokens, self.keep_ttl = max_cache_tokens, keep_ttl
        self._caches: dict[str, _Cache] = {}
        self._lock = threading.Lock()  # ``_caches`` and the budget: opened on the I/O loop, grown on the thread
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="swarm-local-blocks")

    @classmethod
    def load(
        cls,
        model_dir: str | os.PathLike[str],
        config: PretrainedConfig,
        family: Family,
        start: int,
        end: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **options,
    ) -> LocalSpan:
        """Blocks ``[start, end)`` of the checkpoint in ``model_dir``; tensors of other blocks are never read."""
        device = torch.device(device)
        ensure_shards(model_dir, [family.layer_prefix(i) for i in range(start, end)])
        blocks = []
        for index in range(start, end):
            prefix = family.layer_prefix(index)
            tensors = load_tensors(model_dir, [prefix], dtype=dtype, device=str(device), progress=False)
            relative = {name[len(prefix) :]: t for name, t in tensors.items()}
            block = family.build_block(config, index, relative)
            block.requires_grad_(False)
            blocks.append(block.to(device).eval())
        return cls(blocks, start, family.cache_layout(config), dtype, device, **options)

    @property
    def hop(self) -> RouteHop:
        return RouteHop(LOCAL_PEER, self.start, self.end)

    def _blocks(self, start: int, end: int) -> nn.ModuleList:
        if not self.start <= start <= end <= self.end:
            raise InvalidInputError(f"blocks {start}:{end} are not all local (local: {self.start}:{self.end})")
        return self.blocks[start - self.start : end - self.start]

    async def run(self, fn, *args):
        """``fn(*args)`` on the span's compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------------ stateless (RemoteSequential)
    @torch.no_grad()
    def forward(
        self,
        hidden: torch.Tensor,
        output_hidden_states: bool,
        start: int,
        end: int,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As a server's ``rpc_forward``: ``[B, T, H]`` out, or ``[end - start, B, T, H]`` with every state."""
        x = hidden.to(self.device, self.dtype)
        prompts = None if prompts is None else prompts.to(self.device, self.dtype)
        states = []
        for i, block in enumerate(self._blocks(start, end)):
            if prompts is not None:
                x = _add_prompt(x, prompts[i])
            x = block(x, 0, None)
            states.append(x)
        return (torch.stack(states) if output_hidden_states else x).cpu()

    def backward(
        self, hidden: torch.Tensor, grad_output: torch.Tensor, start: int, end: int, prompts: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """As a server's ``rpc_backward`` (the forward recomputed): ``[grad_hidden(, grad_prompts)]``.

        Unlike a server's, these blocks may train: parameters with ``requires_grad`` (e.g. LoRA weights that
        ``peft.inject_adapter_in_model`` put into ``blocks``) get their gradients accumulated into ``.grad``.
        """
        blocks = self._blocks(start, end)
        params = [param for block in blocks for param in block.parameters() if param.requires_grad]
        with torch.enable_grad():
            x0 = hidden.to(self.device, self.dtype).detach().requires_grad_(True)
            p = None if prompts is None else prompts.to(self.device, self.dtype).detach().requires_grad_(True)
            x = x0
            for i, block in enumerate(blocks):
                x = block(x if p is None else _add_prompt(x, p[i]), 0, None)
            inputs = (x0,) if p is None else (x0, p)
            grads = torch.autograd.grad(x, (*inputs, *params), grad_output.to(self.device, self.dtype))
        for param, grad in zip(params, grads[len(inputs) :], strict=True):
            param.grad = grad if param.grad is None else param.grad + grad
        return [g.to("cpu", hidden.dtype) for g in grads[: len(inputs)]]

    # ------------------------------------------------------------------ sessions
    def open_cache(
        self, session_id: str, start: int, end: int, batch_size: int, max_length: int, resume: bool
    ) -> _Cache:
        """A new cache (or, with ``resume``, the kept one of ``session_id``, its cap raised to ``max_length``)."""
        self._blocks(start, end)
        with self._lock:
            self._expire()
            if resume:
                cache = self._caches.get(session_id)
                if cache is None or cache.kept_until is None or (cache.start, cache.end) != (start, end):
                    raise SessionNotFoundError(f"the local blocks hold no kept session {session_id}", LOCAL_PEER)
                cache.kept_until = None
                cache.max_length = max(cache.max_length, max_length)
                return cache
            if session_id in self._caches:
                raise InvalidInputError(f"local session {session_id} is open already")
            cache = _Cache(start, end, batch_size, max_length)
            self._caches[session_id] = cache
            return cache

    def release(self, session_id: str, keep: bool) -> None:
        """The session is closed: its cache is freed, or with ``keep`` kept for ``keep_ttl`` seconds."""
        with self._lock:
            cache = self._caches.get(session_id)
            if cache is None:
                return
            if keep and cache.position > 0:
                cache.kept_until = time.monotonic() + self.keep_ttl
            else:
                del self._caches[session_id]

    @property
    def cache_tokens_used(self) -> int:
        with self._lock:
            return sum(c.tokens for c in self._caches.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, c in self._caches.items() if c.kept_until is not None and c.kept_until <= now]:
            del self._caches[sid]

    def _reserve(self, cache: _Cache, capacity: int) -> None:
        """Make room in the budget for ``cache`` at ``capacity`` tokens, evicting the oldest kept caches."""
        with self._lock:
            self._expire()
            needed = (capacity - cache.capacity) * cache.batch_size
            kept = sorted((c.kept_until, s) for s, c in self._caches.items() if c.kept_until is not None)
            while sum(c.tokens for c in self._caches.values()) + needed > self.max_cache_tokens and kept:
                del self._caches[kept.pop(0)[1]]
            used = sum(c.tokens for c in self._caches.values())
            if used + needed > self.max_cache_tokens:
                raise SwarmBusyError(
                    f"the local blocks' cache is full ({used} of {self.max_cache_tokens} tokens in use, "
                    f"{needed} more needed); retry when other sessions end"
                )
            cache.capacity = capacity  # claimed now; the tensors follow

    def _grow(self, cache: _Cache, needed: int) -> None:
        if needed <= cache.capacity:
            return
        if needed > cache.max_length:
            raise InvalidInputError(f"{needed} tokens exceed the session's max_length {cache.max_length}")
        old, held = cache.kv, cache.capacity
        capacity = min(cache.max_length, max(needed, 2 * held, MIN_CAPACITY))
        self._reserve(cache, capacity)
        shape = (cache.batch_size, self.layout.num_kv_heads, capacity, self.layout.head_dim)
        kv = []
        for i in range(cache.end - cache.start):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old:
                k[:, :, : cache.position] = old[i][0][:, :, : cache.position]
                v[:, :, : cache.position] = old[i][1][:, :, : cache.position]
            kv.append((k, v))
        cache.kv = kv

    @torch.no_grad()
    def step(self, cache: _Cache, hidden: torch.Tensor, position: int, output_hidden_states: bool) -> torch.Tensor:
        """Feed ``hidden`` ``[B, T, H]`` at ``position`` (at most what the cache holds: a smaller one rolls back)."""
        if position > cache.position:
            raise InvalidInputError(f"step at position {position}, but the local cache holds {cache.position} tokens")
        if hidden.shape[0] != cache.batch_size:
            raise InvalidInputError(f"batch {hidden.shape[0]} != the session's {cache.batch_size}")
        self._grow(cache, position + hidden.shape[1])
        x = hidden.to(self.device, self.dtype)
        states = []
        for block, kv in zip(self._blocks(cache.start, cache.end), cache.kv, strict=True):
            x = block(x, position, kv)
            states.append(x)
        cache.position = position + hidden.shape[1]
        return (torch.stack(states) if output_hidden_states else x).cpu()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._caches.clear()


class LocalSession:
    """The local hop of an ``InferenceSession``: ``server_session._ServerSession``'s interface, in process."""

    #: never pushed to (servers push only to servers), never spot-checked
    local = True

    def __init__(self, span: LocalSpan, hop: RouteHop, session_id: str):
        self.span, self.hop, self.session_id = span, hop, session_id
        self.position = 0
        self.closed = False
        self._cache: _Cache | None = None

    async def open(self, max_length: int, batch_size: int, resume: bool, timeout: float, wait: bool = True) -> int:
        hop = self.hop
        self._cache = self.span.open_cache(self.session_id, hop.start, hop.end, batch_size, max_length, resume)
        self.position = self._cache.position
        return self.position

    async def step(
        self,
        hidden: torch.Tensor,
        position: int,
        timeout: float,
        output_hidden_states: bool = False,
        step_id: str | None = None,
        push_chain: list[dict] | None = None,
        expect_push: bool = False,
        seq: int | None = None,
    ) -> torch.Tensor:
        if self._cache is None or self.closed:
            raise SessionNotFoundError(f"local session {self.session_id} is not open", LOCAL_PEER)
        out = await self.span.run(self.span.step, self._cache, hidden, position, output_hidden_states)
        self.position = self._cache.position
        return out

    async def close(self, keep: bool = False, wait: bool = True) -> None:
        if not self.closed:
            self.closed = True
            self.span.release(self.session_id, keep)


def _add_prompt(hidden: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``hidden`` [B, T, H] plus ``prompt`` [B or 1, P, H] on its first P positions (as the servers do)."""
    length = prompt.shape[1]
    return torch.cat([hidden[:, :length] + prompt, hidden[:, length:]], dim=1)
