"""Knows the swarm: reads server records from the DHT, measures RTTs, bans failing peers, picks routes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarm_client import p2p_guard, protocol, runtime
from swarm_client.bans import Verdict, ban_verdict
from swarm_client.client_config import (  # noqa: F401 - ClientConfig & co. are imported from here too
    AUTO_GROUPS,
    AUTO_PUSH,
    DEFAULT_SPOT_CHECK_RATE,
    ClientConfig,
    check_pipeline_groups,
    parse_peer_ids,
)
from swarm_client.dht_records import (
    RemoteSpanInfo,
    fetch_block_records,
    mark_validated,
    record_validators,
    spans_from_records,
)
from swarm_client.errors import PeerError, PeerTimeout
from swarm_client.liveness import Liveness
from swarm_client.pings import Pinger, connected, ping_failure_reason
from swarm_client.precision import accepts
from swarm_client.protocol import MAX_PIPELINE_GROUPS
from swarm_client.route_making import RouteMaker
from swarm_client.routing import LOCAL_PEER, BanList, RouteHop, coverage, effective_throughputs, missing_blocks
from swarm_client.step_bundles import StepBundler
from swarm_client.step_times import StepTimes
from swarm_client.watchdog import Watchdog

if TYPE_CHECKING:
    from swarm_client.local_span import LocalSpan

logger = logging.getLogger(__name__)

#: joining the DHT may take longer than one request (hivemind's default: its request timeout, 3 s)
DHT_BOOTSTRAP_TIMEOUT = 3.0

#: steps of at most this many tokens per row are timed for ``StepTimes`` (decode steps: comparable with the
#: decode-step throughput servers announce; a prefill's time says little about a server's decode speed)
TIMED_STEP_TOKENS = 1

#: the background refresh wakes at least this often, for the watchdog (seconds)
WATCHDOG_PERIOD = 1.0


class SequenceManager(RouteMaker):
    def __init__(self, config: ClientConfig, dht: DHT | None = None):
        check_pipeline_groups(config.pipeline_groups)
        self.config = config
        if dht is None:  # validators: signed records are verified (and unwrapped) on every read
            validators = record_validators(config.dht_prefix, config.num_blocks)
            dht = DHT(
                initial_peers=config.initial_peers,
                client_mode=True,
                start=True,
                record_validators=validators,
                wait_timeout=config.dht_wait_timeout,
                bootstrap_timeout=DHT_BOOTSTRAP_TIMEOUT,
            )
            mark_validated(dht)
            self._owns_dht = True
        else:
            self._owns_dht = False
        self.dht = dht
        self.bans = BanList(base=config.ban_base, max_ban=config.ban_max)
        self.spans: dict[str, RemoteSpanInfo] = {}
        self.rtt: dict[str, float] = {}
        #: pings of new peers, in flight in the background (``pings``)
        self.pings = Pinger(self._ping, self.rtt, config.ping_timeout, config.ping_grace, config.ping_grace_factor)
        self._last_update = 0.0
        self._p2p: P2P | None = None
        self._update_lock: asyncio.Lock | None = None
        self._repings: set[asyncio.Task] = set()  # second pings, on the connection the first one opened
        #: the background task keeping ``spans`` fresh (``_keep_fresh``), started by the first read
        self._refresher: asyncio.Task | None = None
        self._sessions_dealt = 0
        self._bundlers: dict[str, StepBundler] = {}
        #: peer → monotonic time until which it counts as busy (it answered ``ServerBusyError``)
        self._busy_until: dict[str, float] = {}
        #: this client's open server sessions per peer (routing load; announcements lag behind)
        self.sessions_on: Counter[str] = Counter()
        #: pushed steps whose answer missed ``push_grace``, so the client sent its own copy after all
        self.late_pushes = 0
        #: seconds per block of this client's own decode steps, per peer (routing believes these over claims)
        self.step_times = StepTimes()
        #: blocks this client runs itself (``local_span``): one hop of every route that crosses them
        self.local: LocalSpan | None = None
        #: when each server last answered, its recent answer time, who is kept while slow (``liveness``)
        self.liveness = Liveness()
        #: resets this client's view when every server of a block is banned while ONLINE (``watchdog``)
        self.watchdog = Watchdog(self)

    @property
    def trusted_peers(self) -> list[str]:
        return self.config.trusted_peers

    def record_step(self, peer_id: str, blocks: int, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens per row over ``blocks`` blocks on ``peer_id`` answered after ``seconds``.
        Decode steps only; the peer's measured RTT is taken off (routing adds it apart), down to a quarter
        of the step at most, since one ping is a rough figure."""
        if tokens > TIMED_STEP_TOKENS or peer_id == LOCAL_PEER:
            return
        compute = max(seconds - self.rtt.get(peer_id, 0.0), seconds / 4)
        self.step_times.record(peer_id, blocks, compute)

    def effective_throughputs(self, spans: dict[str, RemoteSpanInfo] | None = None) -> dict[str, float]:
        """What routing believes of each server's tokens/s per block (``routing.effective_throughputs``) among
        ``spans`` (default: every known one)."""
        spans = self.spans if spans is None else spans
        return effective_throughputs(spans, self.step_times.throughputs(), self.config.throughput_cap_factor)

    def route_options(
        self, spans: dict[str, RemoteSpanInfo] | None = None, exclude: Iterable[str] = (), adapter: str | None = None
    ) -> dict:
        """``find_route`` keywords every route of this client uses: RTTs, bans (and ``exclude``d peers),
        believed throughputs and the trust policy (so replacements and spot checkers honour it too), and the
        session's LoRA ``adapter`` (only servers holding it)."""
        spans = self.spans if spans is None else spans
        too_coarse = self.below_min_precision(spans)
        return {
            "rtt": self.rtt,
            "banned": self.bans.banned() | set(exclude) | set(too_coarse),
            "why": {**self.bans.reasons(), **too_coarse},
            "throughput": self.effective_throughputs(spans),
            "trusted": self.config.trusted_peers,
            "num_blocks": self.config.num_blocks,
            "adapter": adapter,
        }

    def below_min_precision(self, spans: dict[str, RemoteSpanInfo]) -> dict[str, str]:
        """Servers among ``spans`` whose quantization ``config.min_precision`` rejects, with the reason."""
        wanted = self.config.min_precision
        return {
            peer: f"it serves {span.server_info.quant} weights and this client asks min_precision={wanted!r}"
            for peer, span in spans.items()
            if not accepts(wanted, span.server_info.quant)
        }

    @property
    def groups_follow_route(self) -> bool:
        """True with ``pipeline_groups="auto"``: a session's group waits for its route (``next_batch_group``)."""
        return self.config.pipeline_groups == AUTO_GROUPS

    def next_batch_group(self, chain_length: int = 1) -> int | None:
        """The pipeline group of a new session (round-robin), or None without groups.

        ``chain_length`` (servers on the session's route) sets the number of groups under "auto": a chain of
        k servers keeps all k busy with k groups, and a single server gains nothing from splitting its batch.
        """
        groups = min(chain_length, MAX_PIPELINE_GROUPS) if self.groups_follow_route else self.config.pipeline_groups
        if groups <= 1:
            return None
        self._sessions_dealt += 1
        return (self._sessions_dealt - 1) % groups

    def push_pays(self, route: list[RouteHop]) -> bool:
        """Whether a session on ``route`` asks its servers to push steps to each other (``ClientConfig.push``).

        Under "auto": push saves, at each server after the first, the client's round trip to it minus the
        servers' own one-way trip, and costs a message per hop; so it is on where some later server is at least
        ``push_min_rtt`` away (a server not measured yet counts as far: a swarm is usually spread over the
        internet) and off where every one is near (one machine, a LAN). A single server has nobody to push to.
        A client that bundles steps (``step_bundles``) does not push under "auto": a pushed step cannot travel
        in a bundle, and bundles were asked for.
        """
        # servers push only to servers: the pushes run along the remote stretches between local hops
        later = [b for a, b in zip(route, route[1:], strict=False) if LOCAL_PEER not in (a.peer_id, b.peer_id)]
        if not later or not self.config.push:
            return False
        if self.config.push is True:
            return True
        if self.config.step_bundles:  # asked for bundles: a pushed step travels alone, so "auto" leaves them be
            return False
        return any(self.rtt.get(hop.peer_id, float("inf")) >= self.config.push_min_rtt for hop in later)

    def step_bundler(self, peer_id: str) -> StepBundler | None:
        """The step bundle stream to ``peer_id``, if bundles are on and the server announces them."""
        if not self.config.step_bundles:
            return None
        span = self.spans.get(peer_id)
        if span is None or protocol.STEP_BUNDLES not in span.server_info.features:
            return None
        bundler = self._bundlers.get(peer_id)
        if bundler is None:
            bundler = self._bundlers[peer_id] = StepBundler(self, peer_id)
        return bundler

    # ------------------------------------------------------------------ transport
    async def p2p(self) -> P2P:
        if self._p2p is None:
            self._p2p = await self.dht.replicate_p2p()
        return self._p2p

    async def stub(self, peer_id: str):
        return protocol.BlockRPC.get_stub(await self.p2p(), PeerID.from_base58(peer_id))

    async def info(self, peer_id: str, timeout: float | None = None) -> dict:
        stub = await self.stub(peer_id)
        try:
            response = await stub.rpc_info(
                runtime_pb2.ExpertUID(uid=""), timeout=timeout or self.config.request_timeout
            )
        except TimeoutError as e:
            raise PeerTimeout(f"peer {peer_id} did not answer info within {timeout}s") from e
        except Exception as e:
            raise PeerError(f"peer {peer_id} info failed: {e}") from e
        return protocol.unpack_metadata(response.serialized_info)

    # ------------------------------------------------------------------ swarm view
    async def update(self, force: bool = False, max_age: float | None = None) -> dict[str, RemoteSpanInfo]:
        """The swarm's spans, re-read from the DHT when ``force``d or older than ``max_age``. Without
        ``max_age`` (routing), a view exists once read and is kept fresh in the background every
        ``update_period`` (``_keep_fresh``), so a request never waits on the DHT unless routing failed on the
        view it has (``force``). One read at a time: callers that queue behind it get its result."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        if not force and self.spans:
            if max_age is None and self._refresher is not None and not self._refresher.done():
                return self.spans
            limit = self.config.update_period if max_age is None else max_age
            if time.monotonic() - self._last_update < limit:
                return self.spans
        read_since = self._last_update
        async with self._update_lock:
            if self._last_update != read_since and not force:
                return self.spans  # read while this caller queued
            records = await asyncio.to_thread(
                fetch_block_records, self.dht, self.config.dht_prefix, self.config.num_blocks
            )
            spans = spans_from_records(records)
            self.pings.start(spans, self.bans.banned())
            await self.pings.settle(spans, self.bans.banned)
            self.spans = spans
            self._last_update = time.monotonic()
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(self._keep_fresh(), name="swarm view refresh")
        return spans

    def start_discovery(self) -> None:
        """Read the swarm view and ping its servers in the background, now: the first request then finds them
        measured (``from_pretrained`` calls this before loading the local weights). A failure is only logged:
        that request reads the DHT itself and gets the error."""

        def done(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                logger.debug("background swarm discovery failed: %r", future.exception())

        asyncio.run_coroutine_threadsafe(self.update(), runtime.get_loop()).add_done_callback(done)

    async def _keep_fresh(self) -> None:
        """Re-read the swarm view every ``update_period`` in the background (Petals does the same), so routing
        reads a view at most that old without waiting on the DHT. A failed read is retried next period."""
        period = self.config.update_period
        next_read = self._last_update + period
        while True:
            await asyncio.sleep(min(max(next_read - time.monotonic(), 0.05), WATCHDOG_PERIOD))
            try:
                await self.watchdog.check()
            except Exception:  # the watchdog must never stop the refresh
                logger.exception("swarm client watchdog failed")
            next_read = self._last_update + period  # a forced read may have come in between
            if time.monotonic() < next_read:
                continue
            try:
                await self.update(max_age=period)
                next_read = self._last_update + period
            except Exception as e:  # the DHT is unreachable for now: keep the view, try again later
                logger.debug("background swarm view refresh failed: %r", e)
                next_read = time.monotonic() + period

    async def _ping(self, peer_id: str, span: RemoteSpanInfo) -> None:
        """Measure ``peer_id``'s RTT, or ban it with the reason (``pings.ping_failure_reason``), naming the
        addresses ``span`` (its record in the swarm view being read) announces."""
        t0 = time.perf_counter()
        try:
            await self.info(peer_id, timeout=self.config.ping_timeout)
        except PeerError as e:  # a timeout on a live connection is load (slow); without one, a failed dial
            slow = isinstance(e, PeerTimeout) and await connected(await self.p2p(), peer_id)
            reason = ping_failure_reason(e, self.config.ping_timeout, span.server_info.addrs, connected=slow)
            self.ban(peer_id, reason, slow=slow)
            return
        self.liveness.answered(peer_id, time.perf_counter() - t0)
        first = self.rtt.setdefault(peer_id, time.perf_counter() - t0)  # a figure set meanwhile (tests) stands
        # that ping also dialed the peer (TCP and security handshakes: 2-3 round trips): a second one, on the open
        # connection, measures the RTT itself (what ``push_pays`` weighs), in the background (routing goes on)
        task = asyncio.get_running_loop().create_task(self._ping_again(peer_id, first), name=f"re-ping {peer_id}")
        self._repings.add(task)
        task.add_done_callback(self._repings.discard)

    async def _ping_again(self, peer_id: str, first: float) -> None:
        with contextlib.suppress(PeerError):
            t0 = time.perf_counter()
            await self.info(peer_id, timeout=self.config.ping_timeout)
            if self.rtt.get(peer_id) == first:
                self.rtt[peer_id] = min(first, time.perf_counter() - t0)

    def mark_busy(self, peer_id: str, reason: str) -> None:
        """``peer_id`` is full for now: routing avoids it for ``busy_mark`` seconds. Not a ban: a full
        server is not a broken one, and it takes sessions again as soon as it has room."""
        self._busy_until[peer_id] = time.monotonic() + self.config.busy_mark
        logger.info("server %s is busy, routing around it for %.1fs: %s", peer_id, self.config.busy_mark, reason)

    def busy_peers(self) -> set[str]:
        now = time.monotonic()
        for peer in [p for p, until in self._busy_until.items() if until <= now]:
            del self._busy_until[peer]
        return set(self._busy_until)

    def ban(self, peer_id: str, reason: str, slow: bool = False) -> bool:
        """Ban ``peer_id`` for a failure (``bans.BanList``: once per ban window, backoff from its latency);
        True if it is banned. A ``slow`` failure (a timeout: no evidence of death) of the only usable server
        of some block bans nothing: the server is noted slow (``/v1/swarm``) and the client waits for it."""
        holders = dict(enumerate(coverage(self.spans, self.config.num_blocks)))
        if ban_verdict(peer_id, slow, holders, self.bans.banned()) is Verdict.KEEP_SLOW:
            note = self.liveness.note_slow(peer_id, reason)
            logger.info(
                "peer %s is slow but the only server of some blocks, kept (%d×): %s", peer_id, note.times, reason
            )
            return False
        if self.bans.is_banned(peer_id):
            return True  # the same failure, seen by another session: one decision per ban window
        latency = self.liveness.latency(peer_id) or self.rtt.get(peer_id)
        seconds = self.bans.ban(peer_id, reason=reason, latency=latency)
        self.rtt.pop(peer_id, None)
        logger.warning("banning peer %s for %.1fs: %s", peer_id, seconds, reason)
        return True

    def fault(self, peer_id: str, error: BaseException) -> bool:
        """``peer_id`` failed with ``error``: ``ban`` it, as slow when that was a timeout (no evidence of death)."""
        return self.ban(peer_id, str(error), slow=isinstance(error, PeerTimeout))

    def answered(self, peer_id: str, seconds: float | None = None) -> None:
        """``peer_id`` answered (a step, an open, a ping): alive, so its ban is lifted and its backoff reset."""
        self.bans.report_success(peer_id)
        self.liveness.answered(peer_id, seconds)

    async def renew_p2p_if_dead(self) -> bool:
        """Open a new p2p client if the current one's unary reader died (``p2p_guard``); True if it did."""
        if self._p2p is None or p2p_guard.unary_reader_alive(self._p2p):
            return False
        old = self._p2p
        # ``DHT.replicate_p2p`` caches its replica (the dead one): a new replica of the same daemon replaces it
        self._p2p = self.dht._p2p_replica = await P2P.replicate(old._daemon_listen_maddr)
        self._bundlers.clear()  # their streams ran on the old client
        with contextlib.suppress(Exception):
            await old.shutdown()
        return True

    def missing_blocks(self) -> list[int]:
        """Blocks neither a server nor this client (``local``) runs."""
        local = range(self.local.start, self.local.end) if self.local is not None else range(0)
        return [b for b in missing_blocks(self.spans, self.config.num_blocks) if b not in local]

    def shutdown(self) -> None:
        """Close the replicated P2P client on the I/O loop that opened it, then the DHT if this owns it.

        A P2P client left open is collected later with a pending connection task, after its loop is gone
        ("Task was destroyed but it is pending", errors raised from hivemind's ``__del__``)."""
        self.pings.cancel()
        if self.local is not None:
            self.local.shutdown()
        refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.get_loop().call_soon_threadsafe(refresher.cancel)
        p2p, self._p2p = self._p2p, None
        bundlers, self._bundlers = list(self._bundlers.values()), {}
        if bundlers:

            async def close_bundlers() -> None:
                await asyncio.gather(*(b.close() for b in bundlers), return_exceptions=True)

            with contextlib.suppress(Exception):
                if runtime.on_io_loop():
                    runtime.get_loop().create_task(close_bundlers())
                else:
                    runtime.run(close_bundlers(), timeout=5)
        if p2p is not None:
            with contextlib.suppress(Exception):
                if runtime.on_io_loop():
                    runtime.get_loop().create_task(p2p.shutdown())
                else:
                    runtime.run(p2p.shutdown(), timeout=5)
        if self._owns_dht:
            self.dht.shutdown()
