"""One span's bidirectional stream to one server: open, step at explicit positions, close.

A ``_ServerSession`` holds no client-side history; ``session.InferenceSession`` keeps that (``history``)
and decides what to do when a stream fails (``failover``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import torch

from swarm_client import capabilities, protocol
from swarm_client.bans import Verdict, ban_verdict
from swarm_client.client_config import ClientConfig
from swarm_client.errors import (
    PeerError,
    PeerTimeout,
    PushMismatchError,
    SessionNotFoundError,
    SwarmError,
    error_from_wire,
)
from swarm_client.local_span import LocalSession
from swarm_client.lora import adapter_field
from swarm_client.routing import LOCAL_PEER, RouteHop, coverage
from swarm_client.sequence_manager import SequenceManager

#: steps up to this size travel in step bundles (decode steps); larger ones (prefills) on their own stream
BUNDLE_MAX_BYTES = 2**18


def ping_timeout(config: ClientConfig, step_bytes: int) -> float:
    """How long a liveness ping of a silent step's server may take: ``silent_ping_timeout``, plus the time the
    step's bytes may hold the shared connection on a slow link (``slow_link_bytes_per_s``): over a WAN a long
    prefill's megabyte of activations keeps a ping waiting behind it for seconds, while the server is alive."""
    return config.silent_ping_timeout + max(step_bytes, 0) / config.slow_link_bytes_per_s


class _ServerSession:
    """One server's stream: open, step at explicit positions, close (optionally keeping the cache)."""

    #: a server, not the client's own blocks (``local_span.LocalSession``)
    local = False

    def __init__(
        self,
        manager: SequenceManager,
        hop: RouteHop,
        session_id: str,
        batch_group: int | None = None,
        adapter: str | None = None,
    ):
        self.manager = manager
        self.hop = hop
        self.session_id = session_id
        #: the served LoRA adapter the session runs with (sent at open); None: the base model
        self.adapter = adapter
        #: the pipeline group sent with every step (``ClientConfig.pipeline_groups``); None: no group
        self.batch_group = batch_group
        self.position = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        self._responses: AsyncIterator | None = None
        #: responses (or the exception that ended the stream) pulled by one reader task per stream, so a
        #: timed-out wait can be abandoned without cancelling the transport's generator mid-message
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self.closed = False
        self._counted = False  # in ``manager.sessions_on`` while open
        #: the open's answer is still to be read (``open(wait=False)``): the next step reads it first
        self._open_pending = False
        #: the newest step counter the server ran for this session (a resumed one continues above it)
        self.server_seq = 0
        #: bytes of the step in flight: a liveness ping shares its connection and may queue behind them
        self._step_bytes = 0

    def push_target(self, step_id: str, position: int, seq: int) -> dict:
        """How the previous server of a chain pushes this one step into this session (``protocol``,
        ``rpc_push``): an authorization of exactly this step, never the session's push key itself."""
        auth = capabilities.push_auth(self.session_id, step_id, position, seq)
        return {"peer_id": self.hop.peer_id, "session_id": self.session_id, "push_auth": auth}

    async def _requests(self):
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    async def _read_responses(self) -> None:
        try:
            async for response in self._responses:
                self._inbox.put_nowait(response)
            self._inbox.put_nowait(StopAsyncIteration())
        except Exception as e:
            self._inbox.put_nowait(e)

    async def _next_response(self, timeout: float):
        """The next response. A server silent past ``probe_after`` is pinged (while the wait goes on): a refused
        ping (a SIGKILLed worker whose p2p daemon still holds the connection) fails the step at once, and
        ``silent_pings`` pings in a row unanswered within ``silent_ping_timeout`` (a stopped or frozen server,
        a cut link) fail it as ``PeerTimeout``. A busy server answers pings at once: it waits for its step.
        Load is not death: a ping may take 4× the server's recent answer time (``liveness``), a missed ping
        does not count while the server answers other sessions' steps, and the only usable server of some
        block is never failed for silence — the step waits for it up to ``timeout`` (it is noted slow)."""
        config = self.manager.config
        peer = self.hop.peer_id
        started = time.monotonic()
        deadline, next_probe = started + timeout, started + config.probe_after
        getter = asyncio.ensure_future(self._inbox.get())
        probe: asyncio.Task | None = None
        misses, probed_at, ping_timeout_s = 0, started, 0.0
        liveness = self.manager.liveness
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise PeerTimeout(f"server {peer} did not answer within {timeout:.1f}s", peer)
                waits = {getter} if probe is None else {getter, probe}
                until = deadline if probe is not None else min(deadline, next_probe)
                await asyncio.wait(waits, timeout=max(until - now, 0.0), return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    return getter.result()
                if probe is not None and probe.done():
                    error, probe = probe.exception(), None
                    if error is None:  # alive (busy): keep waiting, probe again later
                        liveness.answered(peer, time.monotonic() - probed_at)
                        misses, next_probe = 0, time.monotonic() + config.probe_after
                    elif isinstance(error, PeerTimeout) and liveness.heard_since(peer, probed_at):
                        misses, next_probe = 0, time.monotonic() + config.probe_after  # loaded, not gone
                    elif isinstance(error, PeerTimeout):
                        misses, next_probe = misses + 1, time.monotonic()  # ping again at once
                        if misses >= config.silent_pings and not self._only_server():
                            raise PeerTimeout(
                                f"server {peer} went silent: no answer to its step for "
                                f"{time.monotonic() - started:.1f}s, nor to {misses} pings in a row "
                                f"({ping_timeout_s:.2f}s each)",
                                peer,
                            ) from error
                        if misses >= config.silent_pings:  # the only server of some block: wait, say it is slow
                            silent = f"silent for {time.monotonic() - started:.1f}s, kept: the only server"
                            liveness.note_slow(peer, silent)
                            misses, next_probe = 0, time.monotonic() + config.probe_after
                    else:  # refused: the server process is gone even if its connection lingers
                        raise PeerError(f"server {peer} stopped answering: {error}", peer) from error
                elif probe is None and time.monotonic() >= next_probe:
                    allowed = liveness.allowance(peer, ping_timeout(config, self._step_bytes))
                    ping_timeout_s = min(allowed, max(deadline - time.monotonic(), 0.001))
                    probed_at = time.monotonic()
                    probe = asyncio.ensure_future(self.manager.info(peer, timeout=ping_timeout_s))
        finally:
            if not getter.done():
                getter.cancel()
            if probe is not None:
                probe.cancel()

    def _only_server(self) -> bool:
        """Whether this server is the only usable one of some of its blocks: silence alone does not fail it
        then (the client waits, up to the step's timeout; ``bans.ban_verdict``)."""
        m = self.manager
        holders = dict(enumerate(coverage(m.spans, m.config.num_blocks)))
        return ban_verdict(self.hop.peer_id, True, holders, m.bans.banned()) is Verdict.KEEP_SLOW

    async def _exchange(self, request, timeout: float, step_id: str | None = None) -> tuple[list[torch.Tensor], dict]:
        """Send ``request`` and return its answer. With ``step_id``, answers to other steps (a pushed copy
        of a step the client later redid elsewhere) are skipped. After an ``open(wait=False)``, the open's
        answer is read first (its error, if any, is this call's)."""
        self._queue.put_nowait(request)
        if self._open_pending:
            await self._open_answer(timeout)
        return await self._answer(timeout, step_id)

    async def _pushed_or_exchange(
        self, request, timeout: float, step_id: str | None, expect_push: bool
    ) -> tuple[list[torch.Tensor], dict]:
        """The answer to a step the previous server pushed here, if it comes within ``push_grace``; else the
        client's own copy goes (the server runs whichever copy comes first and answers once). Skipping the
        copy halves the client's messages per pushed hop, which is what 4 streams on one client wait on."""
        if expect_push and step_id is not None:
            if self._open_pending:
                await self._open_answer(timeout)
            try:
                return await self._answer(self.push_grace(), step_id)
            except PeerTimeout:
                self.manager.late_pushes += 1
        return await self._exchange(request, timeout, step_id)

    def push_grace(self) -> float:
        """How long a pushed step's answer may take, counted from the moment the client got the previous hop's
        output. The previous server sent it here and to the client at once, so by the triangle inequality the
        push's answer is due within one client↔server RTT plus the server's compute: a quarter more, 10 ms of
        slack, 1 s at most. Unmeasured server: 0, the copy goes at once."""
        rtt = self.manager.rtt.get(self.hop.peer_id)
        if rtt is None:
            return 0.0
        per_block = self.manager.step_times.seconds_per_block(self.hop.peer_id) or 0.0
        return min(1.0, 1.25 * (rtt + per_block * self.hop.length) + 0.01)

    async def _open_answer(self, timeout: float) -> None:
        self._open_pending = False
        _, metadata = await self._answer(timeout)
        self.position = int(metadata.get("position", 0))
        seq = metadata.get("seq", 0)
        self.server_seq = seq if capabilities.is_count(seq) else 0

    async def _answer(self, timeout: float, step_id: str | None = None) -> tuple[list[torch.Tensor], dict]:
        """The answer to the step in flight, from this stream or from a step bundle (``step_bundles``)."""
        deadline = time.monotonic() + timeout
        while True:
            response = await self._next_response(max(deadline - time.monotonic(), 0.001))
            if isinstance(response, StopAsyncIteration):
                raise PeerError(f"server {self.hop.peer_id} closed the stream", self.hop.peer_id)
            if isinstance(response, SwarmError):
                raise response
            if isinstance(response, Exception):
                raise PeerError(f"server {self.hop.peer_id} stream failed: {response}", self.hop.peer_id) from response
            if isinstance(response, tuple):  # delivered by a step bundle, already unpacked
                serialized, metadata = response
            else:
                serialized, metadata = response.tensors, protocol.unpack_metadata(response.metadata)
            answered = metadata.get("step_id")
            if step_id is None or answered is None or answered == step_id:
                break
        if "error" in metadata:
            raise error_from_wire(metadata["error"], peer_id=self.hop.peer_id)
        return [protocol.deserialize(t) for t in serialized], metadata

    async def open(self, max_length: int, batch_size: int, resume: bool, timeout: float, wait: bool = True) -> int:
        """Open (or resume) the session on the server; returns the tokens it holds. Without ``wait`` the open
        is only sent: the first step goes right behind it on the stream (open and prefill in one round trip)
        and reads its answer first, so a refusal surfaces there."""
        stub = await self.manager.stub(self.hop.peer_id)
        try:
            self._responses = await asyncio.wait_for(stub.rpc_inference(self._requests()), timeout)
        except Exception as e:
            raise PeerError(f"could not open a stream to {self.hop.peer_id}: {e}", self.hop.peer_id) from e
        self._reader = asyncio.create_task(self._read_responses())
        spec = {
            "session_id": self.session_id,
            "max_length": max_length,
            "batch_size": batch_size,
            "resume": resume,
            "resume_token": capabilities.resume_token(self.session_id),
            "push_token": capabilities.push_token(self.session_id),
            "start_block": self.hop.start,
            "end_block": self.hop.end,
            **adapter_field(self.adapter),
        }
        self._queue.put_nowait(protocol.make_request(open=spec))
        self._open_pending = True
        if wait:
            await self._open_answer(timeout)
        if not self._counted:  # routing's view of this client's load on the server
            self._counted = True
            self.manager.sessions_on[self.hop.peer_id] += 1
        return self.position

    def _to_wire(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` in the dtype the server computes in (its DHT record's ``dtype``), as ``rpc_forward``
        sends it: a bfloat16 server gets 2 bytes a value on every hop, the first (fed by the client's
        float32 embeddings) included. Unknown dtype: sent as is (the server casts on arrival)."""
        dtype = protocol.wire_dtype(self.manager.spans.get(self.hop.peer_id))
        return hidden if dtype is None or not hidden.is_floating_point() else hidden.to(dtype)

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
        """One step; ``push_chain`` (the next hops' ``push_target``s) asks the server to push its output on to
        the first of them (see ``protocol``). ``expect_push``: the previous server pushed this step here, so
        its answer is awaited first (``push_grace``) and the client's own copy is sent only if it is late.
        ``seq``: the session's step counter, which orders steps on the server (a push older than the last
        step run there is stale and dropped)."""
        digest = protocol.input_digest(hidden) if expect_push else None  # what the previous server answered us
        hidden = self._to_wire(hidden)
        extra: dict = {} if step_id is None else {"step_id": step_id, "push_chain": push_chain or []}
        if seq is not None:
            extra["seq"] = seq
        if self.batch_group is not None:
            extra["batch_group"] = self.batch_group
        compression = self.manager.config.compression
        bundler = None
        if step_id is None and not self._open_pending and hidden.numel() * hidden.element_size() <= BUNDLE_MAX_BYTES:
            bundler = self.manager.step_bundler(self.hop.peer_id)
        self._step_bytes = hidden.numel() * hidden.element_size()  # what may hold the connection (≈ its answer)
        if bundler is not None:  # one message with the other sessions' steps to this server
            step = {"session_id": self.session_id, "position": position, **extra}
            if output_hidden_states:
                step["output_hidden_states"] = True
            bundler.submit(self._inbox, protocol.serialize(hidden, compression), step)
            tensors, metadata = await self._answer(timeout)
        else:
            request = protocol.make_request(
                [hidden],
                compression=compression,
                position=position,
                output_hidden_states=output_hidden_states,
                compression_out=compression,
                **extra,
            )
            tensors, metadata = await self._pushed_or_exchange(request, timeout, step_id, expect_push)
        expected = (self.hop.end - self.hop.start, *hidden.shape) if output_hidden_states else tuple(hidden.shape)
        if len(tensors) != 1 or tuple(tensors[0].shape) != expected:
            got = [tuple(t.shape) for t in tensors]
            raise PeerError(f"server {self.hop.peer_id} returned shapes {got}, expected {expected}", self.hop.peer_id)
        out = tensors[0]
        ran = metadata.get("input_digest")  # set when the server ran the pushed copy: it must be what we got
        if digest is not None and ran is not None and ran != digest:
            raise PushMismatchError(
                f"server {self.hop.peer_id} ran a pushed step whose input differs from the previous server's answer"
            )
        if not torch.isfinite(out).all():
            raise PeerError(f"server {self.hop.peer_id} returned non-finite activations", self.hop.peer_id)
        self.position = int(metadata.get("position", position + hidden.shape[1]))
        return out

    async def close(self, keep: bool = False, wait: bool = True) -> None:
        """Tell the server whether to keep the cache, end our side, and let the stream wind down (without
        ``wait``: a failed server's stream is dropped at once; the server frees the session when it notices)."""
        if self.closed:
            return
        self.closed = True
        if self._counted:
            self._counted = False
            self.manager.sessions_on[self.hop.peer_id] -= 1
        if self._responses is not None:
            self._queue.put_nowait(protocol.make_request(close={"keep": keep}))
        self._queue.put_nowait(None)
        if self._reader is not None and not wait:
            self._reader.cancel()
        elif self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
            except Exception:
                self._reader.cancel()  # the server frees the session when the stream breaks anyway


async def close_all(sessions: list[_ServerSession], keep: bool = False) -> None:
    """Close every session at once; a failure to close one is not an error (its server frees it anyway)."""
    await asyncio.gather(*(s.close(keep=keep) for s in sessions), return_exceptions=True)


def hop_session(
    manager: SequenceManager, hop: RouteHop, session_id: str, batch_group: int | None = None, adapter: str | None = None
) -> _ServerSession | LocalSession:
    """The session of one hop: a stream to its server, or for the local hop (``LOCAL_PEER``) the local blocks'
    (which never carry a served adapter: ``SequenceManager.make_route`` keeps adapter sessions off them)."""
    if hop.peer_id != LOCAL_PEER:
        return _ServerSession(manager, hop, session_id, batch_group, adapter)
    if manager.local is None:
        raise SessionNotFoundError("a hop runs on the local blocks, but this client holds none", LOCAL_PEER)
    return LocalSession(manager.local, hop, session_id)


def push_chain(
    hops: list[_ServerSession | LocalSession], index: int, step_id: str | None, position: int, seq: int
) -> list[dict]:
    """Where hop ``index``'s server pushes its output of step ``step_id``: the next hops up to the first local
    one (servers push only to servers; the client feeds the local blocks and sends their output on), each
    with the authorization of this step alone. No step id: no push, an empty chain."""
    chain: list[dict] = []
    for hop in hops[index + 1 :] if step_id is not None else ():
        if hop.local:
            break
        chain.append(hop.push_target(step_id, position, seq))
    return chain
