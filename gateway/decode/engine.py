"""The decode loop: turns a request's choices into tokens through any ``ModelBackend`` (gateway/backends/base.py) —
sessions, sampling, stop conditions, cancellation, the request's deadline.

Only the backend protocol is used, so ``LocalBackend`` and the swarm backend are interchangeable. The
generate loop is a chain of small verbs: ``Engine.start`` opens one session per choice (so a
``NoRouteError`` is still a proper 503, before any stream starts), ``run_choice`` prefills and decodes one
choice, and the ``Generation`` it returns (gateway/decode/generation.py) interleaves the choices as their tokens
come. The request-level checks (prompt rendering, context limits) are ``PromptRules``' (gateway/decode/prompting.py);
each session is held by a ``SessionHandle`` (gateway/decode/session_handle.py), which also resumes and keeps
sessions across requests.

Threading: every backend call (open/step/close) and the sampling that follows a step run in a worker
thread — ``asyncio.to_thread``-style, but in the engine's own pool of ``settings.backend_threads``, since a
swarm step blocks on the network and the loop's default pool has only ``cpu_count + 4`` threads. Prompts
are rendered and tokenized on one more thread, ``tokenize`` (gateway/decode/tokenize_thread.py, with its own copy
of the tokenizer); ``tokenizer`` itself turns the tokens back into text on the event loop. With a
``BatchingBackend``, the decode steps of concurrent choices go out together (gateway/decode/batch.py); a
late step (a frozen server, a failover) holds up only its own choice (gateway/backends/swarm_steps.py).

Prefix reuse (an affinity store and a ``ResumableBackend``): ``start`` claims the cached session sharing the
longest prefix with choice 0's prompt and ``prefill`` (gateway/decode/prefill.py) feeds only what that session
does not already hold (``session.token_ids``), rolling back to the common prefix first; the tokens it did not
have to send are the choice's ``cached_tokens`` (only sessions of the choice's LoRA adapter are candidates).
Sessions ask for what the choice needs (prompt + ``max_tokens``); a later turn that resumes one raises its cap
(the servers grow caches on demand: nothing is reserved). Only choice 0 takes part (the other choices of
``n > 1`` share its prompt but would need copies of the same caches; they prefill as before).
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from gateway.affinity.sessions import AffinityStore
from gateway.backends.base import (
    BatchingBackend,
    DecodeSession,
    ModelBackend,
    ResumableBackend,
    accepts_on_ready,
    can_resume,
    can_speculate,
)
from gateway.decode.batch import Deliver, StepGatherer
from gateway.decode.capacity_queue import CapacityQueue
from gateway.decode.choices import ChoiceResult, ChoiceSpec, Delta, FinishReason, TokenLogprob
from gateway.decode.detokenize import IncrementalDetokenizer
from gateway.decode.generation import Generation
from gateway.decode.prefill import first_token, max_length, sample
from gateway.decode.prompting import PromptRules, eos_token_ids
from gateway.decode.sampling import Sampler
from gateway.decode.session_handle import ReusableSession, Reuse, SessionHandle
from gateway.decode.speculators import Speculators
from gateway.decode.stop import StopMatcher
from gateway.grammars.structured import StructuredOutputs
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.speculation.verify import ChoiceSpeculator, StepCosts
from swarm_client.errors import SessionLost

__all__ = ["ChoiceResult", "ChoiceSpec", "Delta", "Engine", "Generation", "TokenLogprob", "eos_token_ids"]


@dataclass
class _DecodeItem:
    """One choice's next decode step, for ``Engine._decode_batch``."""

    session: DecodeSession
    token: int
    sampler: Sampler
    k: int | None
    #: the choice's speculation (None: plain decoding) and the guesses this step carries
    speculator: ChoiceSpeculator | None = None
    drafts: list[int] = field(default_factory=list)


class Engine(PromptRules):
    """The gateway's head: request-level checks that need the model (``PromptRules``), and generation."""

    def __init__(self, backend: ModelBackend, settings: GatewaySettings, store: AffinityStore | None = None):
        super().__init__(backend, settings)
        self.eos_ids = eos_token_ids(backend)
        self.executor = ThreadPoolExecutor(settings.backend_threads, thread_name_prefix="swarmserve-backend")
        #: compiles ``response_format`` into per-choice token masks (structured outputs)
        self.structured = StructuredOutputs(self.tokenizer, self.eos_ids, self.executor)
        #: requests that found the swarm full wait here for room, in order (gateway/decode/capacity_queue.py)
        self.capacity = CapacityQueue(settings.busy_queue_timeout_s)
        #: the app's metrics (gateway/metrics.py; set by ``install_metrics``); None: nothing is measured
        self.metrics: GatewayMetrics | None = None
        #: each choice's drafter and how many guesses pay (gateway/speculation/)
        self.speculators = Speculators(settings, StepCosts(), enabled=can_speculate(backend))
        #: the backend, when it can reuse sessions across requests
        self.resumable: ResumableBackend | None = backend if can_resume(backend) else None
        #: the affinity store, when both it and the backend can reuse sessions across requests
        self.store = store if store is not None and self.resumable is not None else None
        self.replica_id = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        #: the backend, when the decode steps of concurrent choices are gathered into its ``step_many``
        self.batching: BatchingBackend | None = None
        #: gathers the decode steps of concurrent choices into one call (None: each steps on its own)
        self.decoder: StepGatherer[_DecodeItem, Any] | None = None
        #: whether its ``step_many`` hands results over before its late steps complete
        self._early_results = False
        if settings.batch_decode and isinstance(backend, BatchingBackend):
            self.batching = backend
            self._early_results = accepts_on_ready(backend)
            self.decoder = StepGatherer(self.executor, functools.partial(self._decode_batch, backend))

    def close(self) -> None:
        """Stop the worker threads (the backend belongs to the caller and stays open)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.tokenize.close()
        self.speculators.close()

    # ---------------------------------------------------------------------------------------- generation

    async def start(
        self, specs: Sequence[ChoiceSpec], session_key: str | None = None, owner: str = "", keep: bool = True
    ) -> Generation:
        """Open one session per choice; raise (nothing left open) if any cannot be opened. Choice 0 resumes
        the cached session sharing the longest prefix with its prompt (``session_key``'s, when given) among
        ``owner``'s (an API key's, a client's: nobody resumes, nor measures, someone else's cache), and is kept
        for a later request when it ends — unless ``keep`` is False (a one-off: gateway/affinity/one_off.py),
        whose choices neither resume nor keep anything."""
        opener = functools.partial(self._open_all, specs, session_key, owner, keep)
        handles = await self.capacity.admit(opener)
        timeout = self.settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout if timeout > 0 else None
        return Generation(self.run_choice, list(specs), handles, deadline)

    async def _open_all(
        self, specs: Sequence[ChoiceSpec], session_key: str | None, owner: str = "", keep: bool = True
    ) -> list[SessionHandle]:
        """One open session per choice, or an exception and nothing left open (a full swarm's
        ``SwarmBusyError`` sends the request to wait in ``capacity``)."""
        reuse = await self._claim(specs[0], session_key, owner) if specs and keep else None
        handles = [SessionHandle(self.executor, reuse if i == 0 else None) for i in range(len(specs))]
        try:
            results = await asyncio.gather(
                *(h.open(self.backend, max_length(s), s.adapter) for h, s in zip(handles, specs, strict=True)),
                return_exceptions=True,
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            for h in handles:
                await h.aclose()
            raise
        return handles

    async def _claim(self, spec: ChoiceSpec, session_key: str | None, owner: str) -> Reuse | None:
        # a store is kept only with a resumable backend; scoring the prompt feeds it token by token anyway
        if self.store is None or self.resumable is None or spec.prompt_logprobs:
            return None
        claim = await self.store.claim(spec.prompt_ids, session_key, owner, spec.adapter)
        return None if claim is None else Reuse(self.resumable, self.store, claim, self.replica_id)

    def _next_tokens(self, item: _DecodeItem) -> list[tuple[int, TokenLogprob | None]]:
        """Feed the item's token (and guesses) alone; the tokens that step yields."""
        if item.speculator is not None:
            item.drafts = item.speculator.drafts()
        started = time.perf_counter()
        if item.drafts:
            logits = item.session.step([item.token, *item.drafts], all_logits=True)
        else:
            logits = item.session.step([item.token])
        return self._settle(item, logits, time.perf_counter() - started)

    def _settle(self, item: _DecodeItem, logits: torch.Tensor, seconds: float) -> list[tuple[int, TokenLogprob | None]]:
        """A step's logits → the tokens it yields: one sample, or the verified guesses
        (gateway/speculation/verify.py)."""
        if item.speculator is None:
            self.speculators.costs.observe(1, seconds)  # plain choices teach what a one-token step costs too
            return [sample(logits, item.sampler, item.k)]
        sampler = item.sampler
        return item.speculator.settle(
            item.session,
            item.drafts,
            logits,
            lambda row: sample(row, sampler, item.k),
            lambda token: token in self.eos_ids or sampler.finished,
            seconds,
        )

    async def _decode(self, handle: SessionHandle, item: _DecodeItem) -> list[tuple[int, TokenLogprob | None]]:
        """Feed the item's token and sample what follows (several tokens when guesses are kept): with the other
        choices' steps (``decoder``), or alone."""
        if self.decoder is None or self.batching is None:  # set together
            return await handle.call(self._next_tokens, item)
        inner = item.session.inner if isinstance(item.session, ReusableSession) else item.session
        group = self.batching.step_group(inner)
        return await handle.wait(handle.track(self.decoder.submit(handle, item, group)))

    def _decode_batch(self, backend: BatchingBackend, items: Sequence[_DecodeItem], deliver: Deliver) -> list[Any]:
        """Step every item's session at once (``backend.step_many``), then sample each; one result or
        exception per item. A resumed session the servers lost recovers by itself (``ReusableSession``).
        Results the backend hands over early (its late steps need not hold up the rest) are sampled and
        ``deliver``ed at once, each sampled exactly once."""
        inner = [i.session.inner if isinstance(i.session, ReusableSession) else i.session for i in items]
        for item in items:
            item.drafts = item.speculator.drafts() if item.speculator is not None else []
        all_logits = any(item.drafts for item in items)
        tokens = [[i.token, *i.drafts] for i in items]
        sampled: dict[int, Any] = {}
        started = time.perf_counter()

        def on_ready(pairs: list[tuple[int, Any]]) -> None:
            done = [(i, self._complete(items[i], logits, started)) for i, logits in pairs if i not in sampled]
            sampled.update(done)
            deliver(done)

        options: dict[str, Any] = {"all_logits": True} if all_logits else {}
        if self._early_results:
            options["on_ready"] = on_ready
        logits_or_errors = backend.step_many(inner, tokens, **options)
        return [
            sampled[i] if i in sampled else self._complete(item, logits, started)
            for i, (item, logits) in enumerate(zip(items, logits_or_errors, strict=True))
        ]

    def _complete(self, item: _DecodeItem, logits: Any, started: float) -> Any:
        """One item's step result (logits — every position's when the batch carried guesses — or an
        exception) → the tokens it yields, or the exception."""
        try:
            seconds = time.perf_counter() - started
            reusable = item.session if isinstance(item.session, ReusableSession) else None
            fed = [item.token, *item.drafts]
            if isinstance(logits, SessionLost) and reusable is not None and reusable.resumed:
                logits = reusable.recover(fed, logits, all_logits=bool(item.drafts))  # as its step() would
            if isinstance(logits, BaseException):
                return logits
            if logits.dim() == 2 and not item.drafts:  # a plain step of a batch that carried guesses
                logits = logits[-1]
            return self._settle(item, logits, seconds)
        except Exception as e:
            return e

    async def run_choice(self, spec: ChoiceSpec, handle: SessionHandle) -> AsyncGenerator[Delta, None]:
        """Decode one choice, yielding text as soon as it is final (no partial characters, no text that might
        still turn out to be a stop string). Closes the session however it ends."""
        produced = reused = 0
        speculator: ChoiceSpeculator | None = None
        priming: asyncio.Future | None = None
        try:
            session = handle.session
            assert session is not None
            sampler = Sampler(spec.sampling, spec.prompt_ids)
            detok = IncrementalDetokenizer(
                self.tokenizer, spec.prompt_ids, skip_special_tokens=not spec.keep_special_tokens
            )
            stopper = StopMatcher(spec.stop)
            speculator = self.speculators.for_choice(spec, sampler.allowed_prefix if sampler.constraint else None)
            pending: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet
            text, produced = "", 0
            finish: FinishReason = "length"
            if speculator is not None:  # the drafter reads the prompt while the servers prefill it
                priming = asyncio.get_running_loop().run_in_executor(self.executor, speculator.prime)
            first, lp, prompt_lps, reused = await handle.call(first_token, session, spec, sampler)
            if priming is not None:
                await priming
            tokens = [(first, lp)]
            clock = self._token_clock(handle.opened_at, first=True)
            ended = False
            while not ended:
                cached = 0 if handle.cached_tokens_lost else reused
                for i, (token, lp) in enumerate(tokens):  # one sampled token, or several when guesses were kept
                    produced += 1
                    ended = True
                    if token in self.eos_ids:
                        finish = "stop"
                        break
                    if lp is not None:
                        pending.append(lp)
                    text += stopper.push(detok.push(token))
                    if stopper.stopped:
                        break
                    # the grammar is complete: EOS is all it would allow. Its state is the whole step's, and
                    # the token that completed it is the step's last (``verify`` ends the list there)
                    if sampler.finished and i == len(tokens) - 1:
                        finish = "stop"
                        break
                    if produced >= spec.max_tokens:
                        break
                    ended = False
                if text and not stopper.stopped:
                    yield Delta(
                        spec.index,
                        text,
                        pending,
                        completion_tokens=produced,
                        prompt_logprobs=prompt_lps,
                        cached_tokens=cached,
                        speculation=speculator.stats if speculator is not None else None,
                    )
                    pending, prompt_lps, text = [], None, ""
                if ended:
                    break
                if speculator is not None:
                    speculator.emitted([t for t, _ in tokens])
                item = _DecodeItem(session, tokens[-1][0], sampler, spec.logprobs, speculator)
                tokens = await self._decode(handle, item)
                clock = self._token_clock(clock, len(tokens))
            if self.decoder is not None:
                self.decoder.forget(handle)  # the next batch need not wait for this choice
            if not stopper.stopped:  # release what was held: an incomplete character, a would-be stop string
                text += stopper.push(detok.flush())
                text += "" if stopper.stopped else stopper.flush()
            if stopper.stopped:
                finish = "stop"
            handle.completed = True
            cached = 0 if handle.cached_tokens_lost else reused
            stats = speculator.stats if speculator is not None else None
            yield Delta(spec.index, text, pending, finish, produced, prompt_lps, cached, stats)
        finally:
            if self.decoder is not None:
                self.decoder.forget(handle)
            if self.metrics is not None and produced:
                cached = 0 if handle.cached_tokens_lost else reused
                self.metrics.observe_usage(len(spec.prompt_ids), produced, cached)
                if speculator is not None:
                    self.metrics.observe_speculation(speculator.stats)
            if speculator is not None and (priming is None or priming.done()):
                speculator.close()  # (a drafter still priming is dropped instead: its thread still reads it)
            await handle.aclose()
            self.capacity.released()

    def _token_clock(self, since: float, tokens: int = 1, *, first: bool = False) -> float:
        """Record the time to the first token (``since`` = the session's opening) or between two tokens (a
        step that yielded ``tokens`` counts that many, each an equal share); return now, where the next
        token's time starts."""
        now = time.perf_counter()
        if self.metrics is not None:
            if first:
                self.metrics.time_to_first_token.observe(now - since)
            for _ in range(0 if first else tokens):
                self.metrics.inter_token_latency.observe((now - since) / tokens)
        return now
