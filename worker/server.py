"""Block server lifecycle: join the DHT, pick and load a span, serve RPCs, announce, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import tempfile
import time
from typing import AsyncIterator  # noqa: UP035 - as in hivemind's stream signatures

import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from transformers import AutoConfig

from swarm_client import protocol
from swarm_client.config import default_dht_prefix
from swarm_client.dht_records import (
    PROTOCOL_VERSION,
    Reachability,
    ServerInfo,
    ServerState,
    fetch_block_records,
    mark_validated,
    record_validators,
    spans_from_records,
    write_identity,
)
from swarm_client.families import get_family
from swarm_client.model_source import resolve_model_path
from worker import relay
from worker.announce import declare_span
from worker.block_selection import choose_best_blocks
from worker.cache import CacheManager
from worker.cache_size import CacheSize, resolve_cache_tokens
from worker.compute import SpanRunner
from worker.config import WorkerConfig, announce_list, cache_settings
from worker.handler import BlockHandler, HandlerLimits
from worker.loading import load_blocks, resolve_dtype
from worker.message_cap import DEFAULT_MAX_RECEIVING_BYTES, install_message_cap
from worker.metrics import WorkerMetrics
from worker.quant import resolve_quant
from worker.reachability import own_maddrs, startup_check, unreachable_message
from worker.reachability_service import ReachabilityService
from worker.rebalance import (
    HandlerSwitch,
    balancing_view,
    jittered,
    joining_range,
    plan_move,
    retired_ranges,
    tombstone,
)
from worker.throughput import measure_throughput

logger = logging.getLogger("swarmserve.worker")
#: a push stream that cannot be opened within this is given up (the client's own copies still arrive)
PUSH_CONNECT_TIMEOUT = 5.0


class BlockServer:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.model_dir = str(resolve_model_path(cfg.model))
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.family = get_family(self.config)
        self.total_blocks = self.config.num_hidden_layers
        self.dht_prefix = cfg.dht_prefix or default_dht_prefix(cfg.model)
        self.device = torch.device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device, self.config)
        self.quant = cfg.quant  # "auto" until the span is chosen (worker/quant.py)
        self.expiration = cfg.expiration or max(3 * cfg.update_period, 15.0)
        self.dht: DHT | None = None
        self.handler: BlockHandler | None = None
        #: the KV-cache budget: --cache-tokens, or sized from free memory once the span is loaded
        self.cache_size = CacheSize(cfg.cache_tokens or 0, "--cache-tokens" if cfg.cache_tokens else "auto")
        self.switch: HandlerSwitch | None = None
        self.state = ServerState.JOINING
        self.start = self.end = 0
        self.throughput = 1.0
        self._stop = asyncio.Event()
        self._p2p: P2P | None = None
        self.checker = ReachabilityService()  # we answer newcomers' reachability checks too
        self.reachability: Reachability | None = None
        self.addrs: tuple[str, ...] = ()
        self.metrics = WorkerMetrics(lambda: self.switch.handlers if self.switch is not None else [])

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        cfg = self.cfg
        announce = announce_list(cfg)
        self.dht = self._start_dht()
        up_at = time.monotonic()
        # which addresses peers are told to dial: the first thing to check when nobody reaches a server
        visible = self.dht.get_visible_maddrs()
        shown = " ".join(map(str, visible))
        print(f"swarmserve worker: listening on {cfg.host}:{cfg.port}, announcing {shown}", flush=True)
        if not announce and cfg.host in ("0.0.0.0", "::"):
            logger.warning("no --public-ip / --announce-maddrs: behind NAT or in a container these are private")
        install_message_cap(cfg.max_message_bytes, max(DEFAULT_MAX_RECEIVING_BYTES, 4 * cfg.max_message_bytes))
        self._p2p = p2p = await self.dht.replicate_p2p()
        check = cfg.reachability_check or None  # runs while we choose the span and load the weights
        if check:
            kw = {"dht": self.dht, "dht_prefix": self.dht_prefix, "num_blocks": self.total_blocks}
            check = asyncio.create_task(startup_check(p2p, visible, cfg.initial_peers, **kw))
        self.start, self.end = await asyncio.to_thread(self._choose_span)
        logger.info("chose blocks %d:%d of %d", self.start, self.end, self.total_blocks)
        await self._announce(ServerState.JOINING)

        self.handler = await self._build_handler(self.start, self.end)
        self.switch = HandlerSwitch(self.handler)
        await self.switch.add_p2p_handlers(p2p)
        await self.checker.add_p2p_handlers(p2p)
        if check:
            result = await check
            self.reachability = result.reachability
            if result.unreachable:  # never ONLINE as is: through a relay, or exit saying how to fix it
                await self._announce(ServerState.OFFLINE)  # replaces our JOINING records
                failure = await self._serve_via_relay(up_at) if cfg.relay == "auto" else None
                if self.reachability is None:
                    raise SystemExit(unreachable_message(result, cfg.port, failure))
        self.state = ServerState.ONLINE
        maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        self.addrs = tuple(own_maddrs(maddrs))  # in our records: a client that cannot reach us names them
        await self._announce(ServerState.ONLINE)
        print(
            f"swarmserve worker ready: serving blocks {self.start}:{self.end} of {self.total_blocks} "
            f"({self.dht_prefix}, {self.family.name} family, {self.dtype}, quant {self.quant}, {self.device}) "
            f"as peer {self.dht.peer_id.to_base58()}; throughput {self.throughput:.1f} tok/s; "
            f"cache {self.cache_size.tokens} tokens ({self.cache_size.how})",
            flush=True,
        )
        for maddr in maddrs:
            print(f"worker maddr: {maddr}", flush=True)
        if cfg.metrics_port:
            port = self.metrics.serve(cfg.host, cfg.metrics_port)
            print(f"worker metrics: http://{cfg.host}:{port}/metrics", flush=True)

        tasks = [asyncio.create_task(self._announce_loop())]
        if cfg.blocks is None and cfg.rebalance_period > 0:
            tasks.append(asyncio.create_task(self._balance_loop()))
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await self._drain()

    def _start_dht(self, extra: dict | None = None) -> DHT:
        with tempfile.TemporaryDirectory() as identity_dir:  # our peer id = hash of the record-signing key
            dht = DHT(
                initial_peers=self.cfg.initial_peers,
                host_maddrs=[f"/ip4/{self.cfg.host}/tcp/{self.cfg.port}"],
                announce_maddrs=announce_list(self.cfg) or None,
                start=True,
                await_ready=True,
                record_validators=record_validators(self.dht_prefix, self.total_blocks),
                **write_identity(identity_dir),
                **(extra or {}),
            )
        mark_validated(dht)
        return dht

    async def _serve_via_relay(self, up_at: float) -> str | None:
        """Restart our DHT node behind the public initial peers as relays (same identity, so the same peer id
        and records) and have checkers dial us through a circuit (worker/relay.py), all by ``up_at +
        relay.RELAY_BUDGET``. Sets ``reachability`` RELAYED and returns None if one did; else returns why not."""
        relays = relay.public_relays(self.cfg.initial_peers)
        if not relays:
            return "no initial peer with a public address to relay through (circuits need a public relay)"
        began = time.monotonic()
        with contextlib.suppress(Exception):
            await self._p2p.shutdown()  # the replica's client only; the DHT's shutdown ends the daemon
        self.dht.shutdown()
        self.dht = self._start_dht(relay.relay_dht_kwargs(relays))
        self._p2p = p2p = await self.dht.replicate_p2p()
        await self.switch.add_p2p_handlers(p2p)
        await self.checker.add_p2p_handlers(p2p)
        wait = min(relay.CIRCUIT_WAIT, up_at + relay.RELAY_BUDGET - relay.VERIFY_RESERVE - time.monotonic())
        circuits = await relay.wait_for_circuit(self.dht, wait)
        if not circuits:
            return f"no relay reserved a circuit for us within {time.monotonic() - began:.1f} s (relays: {relays})"
        kw = {"dht": self.dht, "dht_prefix": self.dht_prefix, "num_blocks": self.total_blocks}
        timeout = max(relay.VERIFY_RESERVE, up_at + relay.RELAY_BUDGET - time.monotonic())
        result = await relay.verify_circuits(p2p, circuits, self.cfg.initial_peers, timeout, **kw)
        if result.reachability is not Reachability.RELAYED:
            return f"no peer could dial us through {' '.join(circuits)}:\n{result.describe()}"
        self.reachability = Reachability.RELAYED
        took = time.monotonic() - began
        print(f"swarmserve worker: reachable through relay {relay.relay_of(circuits[0])} ({took:.1f} s)", flush=True)
        return None

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """A stop was asked for (SIGTERM / SIGINT)."""
        return self._stop.is_set()

    async def _push(self, peer_id: str, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        """Server-to-server push: stream a session's step outputs to the next server of a client's chain."""
        if self._p2p is None:
            raise RuntimeError("p2p transport not started")
        stub = protocol.BlockRPC.get_stub(self._p2p, PeerID.from_base58(peer_id))
        async with asyncio.timeout(PUSH_CONNECT_TIMEOUT):
            responses = await stub.rpc_push(requests)
        async for _ in responses:  # one summary at the end
            pass

    async def _build_handler(self, start: int, end: int) -> BlockHandler:
        """Load blocks ``[start, end)`` and wrap them in a handler (throughput is measured once, on start)."""
        cfg = self.cfg
        prefixes = [self.family.layer_prefix(i) for i in range(start, end)]  # "auto": by the span's size
        where = (self.dtype, self.device)
        self.quant = await asyncio.to_thread(resolve_quant, cfg.quant, self.model_dir, prefixes, *where)
        args = (self.model_dir, self.config, self.family, start, end, *where)
        blocks = await asyncio.to_thread(
            load_blocks, *args, cpu_kernels=cfg.cpu_kernels, quant=self.quant, adapters=cfg.adapters
        )
        runner = SpanRunner(blocks, self.dtype, self.device)
        layout = self.family.cache_layout(self.config)
        self.cache_size = resolve_cache_tokens(
            cfg.cache_tokens, layout, self.dtype, len(blocks), self.device, self.config
        )
        caches = CacheManager(
            self.cache_size.tokens, len(blocks), layout, self.dtype, self.device, **cache_settings(cfg)
        )
        if self.handler is None:  # per-block tok/s: the same wherever the span lies, so a move reuses it
            self.throughput = cfg.throughput or await asyncio.to_thread(
                measure_throughput, runner, self.config.hidden_size, layout, self.dtype, self.device
            )
        limits = HandlerLimits(
            idle_timeout=cfg.idle_timeout,
            max_tensor_bytes=cfg.max_tensor_bytes,
            max_step_tokens=cfg.max_step_tokens,
            max_upload_bytes=cfg.max_upload_bytes,
        )
        handler = BlockHandler(runner, caches, self.config.hidden_size, start, end, self._info, limits)
        handler.adapters = frozenset(spec.name for spec in cfg.adapters)
        handler.metrics = self.metrics
        handler.push_sender = self._push
        if cfg.fault:
            kind, _, after = cfg.fault.partition(":")
            handler.fault, handler.fault_after = kind, int(after or 0)
            logger.warning("FAULT INJECTION ENABLED: %s after %s steps (testing only)", kind, after or 0)
        return handler

    async def _drain(self) -> None:
        """Stop taking sessions, announce OFFLINE, let in-flight streams finish, then leave."""
        assert self.switch is not None and self.dht is not None
        for handler in self.switch.handlers:
            handler.accepting = False
        self.state = ServerState.OFFLINE
        await self._announce(ServerState.OFFLINE, expiration=max(self.expiration, 30.0))
        print("swarmserve worker: announced OFFLINE, draining", flush=True)
        deadline = time.monotonic() + self.cfg.drain_timeout
        while self.switch.active_streams > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handler in self.switch.handlers:
            handler.executor.shutdown(wait=False, cancel_futures=True)
        await self.checker.close()
        self.dht.shutdown()
        self.metrics.close()
        print("swarmserve worker: stopped", flush=True)

    # ------------------------------------------------------------------ DHT
    def _choose_span(self) -> tuple[int, int]:
        if self.cfg.blocks is not None:
            start, end = self.cfg.blocks
            if not 0 <= start < end <= self.total_blocks:
                raise ValueError(f"--blocks {start}:{end} is outside the model's {self.total_blocks} blocks")
            return start, end
        num = self.cfg.num_blocks or self.total_blocks
        num = min(num, self.total_blocks)
        records = fetch_block_records(self.dht, self.dht_prefix, self.total_blocks)
        return choose_best_blocks(num, spans_from_records(records), self.total_blocks)

    def _server_info(self, state: ServerState, span: tuple[int, int] | None = None) -> ServerInfo:
        tokens_left = self.handler.caches.tokens_left if self.handler else self.cache_size.tokens
        start, end = span or (self.start, self.end)
        return ServerInfo(
            state=state,
            start_block=start,
            end_block=end,
            throughput=float(self.throughput),
            cache_tokens_left=max(0, tokens_left),
            cache_tokens_total=self.cache_size.tokens,
            sessions_left=self.handler.caches.room()["sessions_left"] if self.handler else self.cfg.max_sessions,
            version=PROTOCOL_VERSION,
            dtype=str(self.dtype).removeprefix("torch."),
            quant=self.quant,
            public_name=self.cfg.public_name,
            features=(protocol.STEP_BUNDLES,),
            adapters=tuple(spec.name for spec in self.cfg.adapters),
            reachability=self.reachability,
            addrs=self.addrs,
        )

    async def _announce(
        self,
        state: ServerState,
        expiration: float | None = None,
        *,
        blocks: tuple[int, int] | None = None,
        info: ServerInfo | None = None,
    ) -> None:
        """Store ``info`` (default: my state and span) on ``blocks`` (default: my span)."""
        info = info or self._server_info(state)
        start, end = blocks or (self.start, self.end)
        ok = await asyncio.to_thread(
            declare_span, self.dht, self.dht_prefix, start, end, info, expiration or self.expiration
        )
        if not ok:
            logger.warning("could not store all DHT records (state %s); will retry", state.name)

    async def _announce_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.update_period)
            try:
                if self.handler is not None:  # detached sessions past their TTL go even on an idle server
                    self.handler.caches.expire()
                await self._announce(self.state)
            except Exception:
                logger.exception("announce failed")

    # ------------------------------------------------------------------ rebalancing
    async def _balance_loop(self) -> None:
        """Every ``rebalance_period`` (jittered): move if the swarm is better off with my blocks elsewhere.

        A planned move waits a random part of a period and is planned again from a fresh read, so of
        several servers that saw the same gap, the first to move usually settles it for the others.
        """
        period, rng = self.cfg.rebalance_period, random.Random()
        while True:
            await asyncio.sleep(jittered(period, rng))
            try:
                if await asyncio.to_thread(self._plan_move) is None:
                    continue
                await asyncio.sleep(rng.uniform(0.0, period))
                target = await asyncio.to_thread(self._plan_move)
                if target is not None:
                    await self._move(*target)
            except Exception:
                logger.exception("balance check failed; keeping blocks %d:%d", self.start, self.end)

    def _plan_move(self) -> tuple[int, int] | None:
        records = fetch_block_records(self.dht, self.dht_prefix, self.total_blocks)
        return plan_move(
            self.dht.peer_id.to_base58(),
            balancing_view(records),
            self.total_blocks,
            balance_quality=self.cfg.balance_quality,
        )

    async def _move(self, start: int, end: int) -> None:
        """Serve ``[start, end)`` instead of my span, never leaving a gap: load and go ONLINE on the new
        span before retiring the old one; streams already open on the old span run to their end."""
        assert self.switch is not None
        old = (self.start, self.end)
        print(f"swarmserve worker: rebalancing from blocks {old[0]}:{old[1]} to {start}:{end}", flush=True)
        joining = joining_range(old, (start, end))
        if joining is not None:
            info = self._server_info(ServerState.JOINING, span=(start, end))
            await self._announce(ServerState.JOINING, blocks=joining, info=info)
        handler = await self._build_handler(start, end)
        retired = self.switch.switch_to(handler)
        self.handler, self.start, self.end = handler, start, end
        await self._announce(ServerState.ONLINE)
        gone = tombstone(self._server_info(ServerState.ONLINE))
        for blocks in retired_ranges(old, (start, end)):
            await self._announce(ServerState.OFFLINE, blocks=blocks, info=gone)
        print(f"swarmserve worker: now serving blocks {start}:{end} of {self.total_blocks}", flush=True)
        await self.switch.retire(retired)

    def _info(self) -> dict:
        return {
            "version": PROTOCOL_VERSION,
            "model": self.dht_prefix,
            "start_block": self.start,
            "end_block": self.end,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "state": self.state.name,
            "throughput": self.throughput,
        }
