"""An inference session across a chain of servers: positions, rollback, resuming, and failover.

Each hop of the route gets one bidirectional stream (``server_session``) whose KV cache lives on that
server. The client keeps, per hop, every hidden state it has sent (``history``), so when a server dies
the same span is re-routed (possibly over several servers) and the history replayed (``failover``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid

import torch

from swarm_client import protocol, runtime
from swarm_client.errors import (
    CacheExhaustedError,
    InvalidInputError,
    LengthExceededError,
    PeerError,
    PushMismatchError,
    RemoteError,
    SessionLost,
    SessionNotFoundError,
    SessionTooLongError,
)
from swarm_client.failover import (
    CALLER_ERRORS,
    PendingSpotCheck,
    check_trusted_resume,
    open_span,
    replace_span,
    start_spot_check,
    wait_for_room,
)
from swarm_client.history import HistoryBuffer
from swarm_client.local_span import LocalSession
from swarm_client.routing import RouteHop
from swarm_client.sequence_manager import SequenceManager
from swarm_client.server_session import _ServerSession, close_all, hop_session, push_chain

__all__ = ["CALLER_ERRORS", "HistoryBuffer", "InferenceSession", "_ServerSession"]

logger = logging.getLogger(__name__)

#: steps larger than this are not pushed server to server (a push is one unary message; prefills are rare)
PUSH_MAX_BYTES = 2**18


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
        adapter: str | None = None,
    ):
        self.manager = manager
        #: the served LoRA adapter every hop runs (``swarm_client.lora``); None: the base model
        self.adapter = adapter
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
        self._hops: list[_ServerSession | LocalSession] = []  # local: the client's own blocks (``local_span``)
        self._history: list[HistoryBuffer] = []  # per hop: the inputs sent so far
        self.failovers = 0
        #: whether the latest step asked the servers to push to each other (``SequenceManager.push_pays``)
        self.pushing = False
        self.spot_checks = 0
        self.spot_check_failures = 0
        #: steps sent, retries too: a server runs a pushed step only if newer than all it ran (a late push is dropped)
        self.step_seq = 0
        #: optional token ids fed so far, maintained by the model (not by the session)
        self.token_ids: list[int] = []

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
        await close_all(self._hops, keep=self.keep_on_close)

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
        if not self._hops:  # opened here, the opens travel with the first step: one round trip, not two
            await self._build_chain(0, self.start, self.end, wait=False)
        chunk = protocol.step_tokens(hidden)
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

    async def _open_hops(self, hops: list[RouteHop], wait: bool = True) -> list[_ServerSession | LocalSession]:
        """One server session per hop, opened all at once (one round trip for the chain, not one per server);
        all or none: if one fails, the opened ones are closed and its error raised. Without ``wait``, the
        opens are only sent and the first step follows them at once (``_ServerSession.open``)."""
        self._deal_group(len(hops))
        timeout = self.manager.config.connect_timeout
        ids = [f"{self.session_id}:{hop.start}:{hop.end}:{uuid.uuid4().hex[:8]}" for hop in hops]
        new = functools.partial(hop_session, self.manager, batch_group=self.batch_group, adapter=self.adapter)
        sessions = [new(hop, sid) for hop, sid in zip(hops, ids, strict=True)]
        results = await asyncio.gather(
            *(s.open(self.max_length, self.batch_size, resume=False, timeout=timeout, wait=wait) for s in sessions),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await close_all(sessions)
            # the caller's own mistake first (every server would refuse it), else the first server's failure
            raise next((e for e in errors if isinstance(e, CALLER_ERRORS)), errors[0])
        for hop in hops:
            self.manager.answered(hop.peer_id)
        return sessions

    @property
    def _cache_tokens(self) -> int:
        """Cache tokens each server of the chain must hold for this session."""
        return self.max_length * self.batch_size

    async def _build_chain(self, index: int, start: int, end: int, wait: bool = True) -> None:
        """Route ``[start, end)`` and open streams there (see ``failover.open_span``); without ``wait``, the
        opens' answers are read with the first step's (a refusal then fails over from that step)."""
        open_hops = self._open_hops if wait else functools.partial(self._open_hops, wait=False)
        sessions = await open_span(self.manager, start, end, self._cache_tokens, open_hops, self.adapter)
        self._hops[index:index] = sessions
        self._history[index:index] = [HistoryBuffer() for _ in sessions]

    async def _step_chain(self, hidden: torch.Tensor, position: int, output_hidden_states: bool) -> torch.Tensor:
        deadline = time.monotonic() + self.manager.config.failover_deadline
        busy_deadline = min(deadline, time.monotonic() + self.manager.config.busy_wait)
        x = hidden
        states: list[torch.Tensor] = []
        push = (
            not output_hidden_states
            and hidden.numel() * hidden.element_size() <= PUSH_MAX_BYTES
            and self.manager.push_pays(self.route)
        )
        self.pushing = push
        step_id = self._new_attempt(push)
        pushed_to: str | None = None  # the session the previous hop pushed this step's output to
        inputs: list[torch.Tensor] = []  # each hop's input this step
        index = 0
        while index < len(self._hops):
            hop = self._hops[index]
            inputs[index:] = [x]
            chain = push_chain(self._hops, index, step_id, position, self.step_seq)
            # a spot check starts with the step: its checkers compute while the hop does (local blocks: none)
            check = (
                None
                if output_hidden_states or hop.local
                else start_spot_check(self.manager, hop.hop, self._history[index], x, position, self.adapter)
            )
            try:
                try:
                    t0 = time.perf_counter()
                    pushed = pushed_to is not None and pushed_to == hop.session_id
                    timeout = self.manager.config.step_timeout
                    out = await hop.step(
                        x, position, timeout, output_hidden_states, step_id, chain, pushed, self.step_seq
                    )
                    self.manager.record_step(hop.hop.peer_id, hop.hop.length, x.shape[1], time.perf_counter() - t0)
                    if check is not None:
                        await self._spot_check(check, out)
                finally:
                    if check is not None:
                        check.cancel()  # no-op once it has finished
            except CALLER_ERRORS:
                raise
            except PushMismatchError as e:  # the previous server pushed other activations than it answered us
                liar = self._hops[index - 1].hop.peer_id
                await self._replace_hop(index - 1, position, PeerError(f"{e} (pushed by {liar})", liar), deadline)
                index, x = index - 1, inputs[index - 1]
                step_id, pushed_to = self._new_attempt(push), None
                continue
            except (PeerError, RemoteError) as e:
                if (
                    isinstance(e, SessionNotFoundError | CacheExhaustedError | SessionTooLongError | PeerError)
                    or type(e) is RemoteError
                ):
                    if isinstance(e, CacheExhaustedError | SessionTooLongError):  # full, not faulty: with every
                        # server of the span full (or too small), wait for room (``busy_wait`` at most, then
                        # SwarmBusyError) rather than re-open on the full server and fail the same step again
                        await wait_for_room(self.manager, e, hop.hop.start, hop.hop.end, busy_deadline, self.adapter)
                    await self._replace_hop(index, position, e, deadline)
                    step_id, pushed_to = self._new_attempt(push), None
                    continue  # retry this index with the replacement hop(s)
                raise
            self.manager.answered(hop.hop.peer_id)
            pushed_to = chain[0]["session_id"] if chain else None
            self._history[index].write(position, x)
            if output_hidden_states:
                states.append(out)
                x = out[-1]
            else:
                x = out
            index += 1
        return torch.cat(states, 0) if output_hidden_states else x

    def _new_attempt(self, push: bool) -> str | None:
        """The next ``step_seq``, and a fresh step id if pushed (later hops may have run the last one's push)."""
        self.step_seq += 1
        return uuid.uuid4().hex if push else None

    async def _spot_check(self, pending: PendingSpotCheck, out: torch.Tensor) -> None:
        """Compare the step's output with the spot check's (``failover.start_spot_check``) and treat a
        disagreement as a fault of the checked server: it is banned and its span re-routed, as for NaN."""
        check = await pending.result(out, self.manager.config.spot_check_wait)
        if check is None:
            return
        self.spot_checks += 1
        if check.difference > self.manager.config.spot_check_tolerance:
            self.spot_check_failures += 1
            raise check.disagreement()

    async def _replace_hop(self, index: int, position: int, error: Exception, deadline: float) -> None:
        """Ban the failed server, route its span anew, replay the span's history into the replacement."""
        failed = self._hops[index]
        if isinstance(error, CacheExhaustedError | SessionTooLongError):  # full, not faulty: move it, ban nobody
            self.manager.mark_busy(failed.hop.peer_id, str(error))
        else:
            self.manager.fault(failed.hop.peer_id, error)
        replay_input = self._history[index].read(position)
        await failed.close(wait=isinstance(error, CacheExhaustedError))  # a failed server's goodbye is not awaited
        del self._hops[index]
        del self._history[index]
        sessions, histories = await replace_span(
            self.manager, failed.hop, replay_input, error, deadline, self._cache_tokens, self._open_hops, self.adapter
        )
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
        """What another request (or another process) needs to resume this session's server-side caches."""
        return {
            "session_id": self.session_id,
            "position": self.position,
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "start": self.start,
            "end": self.end,
            "adapter": self.adapter,
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
    async def aresume(
        cls, manager: SequenceManager, state: dict, keep_on_close: bool = True, max_length: int | None = None
    ) -> InferenceSession:
        """Re-attach to the caches a previous session left on its servers (``keep_on_close=True``); a larger
        ``max_length`` than the session had raises its servers' caps (they grow on demand, reserving nothing).

        Raises ``SessionNotFoundError`` if any server no longer holds the expected prefix; the caller then
        starts a fresh session.
        """
        session = cls(
            manager,
            state["start"],
            state["end"],
            max(int(state["max_length"]), max_length or 0),
            state["batch_size"],
            state["session_id"],
            keep_on_close,
            state.get("adapter"),
        )
        position = int(state["position"])
        check_trusted_resume(manager, state["hops"])
        session._deal_group(len(state["hops"]))
        new = functools.partial(hop_session, manager, batch_group=session.batch_group, adapter=session.adapter)
        hops = [new(RouteHop(h["peer_id"], h["start"], h["end"]), h["server_session_id"]) for h in state["hops"]]
        try:
            timeout = manager.config.connect_timeout
            held = await asyncio.gather(
                *(hop.open(session.max_length, session.batch_size, resume=True, timeout=timeout) for hop in hops)
            )  # all at once: one round trip for the chain
            for hop, tokens in zip(hops, held, strict=True):
                if tokens < position:
                    raise SessionNotFoundError(f"server {hop.hop.peer_id} holds {tokens} tokens, expected {position}")
        except BaseException:
            await close_all(hops, keep=True)
            raise
        session._hops = hops
        session._history = [HistoryBuffer(unknown_prefix=position) for _ in hops]
        session.position = position
        session.step_seq = max((getattr(hop, "server_seq", 0) for hop in hops), default=0)  # its pushes stay newer
        session.token_ids = [tuple(c) for c in state.get("token_ids", [])][:position]
        return session

    @classmethod
    def resume(
        cls, manager: SequenceManager, state: dict, keep_on_close: bool = True, max_length: int | None = None
    ) -> InferenceSession:
        return runtime.run(cls.aresume(manager, state, keep_on_close, max_length))

    async def aopen(self) -> None:
        """Open the servers' streams now rather than on the first step, so a caller learns before it
        commits to anything (an HTTP 200) whether the swarm has room (``SwarmBusyError``) or can hold the
        session at all (``SessionTooLongError``)."""
        if not self._hops and not self.closed:
            await self._build_chain(0, self.start, self.end)

    def open(self) -> None:
        runtime.run(self.aopen())

    @property
    def route(self) -> list[RouteHop]:
        return [h.hop for h in self._hops]
