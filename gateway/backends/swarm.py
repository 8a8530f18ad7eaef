"""``SwarmBackend``: the ``ModelBackend`` protocol (gateway/backends/base.py) over the swarm.

The gateway process is the *head*: it runs the tokenizer, the embeddings, the final norm and the LM head
(``swarm_client``'s distributed model); every transformer block runs on the block servers, whose KV caches
each ``SwarmSession`` holds open through an ``InferenceSession``. ``LocalBackend`` is the reference this
mirrors — same numbers for the same tokens.

Errors: swarm failures surface as ``swarm_client.errors.SwarmError`` (``NoRouteError`` names the missing
blocks), which ``gateway.errors`` maps to 503 + Retry-After. ``open_session`` checks that a route exists so
a request for an uncovered model fails *before* its stream starts; transport errors that escape the client
library (a dead p2p daemon) are re-raised as ``PeerError`` so they too are a 503, not a 500.

Reuse across requests: ``SwarmSession.detach()`` closes the streams with ``keep_on_close`` (the servers keep
the caches for their ``--session-ttl``) and returns ``InferenceSession.export_state()`` — every hop's peer id
and server session id — plus the token ids; ``open_session(resume=snapshot)`` re-attaches to exactly those
server sessions (``InferenceSession.resume``), from this process or any other gateway replica.
LoRA adapters (gateway/backends/adapters.py): a session's ``adapter`` runs on servers announcing it, resumes only
its own.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from gateway.backends.adapters import served_adapters
from gateway.backends.base import DecodeSession, RouteHopInfo, SessionRoute, SessionSnapshot, context_window
from gateway.backends.swarm_session import SwarmSession, as_swarm_errors, swarm_error
from gateway.backends.swarm_steps import run_steps
from gateway.backends.swarm_view import reachability_label
from swarm_client import runtime
from swarm_client.config import default_dht_prefix, parse_initial_peers
from swarm_client.dht_records import ServerState
from swarm_client.errors import PeerError, SessionNotFoundError
from swarm_client.model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from swarm_client.model_source import resolve_model_path
from swarm_client.routing import coverage, missing_blocks
from swarm_client.session import InferenceSession

__all__ = ["SwarmBackend", "SwarmSession"]


class SwarmBackend:
    """A model whose blocks are served by the swarm found through ``initial_peers``.

    ``client_options`` go to ``swarm_client.sequence_manager.ClientConfig`` (``update_period``,
    ``step_timeout``, ``failover_deadline``…), except ``local_blocks`` / ``device`` (blocks the gateway runs
    itself, see ``AutoDistributedModelForCausalLM.from_pretrained``); ``dht`` reuses a running hivemind DHT.
    """

    def __init__(
        self,
        model_path_or_id: str | Path,
        initial_peers: list[str] | str,
        *,
        model_id: str | None = None,
        dht_prefix: str | None = None,
        max_context: int | None = None,
        dtype: torch.dtype = torch.float32,
        dht: Any = None,
        **client_options: Any,
    ):
        name = str(model_path_or_id)
        self.model_id = model_id or name
        self.dht_prefix = dht_prefix or default_dht_prefix(name)
        self.initial_peers = parse_initial_peers(initial_peers)
        model_dir = resolve_model_path(name)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model: DistributedModelForCausalLM = AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir),
            self.initial_peers,
            dht_prefix=self.dht_prefix,
            dtype=dtype,
            dht=dht,
            **client_options,
        )
        self.model.name_or_path = name
        self.generation_config = self.model.generation_config
        self.max_context = int(max_context or context_window(self.model.config, self.tokenizer))
        self.num_blocks = int(self.model.config.num_hidden_layers)
        self._lock = threading.Lock()
        self._sessions: set[SwarmSession] = set()
        self._closed = False

    #: sessions can be detached and resumed (gateway/backends/base.py)
    supports_resume = True
    #: ``step(..., all_logits=True)`` gives every position's logits (speculative decoding)
    supports_all_logits = True

    @property
    def manager(self) -> Any:
        return self.model.manager

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def served_adapters(self) -> list[str]:
        """The LoRA adapters whose servers cover the whole model in the swarm view (``update_period`` old)."""
        with as_swarm_errors():
            return served_adapters(runtime.run(self.manager.update()), self.num_blocks)

    def open_session(
        self,
        max_length: int,
        session_id: str | None = None,
        resume: SessionSnapshot | None = None,
        adapter: str | None = None,
    ) -> SwarmSession:
        """A session whose route is known to exist (else ``NoRouteError``: a 503 before any stream starts),
        or with ``resume`` the detached session it describes (``SessionNotFoundError`` if that is gone, or ran
        another adapter). ``adapter``: the served LoRA adapter it runs (None: the base model)."""
        if max_length > self.max_context:
            raise ValueError(f"max_length {max_length} exceeds the context window {self.max_context}")
        if self._closed:
            raise PeerError("the gateway's swarm client is shut down")
        if resume is not None:
            return self._resume(max_length, resume, adapter)
        with as_swarm_errors():
            # a missing span is a 503 at once (opening below would wait out the failover deadline for one)
            runtime.run(self.manager.make_route(0, self.num_blocks, max_length, adapter))
        inner = self.model.blocks.inference_session(max_length, 1, session_id, adapter=adapter)
        with as_swarm_errors():
            # the servers' streams open now, not on the first step: no room anywhere (SwarmBusyError) or no
            # server able to hold the session (SessionTooLongError) are answers before any stream starts
            try:
                inner.open()
            except BaseException:
                inner.close()
                raise
        session = SwarmSession(self.model.head, inner, max_length, session_id, self._forget)
        session.planned_route = list(inner.route)
        with self._lock:
            self._sessions.add(session)
        return session

    def _resume(self, max_length: int, snapshot: SessionSnapshot, adapter: str | None = None) -> SwarmSession:
        """The detached session ``snapshot`` describes, its cap raised to ``max_length`` when this turn needs
        more room than earlier ones asked for (servers grow caches on demand: nothing is reserved)."""
        state = snapshot.state
        held = int(state.get("position", 0))
        if (state.get("start"), state.get("end")) != (0, self.num_blocks) or len(snapshot.token_ids) > held:
            raise SessionNotFoundError("the snapshot does not describe a whole-model session of this model")
        if state.get("adapter") != adapter:  # its caches hold another adapter's keys and values
            raise SessionNotFoundError(f"the snapshot ran adapter {state.get('adapter')!r}, not {adapter!r}")
        with as_swarm_errors():
            inner = InferenceSession.resume(self.manager, state, keep_on_close=False, max_length=max_length)
        session = SwarmSession(self.model.head, inner, inner.max_length, inner.session_id, self._forget)
        if len(snapshot.token_ids) < inner.position:
            inner.rollback(len(snapshot.token_ids))
        session.token_ids = list(snapshot.token_ids)
        with self._lock:
            self._sessions.add(session)
        return session

    def step_many(
        self,
        sessions: Sequence[SwarmSession],
        token_ids: Sequence[list[int]],
        on_ready: Callable[[list[tuple[int, torch.Tensor | BaseException]]], None] | None = None,
        all_logits: bool = False,
    ) -> list[torch.Tensor | BaseException]:
        """One step of several sessions in one call: their swarm steps run concurrently on the client's I/O
        loop (the servers batch them), everything else exactly as ``SwarmSession.step``, so the logits are
        the same. One result per session: its logits, or the exception its step raised.

        ``on_ready``: when some steps are late (gateway/backends/swarm_steps.py: a frozen server, a failover), the
        results done so far are handed to it before the call returns, then each late one as it completes,
        so their callers need not wait for the late ones. Every result is returned as well.
        """
        # a session whose tokens cannot be embedded keeps that error; every other slot is its step's result
        results: list[torch.Tensor | BaseException] = []
        ready: dict[int, torch.Tensor] = {}
        for i, (session, ids) in enumerate(zip(sessions, token_ids, strict=True)):
            try:
                hidden = session._embed(ids)
            except Exception as e:
                results.append(e)
                continue
            results.append(hidden)  # replaced below by the logits or the step's exception
            ready[i] = hidden
        if not ready:
            return results

        def finish(i: int, out: Any) -> torch.Tensor | BaseException:
            if isinstance(out, BaseException):
                return swarm_error(out)
            try:
                return sessions[i]._finish(token_ids[i], ready[i], out, all_logits)
            except Exception as e:
                return e

        steps = {
            i: functools.partial(sessions[i].inner.astep, h, position=sessions[i].position) for i, h in ready.items()
        }
        early = [(i, r) for i, r in enumerate(results) if i not in ready]  # handed over with the first results
        try:
            with torch.inference_mode():
                done = run_steps(steps, finish, on_ready, early)
        except Exception as e:  # the I/O loop itself failed: every step did
            done = {i: e for i in ready}
        for i, result in done.items():
            results[i] = result
        return results

    @staticmethod
    def step_group(session: SwarmSession) -> int | None:
        """The session's pipeline group (``ClientConfig.pipeline_groups``): ``step_many`` calls take one group
        each, so the groups stay apart and pipeline through the chain."""
        return session.inner.batch_group

    def describe_route(self, session: DecodeSession) -> SessionRoute | None:
        """``session``'s servers and block spans in order (``RouteReportingBackend``), and whether steps are
        pushed server to server (the client's ``push`` option; under "auto", decided from the route's RTTs)."""
        if not isinstance(session, SwarmSession):
            return None
        route = session.route
        hops = tuple(RouteHopInfo(h.peer_id, h.start, h.end) for h in route)
        return SessionRoute(hops, push=self.manager.push_pays(route))

    def _forget(self, session: SwarmSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def server_info(self, peer_id: str, timeout: float = 5.0) -> dict:
        """A server's own report (cache use, sessions, tokens processed): what ``/v1/swarm`` omits."""
        with as_swarm_errors():
            return runtime.run(self.manager.info(peer_id, timeout=timeout))

    def swarm_state(self, max_age_s: float = 0.0) -> dict:
        """Who serves which blocks, in what state, and which blocks nobody serves: a fresh read of the DHT, or
        with ``max_age_s`` a view at most that old (``/health``: a flood of probes costs one read per
        interval, not one each). Also the trust policy (``trusted_peers``, which blocks it covers), each
        server's ``trusted`` mark, and its throughput as claimed, as measured here and as routing believes it."""
        with as_swarm_errors():
            spans = runtime.run(self.manager.update(force=max_age_s <= 0, max_age=max_age_s))
        trusted = list(self.manager.trusted_peers)
        measured = self.manager.step_times.throughputs()
        believed = self.manager.effective_throughputs()
        banned = self.manager.bans.banned()
        rows = []
        for peer_id, span in sorted(spans.items(), key=lambda kv: (kv[1].start, kv[1].end, kv[0])):
            info = span.server_info
            rows.append(
                {
                    "peer_id": peer_id,
                    "start": span.start,
                    "end": span.end,
                    "state": ServerState(info.state).name,
                    "throughput": round(float(info.throughput), 3),
                    # what this client measured of its decode steps, and what routing believes (claim capped)
                    "measured_throughput": round(measured[peer_id], 3) if peer_id in measured else None,
                    "routing_throughput": round(believed.get(peer_id, float(info.throughput)), 3),
                    "cache_tokens_left": int(info.cache_tokens_left),
                    "public_name": info.public_name,
                    "trusted": peer_id in trusted,
                    "reachability": reachability_label(info.reachability, peer_id in banned),
                }
            )
        local = self.manager.local  # blocks this gateway runs itself (``--local-blocks``) are not missing
        held = range(local.start, local.end) if local is not None else range(0)
        return {
            "model": self.model_id,
            "backend": "swarm",
            "dht_prefix": self.dht_prefix,
            "num_blocks": self.num_blocks,
            "missing_blocks": [b for b in missing_blocks(spans, self.num_blocks) if b not in held],
            "local_blocks": [local.start, local.end] if local is not None else None,
            "spans": rows,
            "blocks": coverage(spans, self.num_blocks),
            "open_sessions": self.open_sessions,
            "trust_policy": {
                "trusted_peers": trusted,
                "applies_to": (
                    f"blocks 0 and {self.num_blocks - 1}: the first and the last block of every route"
                    if trusted
                    else "nothing: any server may serve any block"
                ),
            },
        }

    def close(self) -> None:
        """Close open sessions (freeing their server caches), then the client's DHT."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            with contextlib.suppress(Exception):
                s.close()
        self.model.shutdown()  # also closes the client's P2P connection
