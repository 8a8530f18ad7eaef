"""The request parts both OpenAI endpoints (and the Responses API) share: choice counts, stop lists,
sampling parameters, admission against the swarm's KV cache, the session key that names a conversation,
usage, and cancelling work when the client leaves.

Session affinity: the ``X-Session-Id`` header, else the ``user`` field, names the conversation whose cached
session the request resumes (without either, the engine matches the prompt's prefix).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel

from gateway.admission.auth import owner_of
from gateway.api.streaming import ChunkBuilder
from gateway.backends.swarm_view import backend_room
from gateway.decode.capacity_queue import Need
from gateway.decode.choices import ChoiceResult, ChoiceSpec, Delta
from gateway.decode.engine import Engine
from gateway.decode.sampling import SamplingParams
from gateway.errors import InvalidRequestError
from gateway.schema.replies import CompletionTokensDetails, CompletionUsage, PromptTokensDetails, SpeculationUsage
from gateway.speculation.verify import SpeculationStats

__all__ = [
    "CLIENT_CLOSED",
    "IGNORED_FIELDS_HEADER",
    "SESSION_HEADER",
    "CachedTokensUsage",
    "admission_need",
    "cancel_on_disconnect",
    "check_stream_options",
    "cache_owner",
    "count_choices",
    "ignored_fields",
    "logit_bias_ids",
    "sampling_params",
    "session_key",
    "stop_list",
    "prediction_text",
    "speculation_usage",
    "usage_of",
]

T = TypeVar("T")

#: HTTP 499: nginx's "client closed request" — nobody reads it, but logs and metrics do
CLIENT_CLOSED = 499
#: names the conversation whose cached session a request continues (else the ``user`` field does)
SESSION_HEADER = "x-session-id"
#: lists the request fields the gateway did not know and ignored (they are also logged), as vLLM warns
IGNORED_FIELDS_HEADER = "x-swarmserve-ignored-fields"
_MAX_IGNORED_LISTED, _MAX_IGNORED_HEADER = 32, 1024


def count_choices(engine: Engine, n: int | None, prompts: int) -> int:
    n = n or 1
    limit = engine.settings.max_choices
    if n * prompts > limit:
        raise InvalidRequestError(f"n: at most {limit} choices per request (asked for {n * prompts}).", param="n")
    return n


#: the code of the 400 for a request the swarm's KV cache could never hold
CACHE_CAPACITY_EXCEEDED = "cache_capacity_exceeded"


def admission_need(engine: Engine, specs: Sequence[ChoiceSpec]) -> Need | None:
    """What ``specs`` will hold of the swarm's KV cache (each choice is one session of prompt + max_tokens
    token slots), for the gateway's reservations (``gateway/decode/capacity_queue.py``); None without a swarm.
    A request the swarm could never hold is a 400 naming the limit and what would fit: a choice longer than
    the largest cache any one server of some block has (``max_tokens``), or ``n`` choices over all the
    cache the servers of the most constrained block announce together (``n``)."""
    room = backend_room(engine.backend)
    if room is None or not specs:
        return None
    sizes = [len(s.prompt_ids) + s.max_tokens for s in specs]
    longest = max(sizes)
    if longest > room.largest:
        spec = specs[sizes.index(longest)]
        prompt, fits = len(spec.prompt_ids), room.largest - len(spec.prompt_ids)
        if fits > 0:
            message = (
                f"max_tokens: {prompt} prompt tokens + max_tokens {spec.max_tokens} = {longest} tokens per choice "
                f"exceed the largest KV cache any server of the swarm holds ({room.largest} tokens); at most "
                f"max_tokens={fits} fits this prompt."
            )
        else:
            message = (
                f"the prompt is {prompt} tokens, more than the largest KV cache any server of the swarm holds "
                f"({room.largest} tokens): shorten the conversation (its history, system prompt or tools) or start "
                "a new one."
            )
        raise InvalidRequestError(
            message,
            param="max_tokens",
            code=CACHE_CAPACITY_EXCEEDED,
        )
    total = sum(sizes)
    if total > room.total:
        n, per = len(specs), room.total // len(specs) - max(len(s.prompt_ids) for s in specs)
        other = f", or max_tokens={per} with n={n}" if per > 0 else ""
        raise InvalidRequestError(
            f"n: {n} choices × (prompt + max_tokens) = {total} tokens exceed the swarm's whole KV cache "
            f"({room.total} tokens, all servers of its most constrained block together); at most "
            f"n={room.total // longest} fits at this max_tokens{other}.",
            param="n",
            code=CACHE_CAPACITY_EXCEEDED,
        )

    def capacity() -> int | None:
        now = backend_room(engine.backend)
        return None if now is None else now.total

    return Need(total, capacity)


def check_stream_options(stream: bool | None, stream_options: object) -> None:
    if stream_options is not None and not stream:
        raise InvalidRequestError("stream_options: only allowed when stream is true.", param="stream_options")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


class SamplingKnobs(Protocol):
    """The sampling fields every generation request has (chat, completions, the Responses API)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None


def sampling_params(engine: Engine, req: SamplingKnobs, seed: int | None, constraint: Any = None) -> SamplingParams:
    """``req``'s sampling, checked; the penalties and ``logit_bias`` of chat and completions where ``req``
    has them (the Responses API does not)."""
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise InvalidRequestError("top_k: must be -1 (off), 0 (off) or a positive integer.", param="top_k")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(top_k, 0),
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        frequency_penalty=_declared(req, "frequency_penalty") or 0.0,
        presence_penalty=_declared(req, "presence_penalty") or 0.0,
        logit_bias=logit_bias_ids(engine, _declared(req, "logit_bias")),
        seed=seed,
        constraint=constraint,
    )


def _declared(req: object, name: str) -> Any:
    """A field the request's model declares (so pydantic validated it), else None: an unknown extra field of
    the same name (request models keep them) is never read."""
    fields = getattr(type(req), "model_fields", {})
    return getattr(req, name) if name in fields else None


def logit_bias_ids(engine: Engine, bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``{"token id as string": bias in [-100, 100]}``."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias: key {key!r} is not a token id.", param="logit_bias") from None
        if not 0 <= token < engine.vocab_size:
            raise InvalidRequestError(f"logit_bias: token id {token} is out of range.", param="logit_bias")
        if not -100 <= value <= 100:
            raise InvalidRequestError(f"logit_bias: bias {value} is outside [-100, 100].", param="logit_bias")
        out[token] = float(value)
    return out


def session_key(request: Request, user: str | None) -> str | None:
    return request.headers.get(SESSION_HEADER) or user or None


def usage_of(prompt_tokens: int, results: list[ChoiceResult]) -> CompletionUsage:
    completion = sum(r.completion_tokens for r in results)
    return CompletionUsage(
        completion_tokens=completion,
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in results)),
        **speculation_usage([r.speculation for r in results]),
    )


def prediction_text(prediction: dict[str, Any] | None) -> str | None:
    """The text of a chat request's ``prediction`` (OpenAI's Predicted Outputs: ``{"type": "content",
    "content": str | [{"type": "text", "text": str}, ...]}``): text the answer is likely to repeat, which the
    prompt-lookup drafter may copy from. Any other shape is a 400."""
    if prediction is None:
        return None
    content = prediction.get("content")
    if prediction.get("type") != "content" or content is None:
        raise InvalidRequestError(
            'prediction: expected {"type": "content", "content": "..."}.', param="prediction"
        )
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise InvalidRequestError(
        'prediction.content: expected a string or a list of {"type": "text", "text": "..."} parts.',
        param="prediction.content",
    )


def speculation_usage(stats: Sequence[SpeculationStats | None]) -> dict[str, Any]:
    """The usage fields of the choices' speculative decoding: ``completion_tokens_details``' accepted and
    rejected prediction tokens, and the ``speculation`` extension; none when no choice speculated."""
    used = [s for s in stats if s is not None]
    if not used:
        return {}
    drafted, accepted = sum(s.drafted for s in used), sum(s.accepted for s in used)
    return {
        "completion_tokens_details": CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted
        ),
        "speculation": SpeculationUsage(
            drafter=",".join(sorted({s.drafter for s in used})),
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            steps=sum(s.steps for s in used),
        ),
    }


class CachedTokensUsage:
    """A ``ChunkBuilder`` whose usage frame also reports ``prompt_tokens_details.cached_tokens`` (the
    builders in gateway/api/streaming.py count completion tokens only)."""

    def __init__(self, inner: ChunkBuilder):
        self.inner = inner
        self.cached: dict[int, int] = {}
        self.speculation: dict[int, SpeculationStats | None] = {}

    def opening(self) -> list[str]:
        return self.inner.opening()

    def frames(self, delta: Delta) -> list[str]:
        self.cached[delta.index] = delta.cached_tokens
        self.speculation[delta.index] = delta.speculation
        return self.inner.frames(delta)

    def usage(self) -> str | None:
        frame = self.inner.usage()
        cached = sum(self.cached.values())
        speculation = speculation_usage(list(self.speculation.values()))
        if frame is None or not (cached or speculation):
            return frame
        chunk = json.loads(frame)
        chunk["usage"]["prompt_tokens_details"] = PromptTokensDetails(cached_tokens=cached).model_dump()
        chunk["usage"].update({k: v.model_dump() for k, v in speculation.items()})
        return json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; if the client disconnects first, cancel it (its sessions close in ``finally``) and
    return None. Starlette does not cancel a handler when the client leaves, so we watch for it."""
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result.append(await work)
        except Exception as exc:  # re-raised below, unwrapped by the task group's ExceptionGroup
            failure.append(exc)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return result[0] if result else None


def ignored_fields(req: BaseModel) -> dict[str, str]:
    """The ``x-swarmserve-ignored-fields`` header naming the request's unknown top-level fields, if any: a
    client can see that a parameter it sent (a typo, a newer API's) had no effect."""
    extra = sorted((req.model_extra or {}).keys())
    if not extra:
        return {}
    # names are the client's: percent-encoded so any name makes a valid header, and bounded in length
    listed = ",".join(urllib.parse.quote(name, safe="") for name in extra[:_MAX_IGNORED_LISTED])
    if len(extra) > _MAX_IGNORED_LISTED:
        listed += f",...({len(extra) - _MAX_IGNORED_LISTED} more)"
    return {IGNORED_FIELDS_HEADER: listed[:_MAX_IGNORED_HEADER]}


def cache_owner(request: Request) -> str:
    """Whose conversations a request may resume: its API key's id when the gateway checks keys, else the
    bearer token it sent (hashed; unverified, but it only ever isolates its sender), else the client's
    address. Affinity records and ``cached_tokens`` never cross owners (a shared prompt cache would let one
    key resume another's conversation, or learn how much of a guessed prompt matched it)."""
    owner = owner_of(request)  # the same owner as stored responses (gateway/admission/auth.py)
    if owner is not None:
        return f"key:{owner}"
    return f"addr:{request.client.host if request.client else ''}"
