"""An inference session across a chain of servers, with failover.

Each hop of the route gets one bidirectional stream (``_ServerSession``) whose KV cache lives on that
server. The client keeps, per hop, every hidden state it has sent (``history``), so when a server dies
the same span is re-routed (possibly over several servers), the history is replayed *at position 0 of
the new sessions*, and the step continues at the right position — the bug that breaks Petals' failover.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator

import torch

from swarm_client import protocol, runtime
from swarm_client.errors import (
    CacheExhaustedError,
    InvalidInputError,
    LengthExceededError,
    NoRouteError,
    PeerError,
    PeerTimeout,
    RemoteError,
    SessionLost,
    SessionNotFoundError,
    SwarmError,
    error_from_wire,
)
from swarm_client.routing import RouteHop, find_route
from swarm_client.sequence_manager import SequenceManager

logger = logging.getLogger(__name__)

#: errors that are the caller's fault: never retried on another server
CALLER_ERRORS = (InvalidInputError, LengthExceededError)
#: steps larger than this are not pushed server to server (a push is one unary message; prefills are rare)
PUSH_MAX_BYTES = 2**18
#: steps up to this size travel in step bundles (decode steps); larger ones (prefills) on their own stream
BUNDLE_MAX_BYTES = 2**18


class _ServerSession:
    """One server's stream: open, step at explicit positions, close (optionally keeping the cache)."""

    def __init__(self, manager: SequenceManager, hop: RouteHop, session_id: str, batch_group: int | None = None):
        self.manager = manager
        self.hop = hop
        self.session_id = session_id
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
        """The next response; a server that is silent past ``probe_after`` is pinged, and a failed ping
        (a SIGKILLed worker whose p2p daemon still holds the connection) fails the step at once."""
        config = self.manager.config
        deadline = time.monotonic() + timeout
        wait = min(config.probe_after, timeout)
        while True:
            try:
                async with asyncio.timeout(wait):
                    return await self._inbox.get()
            except TimeoutError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerTimeout(
                        f"server {self.hop.peer_id} did not answer within {timeout:.1f}s", self.hop.peer_id
                    ) from None
                try:
                    await self.manager.info(self.hop.peer_id, timeout=min(config.ping_timeout, remaining))
                except PeerTimeout:
                    pass  # a slow ping proves nothing (a busy server); keep waiting until the step timeout
                except PeerError as e:  # refused: the server process is gone even if its connection lingers
                    raise PeerError(f"server {self.hop.peer_id} stopped answering: {e}", self.hop.peer_id) from e
                wait = min(config.probe_after, max(deadline - time.monotonic(), 0.001))

    async def _exchange(
        self, request, timeout: float, step_id: str | None = None
    ) -> tuple[list[torch.Tensor], dict]:
        """Send ``request`` and return its answer. With ``step_id``, answers to other steps (a pushed copy
        of a step the client later redid elsewhere) are skipped."""
        self._queue.put_nowait(request)
        return await self._answer(timeout, step_id)

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
                raise PeerError(
                    f"server {self.hop.peer_id} stream failed: {response}", self.hop.peer_id
                ) from response
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

    async def open(self, max_length: int, batch_size: int, resume: bool, timeout: float) -> int:
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
            "start_block": self.hop.start,
            "end_block": self.hop.end,
        }
        _, metadata = await self._exchange(protocol.make_request(open=spec), timeout)
        self.position = int(metadata.get("position", 0))
        return self.position

    async def step(
        self,
        hidden: torch.Tensor,
        position: int,
        timeout: float,
        output_hidden_states: bool = False,
        step_id: str | None = None,
        push_chain: list[dict] | None = None,
    ) -> torch.Tensor:
        """One step; ``push_chain`` (the next hops' peer and session ids) asks the server to push its
        output on to the first of them (see ``protocol``)."""
        extra = {} if step_id is None else {"step_id": step_id, "push_chain": push_chain or []}
        if self.batch_group is not None:
            extra["batch_group"] = self.batch_group
        compression = self.manager.config.compression
        bundler = None
        if step_id is None and hidden.numel() * hidden.element_size() <= BUNDLE_MAX_BYTES:
            bundler = self.manager.step_bundler(self.hop.peer_id)
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
            tensors, metadata = await self._exchange(request, timeout, step_id)
        expected = (self.hop.end - self.hop.start, *hidden.shape) if output_hidden_states else tuple(hidden.shape)
        if len(tensors) != 1 or tuple(tensors[0].shape) != expected:
            got = [tuple(t.shape) for t in tensors]
            raise PeerError(f"server {self.hop.peer_id} returned shapes {got}, expected {expected}", self.hop.peer_id)
        out = tensors[0]
        if not torch.isfinite(out).all():
            raise PeerError(f"server {self.hop.peer_id} returned non-finite activations", self.hop.peer_id)
        self.position = int(metadata.get("position", position + hidden.shape[1]))
        return out

    async def close(self, keep: bool = False) -> None:
        """Tell the server whether to keep the cache, end our side, and let the stream wind down."""
        if self.closed:
            return
        self.closed = True
        if self._responses is not None:
            self._queue.put_nowait(protocol.make_request(close={"keep": keep}))
        self._queue.put_nowait(None)
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
            except Exception:
                self._reader.cancel()  # the server frees the session when the stream breaks anyway


class HistoryBuffer:
    """The hidden states sent to one hop, ``[B, length, H]``, appended in chunks (no quadratic copying).

    A session resumed from another request starts with an *unknown* prefix (the inputs were sent by
    someone else); such a hop can be extended but not replayed, so its failure ends the session.
    """

    def __init__(self, unknown_prefix: int = 0) -> None:
        self.chunks: list[torch.Tensor] = []
        self.unknown = unknown_prefix
        self.length = unknown_prefix

    def write(self, position: int, x: torch.Tensor) -> None:
        self.truncate(position)
        if position != self.length:
            raise SessionLost(f"history gap: writing at {position} but {self.length} tokens are recorded")
        self.chunks.append(x)
        self.length += x.shape[1]

    def truncate(self, position: int) -> None:
        if position >= self.length:
            return
        if position <= self.unknown:
            self.chunks, self.unknown, self.length = [], position, position
            return
        kept, total = [], self.unknown
        for chunk in self.chunks:
            if total + chunk.shape[1] <= position:
                kept.append(chunk)
                total += chunk.shape[1]
            else:
                if position > total:
                    kept.append(chunk[:, : position - total])
                break
        self.chunks, self.length = kept, position

    def read(self, position: int) -> torch.Tensor | None:
        if position == 0:
            return None
        if self.unknown > 0:
            raise SessionLost(
                f"a server of a resumed session failed and its first {self.unknown} inputs are not known here; "
                "start a new session (re-prefill)"
            )
        return torch.cat(self.chunks, dim=1)[:, :position]


class InferenceSession:
    """KV-cached, position-tracked generation over blocks ``[start, end)``; async core, sync wrappers.

    ``step(hidden, position=None)`` feeds ``hidden`` ``[B, T, H]`` at ``position`` (default: the end) and
    returns the span's output. Passing a smaller position rolls the servers' caches back first.
    """

    def __init__(
        self,
        manager: SequenceManager,
        start: int,
        end: int,
        max_length: int,
        batch_size: int = 1,
        session_id: str | None = None,
        keep_on_close: bool = False,
    ):
        self.manager = manager
        self.start, self.end = start, end
        self.max_length = max_length
        self.batch_size = batch_size
        self.session_id = session_id or uuid.uuid4().hex
        self.keep_on_close = keep_on_close
        #: pipeline group; under ``pipeline_groups="auto"`` dealt when the chain is first routed
        self.batch_group = None if manager.groups_follow_route else manager.next_batch_group()
        self._group_dealt = not manager.groups_follow_route
        self.position = 0
        self.closed = False
        self._hops: list[_ServerSession] = []
        self._history: list[HistoryBuffer] = []  # per hop: the inputs sent so far
        self._sub_ids = 0
        self.failovers = 0
        self.spot_checks = 0
        self.spot_check_failures = 0
        #: optional token ids fed so far, maintained by the model (not by the session)
        self.token_ids: list[int] = []

    # ------------------------------------------------------------------ context managers
    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> InferenceSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ public API
    def step(
        self, hidden: torch.Tensor, position: int | None = None, output_hidden_states: bool = False
    ) -> torch.Tensor:
        return runtime.run(self.astep(hidden, position, output_hidden_states))

    def close(self) -> None:
        if not self.closed:
            runtime.run(self.aclose())

    def rollback(self, position: int) -> None:
        """Forget tokens after ``position``; the next step overwrites the servers' caches from there."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot roll back to {position}; session holds {self.position} tokens")
        self.position = position
        for history in self._history:
            history.truncate(position)
        del self.token_ids[position:]

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        await asyncio.gather(*(hop.close(keep=self.keep_on_close) for hop in self._hops), return_exceptions=True)

    async def astep(
        self, hidden: torch.Tensor, position: int | None = None, output_hidden_states: bool = False
    ) -> torch.Tensor:
        if self.closed:
            raise SessionLost("the inference session is closed")
        if hidden.ndim != 3 or hidden.shape[0] != self.batch_size:
            raise InvalidInputError(
                f"expected hidden states [batch={self.batch_size}, tokens, hidden], got {tuple(hidden.shape)}"
            )
        position = self.position if position is None else position
        if position != self.position:
            self.rollback(position)
        length = hidden.shape[1]
        if position + length > self.max_length:
            raise LengthExceededError(
                f"{position} cached + {length} new tokens exceed the session's max_length {self.max_length}"
            )
        if not self._hops:
            await self._build_chain(0, self.start, self.end)
        chunk = max(
            1,
            protocol.MAX_STEP_BYTES // max(1, hidden[0, 0].numel() * hidden.element_size() * self.batch_size),
        )
        outputs = []
        for offset in range(0, length, chunk):
            piece = hidden[:, offset : offset + chunk]
            outputs.append(await self._step_chain(piece, position + offset, output_hidden_states))
        self.position = position + length
        dim = 2 if output_hidden_states else 1
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=dim)

    # ------------------------------------------------------------------ internals
    def _deal_group(self, chain_length: int) -> None:
        """Under ``pipeline_groups="auto"``: the session's group, once, from its first route's length."""
        if not self._group_dealt:
            self.batch_group = self.manager.next_batch_group(chain_length)
            self._group_dealt = True

    def _new_sub_id(self) -> str:
        self._sub_ids += 1
        return f"{self.session_id}" if self._sub_ids == 1 else f"{self.session_id}.{self._sub_ids}"

    async def _open_hops(self, hops: list[RouteHop]) -> list[_ServerSession]:
        opened: list[_ServerSession] = []
        timeout = self.manager.config.connect_timeout
        try:
            for hop in hops:
                session = _ServerSession(
                    self.manager,
                    hop,
                    f"{self.session_id}:{hop.start}:{hop.end}:{uuid.uuid4().hex[:8]}",
                    self.batch_group,
                )
                opened.append(session)
                await session.open(self.max_length, self.batch_size, resume=False, timeout=timeout)
                self.manager.bans.report_success(hop.peer_id)
        except BaseException:
            await asyncio.gather(*(s.close() for s in opened), return_exceptions=True)
            raise
        return opened

    async def _build_chain(self, index: int, start: int, end: int) -> None:
        """Route ``[start, end)`` and open streams, banning servers that fail until the deadline."""
        deadline = time.monotonic() + self.manager.config.failover_deadline
        while True:
            try:
                hops = await self.manager.make_route(start, end, cache_tokens_needed=self.max_length * self.batch_size)
                self._deal_group(len(hops))
                sessions = await self._open_hops(hops)
                break
            except CALLER_ERRORS:
                raise
            except NoRouteError:
                if time.monotonic() + 0.5 > deadline:
                    raise
                await asyncio.sleep(0.5)
            except (PeerError, RemoteError) as e:
                if getattr(e, "peer_id", None):
                    self.manager.ban(e.peer_id, str(e))
                if time.monotonic() > deadline:
                    raise
        self._hops[index:index] = sessions
        self._history[index:index] = [HistoryBuffer() for _ in sessions]

    async def _step_chain(self, hidden: torch.Tensor, position: int, output_hidden_states: bool) -> torch.Tensor:
        deadline = time.monotonic() + self.manager.config.failover_deadline
        x = hidden
        states: list[torch.Tensor] = []
        push = (
            self.manager.config.push
            and not output_hidden_states
            and hidden.numel() * hidden.element_size() <= PUSH_MAX_BYTES
        )
        step_id = uuid.uuid4().hex if push else None
        index = 0
        while index < len(self._hops):
            hop = self._hops[index]
            chain = [{"peer_id": h.hop.peer_id, "session_id": h.session_id} for h in self._hops[index + 1 :]]
            try:
                out = await hop.step(
                    x, position, self.manager.config.step_timeout, output_hidden_states, step_id, chain
                )
                if not output_hidden_states:
                    await self._spot_check(index, hop.hop, x, out, position)
            except CALLER_ERRORS:
                raise
            except (PeerError, RemoteError) as e:
                if isinstance(e, SessionNotFoundError | CacheExhaustedError | PeerError) or type(e) is RemoteError:
                    await self._replace_hop(index, position, e, deadline)
                    # a fresh step id: later hops may have run a push from the failed hop's output
                    step_id = uuid.uuid4().hex if push else None
                    continue  # retry this index with the replacement hop(s)
                raise
            self.manager.bans.report_success(hop.hop.peer_id)
            self._history[index].write(position, x)
            if output_hidden_states:
                states.append(out)
                x = out[-1]
            else:
                x = out
            index += 1
        return torch.cat(states, 0) if output_hidden_states else x

    async def _spot_check(self, index: int, hop: RouteHop, x: torch.Tensor, out: torch.Tensor, position: int) -> None:
        """With probability ``spot_check_rate``, recompute this step on another server holding the same
        blocks (a stateless forward over the hop's whole input history) and treat a disagreement as a fault
        of the checked server: it is banned and its span re-routed, as for NaN or a wrong shape."""
        from swarm_client.remote_sequential import _call_stream  # local import: that module imports this one

        rate = self.manager.config.spot_check_rate
        if rate <= 0 or random.random() >= rate or self._history[index].unknown:
            return
        prefix = self._history[index].read(position)
        full = x if prefix is None else torch.cat([prefix, x], 1)
        try:
            checkers = find_route(
                self.manager.spans,
                hop.start,
                hop.end,
                rtt=self.manager.rtt,
                banned=self.manager.bans.banned() | {hop.peer_id},
            )
        except NoRouteError:
            return  # nobody else holds these blocks: nothing to compare with
        reference = full
        try:
            for checker in checkers:
                (reference,) = await _call_stream(
                    self.manager,
                    checker.peer_id,
                    "rpc_forward",
                    [reference],
                    start_block=checker.start,
                    end_block=checker.end,
                )
        except (PeerError, RemoteError):
            return  # the checker failed; the step itself is not suspect
        reference = reference[:, -x.shape[1] :].to(out.dtype)
        self.spot_checks += 1
        difference = float((out - reference).norm() / reference.norm().clamp_min(1e-6))
        if difference > self.manager.config.spot_check_tolerance:
            self.spot_check_failures += 1
            raise PeerError(
                f"spot check: server {hop.peer_id} disagrees with {[c.peer_id for c in checkers]} on blocks "
                f"{hop.start}:{hop.end} (relative difference {difference:.3g})",
                hop.peer_id,
            )

    async def _replace_hop(self, index: int, position: int, error: Exception, deadline: float) -> None:
        """Ban the failed server, route its span anew, replay the span's history into the replacement."""
        failed = self._hops[index]
        self.manager.ban(failed.hop.peer_id, str(error))
        replay_input = self._history[index].read(position)
        await failed.close()
        del self._hops[index]
        del self._history[index]
        config = self.manager.config
        while True:
            if time.monotonic() > deadline:
                raise SessionLost(
                    f"could not replace server {failed.hop.peer_id} for blocks {failed.hop.start}:{failed.hop.end} "
                    f"within {config.failover_deadline:.0f}s (last error: {error})"
                )
            sessions: list[_ServerSession] = []
            try:
                hops = await self.manager.make_route(
                    failed.hop.start, failed.hop.end, cache_tokens_needed=self.max_length * self.batch_size
                )
                sessions = await self._open_hops(hops)
                histories: list[HistoryBuffer] = []
                replay = replay_input
                for session in sessions:
                    history = HistoryBuffer()
                    if replay is not None:
                        history.write(0, replay)
                        replay = await session.step(replay, 0, config.step_timeout)
                    histories.append(history)
                break
            except CALLER_ERRORS:
                raise
            except NoRouteError as e:
                error = e
                if time.monotonic() + 0.5 > deadline:
                    raise
                await asyncio.sleep(0.5)
            except (PeerError, RemoteError) as e:
                error = e
                await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
                if getattr(e, "peer_id", None):
                    self.manager.ban(e.peer_id, str(e))
                await asyncio.sleep(0.1)
        self.failovers += 1
        logger.info(
            "replaced server %s (blocks %d:%d) by %s, replayed %d tokens",
            failed.hop.peer_id,
            failed.hop.start,
            failed.hop.end,
            [s.hop.peer_id for s in sessions],
            position,
        )
        self._hops[index:index] = sessions
        self._history[index:index] = histories

    # ------------------------------------------------------------------ resuming across requests
    def export_state(self) -> dict:
        """What another request (or gateway replica) needs to resume this session's server-side caches."""
        return {
            "session_id": self.session_id,
            "position": self.position,
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "start": self.start,
            "end": self.end,
            "hops": [
                {
                    "peer_id": h.hop.peer_id,
                    "start": h.hop.start,
                    "end": h.hop.end,
                    "server_session_id": h.session_id,
                }
                for h in self._hops
            ],
            "token_ids": [list(c) for c in self.token_ids],
        }

    @classmethod
    async def aresume(cls, manager: SequenceManager, state: dict, keep_on_close: bool = True) -> InferenceSession:
        """Re-attach to the caches a previous session left on its servers (``keep_on_close=True``).

        Raises ``SessionNotFoundError`` if any server no longer holds the expected prefix; the caller then
        starts a fresh session.
        """
        session = cls(
            manager,
            state["start"],
            state["end"],
            state["max_length"],
            state["batch_size"],
            state["session_id"],
            keep_on_close,
        )
        position = int(state["position"])
        session._deal_group(len(state["hops"]))
        hops = [
            _ServerSession(
                manager, RouteHop(h["peer_id"], h["start"], h["end"]), h["server_session_id"], session.batch_group
            )
            for h in state["hops"]
        ]
        try:
            for hop in hops:
                held = await hop.open(
                    session.max_length,
                    session.batch_size,
                    resume=True,
                    timeout=manager.config.connect_timeout,
                )
                if held < position:
                    raise SessionNotFoundError(f"server {hop.hop.peer_id} holds {held} tokens, expected {position}")
        except BaseException:
            await asyncio.gather(*(h.close(keep=True) for h in hops), return_exceptions=True)
            raise
        session._hops = hops
        session._history = [HistoryBuffer(unknown_prefix=position) for _ in hops]
        session.position = position
        session.token_ids = [tuple(c) for c in state.get("token_ids", [])][:position]
        return session

    @classmethod
    def resume(cls, manager: SequenceManager, state: dict, keep_on_close: bool = True) -> InferenceSession:
        return runtime.run(cls.aresume(manager, state, keep_on_close))

    @property
    def route(self) -> list[RouteHop]:
        return [h.hop for h in self._hops]
