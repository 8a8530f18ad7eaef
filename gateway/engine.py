"""Turns prompts into tokens through any ``ModelBackend`` (gateway/backend.py): sessions, the decode loop,
stop conditions, cancellation.

Only the backend protocol is used, so ``LocalBackend`` and the swarm backend are interchangeable. The
generate loop is a chain of small verbs: ``Engine.start`` opens one ``DecodeSession`` per choice (so a
``NoRouteError`` is still a proper 503, before any stream starts), ``_run_choice`` prefills and decodes one
choice, ``_merge`` interleaves the choices as their tokens come.

Threading: every backend call (open/step/close) and the sampling that follows a step run in a worker
thread — ``asyncio.to_thread``-style, but in the engine's own pool of ``settings.backend_threads``, since a
swarm step blocks on the network and the loop's default pool has only ``cpu_count + 4`` threads. The
tokenizer is used on the event loop only (HF fast tokenizers are not safe to share across threads). A
session never has two calls in flight: when a request is cancelled (client gone, timeout) the call in
flight finishes in its thread, then the session is closed — in ``finally``, shielded from the cancellation.

Prefix reuse across requests (with an affinity store, gateway/sessions.py, and a backend with
``supports_resume``): ``start`` claims the store's record sharing the longest prefix with choice 0's prompt
(or the record of the request's session key), resumes its session (``open_session(resume=...)``; if the
caches are gone, a fresh session instead) and ``_prefill`` feeds only what the session does not already hold
(``session.token_ids``), rolling back to the common prefix first; the tokens it did not have to send are the
choice's ``cached_tokens``. Reusable sessions are opened with ``max_length`` = the context window, so any
later turn fits (the servers grow caches on demand: this reserves nothing). When the choice finishes
normally its session is *detached* — closed with the caches kept — and written back to the store under the
claimed record; a choice that fails or is cancelled closes its session (freeing the caches) and leaves no
record. If the servers lose a resumed session mid-request (``SessionLost``: its earlier inputs are not known
here, so failover cannot replay them), ``_ReusableSession`` opens a fresh one and re-feeds every token the
old one held: same tokens, same logits, the output goes on unchanged. Only choice 0 takes part (the other
choices of ``n > 1`` share its prompt but would need copies of the same caches; they prefill as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch

from gateway.backend import DecodeSession, ModelBackend, SessionSnapshot
from gateway.decode_batch import StepGatherer
from gateway.detokenize import IncrementalDetokenizer, TokenVocab
from gateway.errors import (
    ContextLengthExceededError,
    GatewayTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
)
from gateway.metrics import GatewayMetrics
from gateway.sampling import Sampler, SamplingParams, top_logprobs
from gateway.sessions import AffinityStore, Claim, common_prefix
from gateway.settings import GatewaySettings
from gateway.stop import StopMatcher
from swarm_client.errors import SessionLost, SwarmError

logger = logging.getLogger(__name__)

__all__ = ["ChoiceResult", "ChoiceSpec", "Delta", "Engine", "Generation", "TokenLogprob", "eos_token_ids"]

T = TypeVar("T")


@dataclass
class ChoiceSpec:
    """Everything one choice needs, already validated."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str] = ()
    #: None: no logprobs; k >= 0: the chosen token's logprob and the k most likely tokens
    logprobs: int | None = None
    #: also score the prompt's tokens (completions with echo + logprobs): costs one step per prompt token
    prompt_logprobs: bool = False


@dataclass
class TokenLogprob:
    token_id: int
    #: None for the first prompt token, which nothing predicts
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    """What one choice emits: new text, the logprobs of the tokens it accounts for, at the end a reason."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    #: tokens sampled so far by this choice (EOS included); final on the finishing delta
    completion_tokens: int = 0
    #: on a choice's first delta only, when ``ChoiceSpec.prompt_logprobs``
    prompt_logprobs: list[TokenLogprob] | None = None
    #: prompt tokens whose caches were reused instead of sent (on every delta; final on the finishing one)
    cached_tokens: int = 0


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = "length"
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def eos_token_ids(backend: ModelBackend) -> frozenset[int]:
    """The tokenizer's EOS and the model's generation_config EOS ids (chat models often end on a turn
    token such as ``<|im_end|>`` that only the generation config names). A backend may expose
    ``generation_config``; the protocol does not require it."""
    ids: set[int] = set()
    candidates = [
        getattr(backend.tokenizer, "eos_token_id", None),
        getattr(getattr(backend, "generation_config", None), "eos_token_id", None),
    ]
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value if v is not None)
    return frozenset(ids)


class _ReusableSession:
    """A session that may continue a previous request's caches (``resumed``). If the servers lose those
    mid-request (``SessionLost``), it opens a fresh session and feeds it every token the lost one held plus
    the new ones: the same cache and the same logits, so the caller cannot tell (``restarted`` says it)."""

    def __init__(self, backend: ModelBackend, inner: DecodeSession, max_length: int, resumed: bool):
        self.backend = backend
        self.inner = inner
        self.max_length = max_length
        self.resumed = resumed
        self.restarted = False

    @property
    def position(self) -> int:
        return self.inner.position

    @property
    def token_ids(self) -> list[int]:
        return self.inner.token_ids

    def step(self, token_ids: list[int]) -> torch.Tensor:
        try:
            return self.inner.step(token_ids)
        except SessionLost as exc:
            if not self.resumed:
                raise
            return self.recover(token_ids, exc)

    def recover(self, token_ids: list[int], lost: SessionLost) -> torch.Tensor:
        """The servers lost this resumed session at a step of ``token_ids``: re-prefill a fresh one."""
        held = list(self.inner.token_ids)
        with contextlib.suppress(Exception):
            self.inner.close()
        logger.info(
            "a resumed session was lost (%s); re-prefilling %d tokens in a fresh one", lost, len(held)
        )
        self.inner = self.backend.open_session(self.max_length)
        self.resumed, self.restarted = False, True
        return self.inner.step(held + list(token_ids))

    def rollback(self, position: int) -> None:
        self.inner.rollback(position)

    def detach(self) -> SessionSnapshot:
        return self.inner.detach()  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()


def _open_reusable(
    backend: ModelBackend, max_length: int, snapshot: SessionSnapshot | None
) -> _ReusableSession:
    """Resume ``snapshot``'s session, or open a fresh one when there is none or its caches are gone."""
    inner: DecodeSession | None = None
    if snapshot is not None:
        try:
            inner = backend.open_session(max_length, resume=snapshot)  # type: ignore[call-arg]
        except SwarmError as exc:  # expired, evicted, a server left: prefill afresh
            logger.info("could not resume a cached session (%s); prefilling afresh", exc)
        except Exception:
            logger.warning("resuming a cached session failed; prefilling afresh", exc_info=True)
    resumed = inner is not None
    if inner is None:
        inner = backend.open_session(max_length)
    return _ReusableSession(backend, inner, max_length, resumed)


@dataclass
class _DecodeItem:
    """One choice's next decode step, for ``Engine._decode_batch``."""

    session: DecodeSession
    token: int
    sampler: Sampler
    k: int | None


@dataclass
class _Reuse:
    """Where a reusable choice's session goes when it finishes: the store, the claimed record id."""

    store: AffinityStore
    claim: Claim
    replica: str


class _SessionHandle:
    """Owns one ``DecodeSession``: its blocking calls run one at a time in a worker thread, and ``aclose``
    waits for the call in flight (even an ``open_session`` whose caller was cancelled) before closing it —
    or, for a reusable choice that completed, detaching it and writing it back to the affinity store."""

    def __init__(self, executor: Executor, reuse: _Reuse | None = None) -> None:
        self._executor = executor
        self.session: DecodeSession | None = None
        self._opening: asyncio.Future[DecodeSession] | None = None
        self._inflight: asyncio.Future[Any] | None = None
        self._closed = False
        self.reuse = reuse
        #: set by the decode loop once the choice has finished normally: its caches are worth keeping
        self.completed = False
        #: when the request began opening this session: its time to first token counts from here
        self.opened_at = time.perf_counter()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("session already closed")
        return await self.wait(self.track(asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)))

    def track(self, fut: asyncio.Future[T]) -> asyncio.Future[T]:
        """Make ``fut`` — this session's one call in flight, wherever it runs — the call ``aclose`` waits for."""
        if self._closed:
            raise RuntimeError("session already closed")
        self._inflight = fut
        return fut

    @staticmethod
    async def wait(fut: asyncio.Future[T]) -> T:
        # shield: a cancelled caller must not leave the thread running while we close the session
        return await asyncio.shield(fut)

    async def open(self, backend: ModelBackend, max_length: int) -> None:
        if self.reuse is not None:
            record = self.reuse.claim.record
            snapshot = SessionSnapshot(record.state, record.token_ids) if record is not None else None
            opener: Callable[[], DecodeSession] = functools.partial(
                _open_reusable, backend, max_length, snapshot
            )
        else:
            opener = functools.partial(backend.open_session, max_length)
        fut = asyncio.get_running_loop().run_in_executor(self._executor, opener)
        self._opening = self._inflight = fut
        self.session = await asyncio.shield(fut)

    @property
    def cached_tokens_lost(self) -> bool:
        """True when a resumed session had to be rebuilt from scratch (nothing was reused after all)."""
        return bool(getattr(self.session, "restarted", False))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._inflight is not None and not self._inflight.done():
                await asyncio.wait([self._inflight])
            if self._inflight is not None and not self._inflight.cancelled():
                self._inflight.exception()  # retrieved: no "exception never retrieved" noise
            opening = self._opening
            opened = opening is not None and not opening.cancelled() and opening.exception() is None
            if self.session is None and opened:
                self.session = opening.result()  # type: ignore[union-attr]
            if self.session is None:
                return
            if self.reuse is not None and self.completed and await self._detach(self.reuse):
                return
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, self.session.close)
            except Exception:
                logger.exception("closing a decode session failed")

    async def _detach(self, reuse: _Reuse) -> bool:
        """Keep the caches and record them; False if the session could not be detached (close it then)."""
        if not reuse.store.available:  # nowhere to record it: free the caches now rather than at the TTL
            return False
        session = self.session
        assert session is not None
        if not reuse.claim.keyed and len(session.token_ids) < reuse.store.block_tokens:
            return False  # shorter than one indexed block: no later prompt could find it
        try:
            snapshot = await asyncio.get_running_loop().run_in_executor(
                self._executor,
                session.detach,  # type: ignore[attr-defined]
            )
        except Exception:
            logger.warning("detaching a finished session failed; closing it", exc_info=True)
            return False
        await reuse.store.save(reuse.claim, snapshot.state, snapshot.token_ids, reuse.replica)
        return True


class Engine:
    """The gateway's head: request-level checks that need the model, and generation."""

    def __init__(self, backend: ModelBackend, settings: GatewaySettings, store: AffinityStore | None = None):
        self.backend = backend
        self.settings = settings
        self.tokenizer = backend.tokenizer
        self.vocab = TokenVocab(self.tokenizer)
        self.eos_ids = eos_token_ids(backend)
        self.executor = ThreadPoolExecutor(settings.backend_threads, thread_name_prefix="swarmserve-backend")
        #: the app's metrics (gateway/metrics.py; set by ``install_metrics``); None: nothing is measured
        self.metrics: GatewayMetrics | None = None
        #: the affinity store, when both it and the backend can reuse sessions across requests
        self.store = store if store is not None and getattr(backend, "supports_resume", False) else None
        self.replica_id = (
            settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        #: gathers the decode steps of concurrent choices into one call (None: each steps on its own)
        self.decoder: StepGatherer[_DecodeItem, Any] | None = None
        if settings.batch_decode and hasattr(backend, "step_many") and hasattr(backend, "step_group"):
            self.decoder = StepGatherer(self.executor, self._decode_batch)

    def close(self) -> None:
        """Stop the worker threads (the backend belongs to the caller and stays open)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------ request checks

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    def check_model(self, requested: str | None) -> None:
        """The request must name the served model (its id or the id's basename); None means "the one"."""
        if requested is None:
            return
        served = self.backend.model_id
        if requested not in (served, os.path.basename(served.rstrip("/"))):
            raise ModelNotFoundError(requested)

    def max_tokens_for(self, prompt_len: int, requested: int | None, *, param: str) -> int:
        """The completion budget: ``requested`` if it fits the context window (else a 400 naming both), or
        ``min(default_max_tokens, what is left)`` when the request names none."""
        limit = self.backend.max_context
        if requested is not None:
            if prompt_len + requested > limit:
                raise ContextLengthExceededError(
                    max_context=limit, prompt_tokens=prompt_len, completion_tokens=requested, param=param
                )
            return requested
        if prompt_len >= limit:
            raise ContextLengthExceededError(
                max_context=limit, prompt_tokens=prompt_len, completion_tokens=1, param=param
            )
        return min(self.settings.default_max_tokens, limit - prompt_len)

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Messages → prompt ids through the tokenizer's chat template, ending with the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "This model has no chat template; use /v1/completions instead.", param="messages"
            )
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises TemplateError for conversations the template refuses
            raise InvalidRequestError(
                f"The chat template rejected these messages: {exc}", param="messages"
            ) from None
        # the template already wrote BOS and every special token it wants
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    # ---------------------------------------------------------------------------------------- generation

    async def start(self, specs: Sequence[ChoiceSpec], session_key: str | None = None) -> Generation:
        """Open one session per choice; raise (nothing left open) if any cannot be opened. Choice 0 resumes
        the cached session sharing the longest prefix with its prompt (``session_key``'s, when given)."""
        reuse = await self._claim(specs[0], session_key) if specs else None
        handles = [_SessionHandle(self.executor, reuse if i == 0 else None) for i in range(len(specs))]
        try:
            results = await asyncio.gather(
                *(h.open(self.backend, self._max_length(s, h)) for h, s in zip(handles, specs, strict=True)),
                return_exceptions=True,
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            for h in handles:
                await h.aclose()
            raise
        timeout = self.settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout if timeout > 0 else None
        return Generation(self, list(specs), handles, deadline)

    async def _claim(self, spec: ChoiceSpec, session_key: str | None) -> _Reuse | None:
        if self.store is None or spec.prompt_logprobs:  # scoring the prompt feeds it token by token anyway
            return None
        claim = await self.store.claim(spec.prompt_ids, session_key)
        return None if claim is None else _Reuse(self.store, claim, self.replica_id)

    def _max_length(self, spec: ChoiceSpec, handle: _SessionHandle) -> int:
        needed = len(spec.prompt_ids) + spec.max_tokens
        if handle.reuse is None:
            return needed
        limit = self.backend.max_context
        if self.settings.affinity_max_length is not None:
            limit = min(limit, self.settings.affinity_max_length)
        return max(needed, limit)

    @staticmethod
    def _reusable_prefix(held: Sequence[int], prompt_ids: Sequence[int]) -> int:
        """Prompt tokens a session holding ``held`` need not be sent: the common prefix, but never the
        whole prompt (its last token is fed again for its logits)."""
        return min(common_prefix(held, prompt_ids), len(prompt_ids) - 1)

    def _prefill(self, session: DecodeSession, prompt_ids: list[int]) -> torch.Tensor:
        """Feed what the session does not hold yet; rolls back to the common prefix of a reused session."""
        common = self._reusable_prefix(session.token_ids, prompt_ids)
        if common < session.position:
            session.rollback(common)
        return session.step(prompt_ids[common:])

    def _score_prompt(
        self, session: DecodeSession, prompt_ids: list[int], k: int
    ) -> tuple[torch.Tensor, list]:
        """Feed the prompt one token at a time to see every position's logits (the protocol only returns the
        last one). Returns the last logits and one TokenLogprob per prompt token."""
        if session.position:
            session.rollback(0)
        scored = [TokenLogprob(prompt_ids[0], None, [])]
        logits = session.step(prompt_ids[:1])
        for token in prompt_ids[1:]:
            chosen, top = top_logprobs(logits, token, k)
            scored.append(TokenLogprob(token, chosen, top))
            logits = session.step([token])
        return logits, scored

    @staticmethod
    def _sample(logits: torch.Tensor, sampler: Sampler, k: int | None) -> tuple[int, TokenLogprob | None]:
        token = sampler(logits)
        sampler.observe(token)
        if k is None:
            return token, None
        chosen, top = top_logprobs(logits, token, k)
        return token, TokenLogprob(token, chosen, top)

    def _first_token(
        self, session: DecodeSession, spec: ChoiceSpec, sampler: Sampler
    ) -> tuple[int, TokenLogprob | None, list[TokenLogprob] | None, int]:
        """The first sampled token, its logprob, the prompt's logprobs, and the prompt tokens reused."""
        if spec.prompt_logprobs:
            logits, scored = self._score_prompt(session, spec.prompt_ids, spec.logprobs or 0)
            cached = 0
        else:
            cached = self._reusable_prefix(session.token_ids, spec.prompt_ids)
            logits, scored = self._prefill(session, spec.prompt_ids), None
        token, lp = self._sample(logits, sampler, spec.logprobs)
        return token, lp, scored, cached

    def _next_token(
        self, session: DecodeSession, token: int, sampler: Sampler, k: int | None
    ) -> tuple[int, TokenLogprob | None]:
        return self._sample(session.step([token]), sampler, k)

    async def _decode(
        self, handle: _SessionHandle, session: DecodeSession, token: int, sampler: Sampler, k: int | None
    ) -> tuple[int, TokenLogprob | None]:
        """Feed ``token`` and sample the next one: with the other choices' steps (``decoder``), or alone."""
        if self.decoder is None:
            return await handle.call(self._next_token, session, token, sampler, k)
        inner = session.inner if isinstance(session, _ReusableSession) else session
        group = self.backend.step_group(inner)  # type: ignore[attr-defined]
        item = _DecodeItem(session, token, sampler, k)
        return await handle.wait(handle.track(self.decoder.submit(handle, item, group)))

    def _decode_batch(self, items: Sequence[_DecodeItem]) -> list[Any]:
        """Step every item's session at once (``backend.step_many``), then sample each; one result or
        exception per item. A resumed session the servers lost recovers by itself (``_ReusableSession``)."""
        inner = [i.session.inner if isinstance(i.session, _ReusableSession) else i.session for i in items]
        logits_or_errors = self.backend.step_many(inner, [[i.token] for i in items])  # type: ignore[attr-defined]
        results: list[Any] = []
        for item, logits in zip(items, logits_or_errors, strict=True):
            try:
                reusable = item.session if isinstance(item.session, _ReusableSession) else None
                if isinstance(logits, SessionLost) and reusable is not None and reusable.resumed:
                    logits = reusable.recover([item.token], logits)  # as its step() would
                if isinstance(logits, BaseException):
                    results.append(logits)
                else:
                    results.append(self._sample(logits, item.sampler, item.k))
            except Exception as e:
                results.append(e)
        return results

    async def _run_choice(self, spec: ChoiceSpec, handle: _SessionHandle) -> AsyncIterator[Delta]:
        """Decode one choice, yielding text as soon as it is final (no partial characters, no text that might
        still turn out to be a stop string). Closes the session however it ends."""
        produced = reused = 0
        try:
            session = handle.session
            assert session is not None
            sampler = Sampler(spec.sampling, spec.prompt_ids)
            detok = IncrementalDetokenizer(self.tokenizer, spec.prompt_ids)
            stopper = StopMatcher(spec.stop)
            pending: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet
            text, finish, produced = "", "length", 0
            token, lp, prompt_lps, reused = await handle.call(self._first_token, session, spec, sampler)
            clock = self._token_clock(handle.opened_at, first=True)
            while True:
                cached = 0 if handle.cached_tokens_lost else reused
                produced += 1
                if token in self.eos_ids:
                    finish = "stop"
                    break
                if lp is not None:
                    pending.append(lp)
                text = stopper.push(detok.push(token))
                if stopper.stopped:
                    break
                if text:
                    yield Delta(
                        spec.index,
                        text,
                        pending,
                        completion_tokens=produced,
                        prompt_logprobs=prompt_lps,
                        cached_tokens=cached,
                    )
                    pending, prompt_lps, text = [], None, ""
                if produced >= spec.max_tokens:
                    break
                token, lp = await self._decode(handle, session, token, sampler, spec.logprobs)
                clock = self._token_clock(clock)
            if self.decoder is not None:
                self.decoder.forget(handle)  # the next batch need not wait for this choice
            if not stopper.stopped:  # release what was held: an incomplete character, a would-be stop string
                text = stopper.push(detok.flush())
                text += "" if stopper.stopped else stopper.flush()
            if stopper.stopped:
                finish = "stop"
            handle.completed = True
            cached = 0 if handle.cached_tokens_lost else reused
            yield Delta(spec.index, text, pending, finish, produced, prompt_lps, cached)
        finally:
            if self.decoder is not None:
                self.decoder.forget(handle)
            if self.metrics is not None and produced:
                cached = 0 if handle.cached_tokens_lost else reused
                self.metrics.observe_usage(len(spec.prompt_ids), produced, cached)
            await handle.aclose()

    def _token_clock(self, since: float, *, first: bool = False) -> float:
        """Record the time to the first token (``since`` = the session's opening) or between two tokens;
        return now, where the next token's time starts."""
        now = time.perf_counter()
        if self.metrics is not None:
            histogram = self.metrics.time_to_first_token if first else self.metrics.inter_token_latency
            histogram.observe(now - since)
        return now


class Generation:
    """The choices of one request, running. Iterate it for deltas as they come (choices interleaved), or
    ``collect()`` the results; ``aclose()`` (idempotent) releases every session, started or not."""

    def __init__(
        self, engine: Engine, specs: list[ChoiceSpec], handles: list[_SessionHandle], deadline: float | None
    ):
        self.engine = engine
        self.specs = specs
        self._handles = handles
        self._deadline = deadline
        self._iter: AsyncIterator[Delta] | None = None

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._iter is None:
            gens = [self.engine._run_choice(s, h) for s, h in zip(self.specs, self._handles, strict=True)]
            self._iter = _merge(gens, self._deadline)
        return self._iter

    async def collect(self) -> list[ChoiceResult]:
        results = {s.index: ChoiceResult(s.index) for s in self.specs}
        try:
            async for delta in self:
                results[delta.index].add(delta)
        finally:
            await self.aclose()
        return [results[s.index] for s in self.specs]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._iter is not None:
                await self._iter.aclose()  # type: ignore[attr-defined]
            for h in self._handles:
                await h.aclose()


async def _merge(gens: list[AsyncIterator[Delta]], deadline: float | None) -> AsyncIterator[Delta]:
    """Interleave async iterators as their items come; past ``deadline`` raise a 504. Closing this generator
    cancels the ones still running and waits until each has cleaned up."""

    async def next_of(g: AsyncIterator[Delta]) -> Delta:
        return await g.__anext__()

    loop = asyncio.get_running_loop()
    pending: dict[asyncio.Future[Delta], AsyncIterator[Delta]] = {}
    for g in gens:
        pending[asyncio.ensure_future(next_of(g))] = g
    try:
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise GatewayTimeoutError("The request ran past the server's request timeout.")
            for fut in done:
                g = pending.pop(fut)
                try:
                    delta = fut.result()
                except StopAsyncIteration:
                    continue
                yield delta
                pending[asyncio.ensure_future(next_of(g))] = g
    finally:
        for fut in pending:
            fut.cancel()
        with anyio.CancelScope(shield=True):
            if pending:
                await asyncio.wait(pending)
            for fut in pending:
                if not fut.cancelled():
                    fut.exception()
            for g in gens:
                await g.aclose()  # type: ignore[attr-defined]
