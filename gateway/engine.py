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

Prefix reuse (later): a ``ChoiceSpec`` carries the whole prompt and ``_prefill`` feeds only what the
session does not already hold (``session.token_ids``), rolling back to the common prefix first; a future
session pool can hand ``start`` a warm session and the loop needs no change.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch

from gateway.backend import DecodeSession, ModelBackend
from gateway.detokenize import IncrementalDetokenizer, TokenVocab
from gateway.errors import (
    ContextLengthExceededError,
    GatewayTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
)
from gateway.sampling import Sampler, SamplingParams, top_logprobs
from gateway.settings import GatewaySettings
from gateway.stop import StopMatcher

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


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = "length"
    completion_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        self.completion_tokens = delta.completion_tokens
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


class _SessionHandle:
    """Owns one ``DecodeSession``: its blocking calls run one at a time in a worker thread, and ``aclose``
    waits for the call in flight (even an ``open_session`` whose caller was cancelled) before closing it."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self.session: DecodeSession | None = None
        self._opening: asyncio.Future[DecodeSession] | None = None
        self._inflight: asyncio.Future[Any] | None = None
        self._closed = False

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("session already closed")
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._inflight = fut
        # shield: a cancelled caller must not leave the thread running while we close the session
        return await asyncio.shield(fut)

    async def open(self, backend: ModelBackend, max_length: int) -> None:
        fut = asyncio.get_running_loop().run_in_executor(self._executor, backend.open_session, max_length)
        self._opening = self._inflight = fut
        self.session = await asyncio.shield(fut)

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
            if self.session is not None:
                try:
                    await asyncio.get_running_loop().run_in_executor(self._executor, self.session.close)
                except Exception:
                    logger.exception("closing a decode session failed")


class Engine:
    """The gateway's head: request-level checks that need the model, and generation."""

    def __init__(self, backend: ModelBackend, settings: GatewaySettings):
        self.backend = backend
        self.settings = settings
        self.tokenizer = backend.tokenizer
        self.vocab = TokenVocab(self.tokenizer)
        self.eos_ids = eos_token_ids(backend)
        self.executor = ThreadPoolExecutor(settings.backend_threads, thread_name_prefix="swarmserve-backend")

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

    async def start(self, specs: Sequence[ChoiceSpec]) -> Generation:
        """Open one session per choice; raise (nothing left open) if any cannot be opened."""
        handles = [_SessionHandle(self.executor) for _ in specs]
        try:
            results = await asyncio.gather(
                *(
                    h.open(self.backend, len(s.prompt_ids) + s.max_tokens)
                    for h, s in zip(handles, specs, strict=True)
                ),
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

    def _prefill(self, session: DecodeSession, prompt_ids: list[int]) -> torch.Tensor:
        """Feed what the session does not hold yet; rolls back to the common prefix of a reused session."""
        held = list(session.token_ids)
        common = 0
        for a, b in zip(held, prompt_ids, strict=False):
            if a != b:
                break
            common += 1
        if common == len(prompt_ids):  # the whole prompt is cached: recompute its last token's logits
            common -= 1
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
    ) -> tuple[int, TokenLogprob | None, list[TokenLogprob] | None]:
        if spec.prompt_logprobs:
            logits, scored = self._score_prompt(session, spec.prompt_ids, spec.logprobs or 0)
        else:
            logits, scored = self._prefill(session, spec.prompt_ids), None
        token, lp = self._sample(logits, sampler, spec.logprobs)
        return token, lp, scored

    def _next_token(
        self, session: DecodeSession, token: int, sampler: Sampler, k: int | None
    ) -> tuple[int, TokenLogprob | None]:
        return self._sample(session.step([token]), sampler, k)

    async def _run_choice(self, spec: ChoiceSpec, handle: _SessionHandle) -> AsyncIterator[Delta]:
        """Decode one choice, yielding text as soon as it is final (no partial characters, no text that might
        still turn out to be a stop string). Closes the session however it ends."""
        try:
            session = handle.session
            assert session is not None
            sampler = Sampler(spec.sampling, spec.prompt_ids)
            detok = IncrementalDetokenizer(self.tokenizer, spec.prompt_ids)
            stopper = StopMatcher(spec.stop)
            pending: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet
            text, finish, produced = "", "length", 0
            token, lp, prompt_lps = await handle.call(self._first_token, session, spec, sampler)
            while True:
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
                        spec.index, text, pending, completion_tokens=produced, prompt_logprobs=prompt_lps
                    )
                    pending, prompt_lps, text = [], None, ""
                if produced >= spec.max_tokens:
                    break
                token, lp = await handle.call(self._next_token, session, token, sampler, spec.logprobs)
            if not stopper.stopped:  # release what was held: an incomplete character, a would-be stop string
                text = stopper.push(detok.flush())
                text += "" if stopper.stopped else stopper.flush()
            if stopper.stopped:
                finish = "stop"
            yield Delta(spec.index, text, pending, finish, produced, prompt_lps)
        finally:
            await handle.aclose()


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
