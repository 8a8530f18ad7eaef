"""Server-sent event streams in OpenAI's shape.

A chat stream is: one role chunk per choice (``delta: {"role": "assistant", "content": ""}``), content
chunks, exactly one finishing chunk per choice (``delta: {}`` + ``finish_reason``), with
``stream_options.include_usage`` a usage chunk with ``choices: []``, then ``data: [DONE]``. Every chunk has
the same ``id``. A completions stream has no role chunk and puts ``finish_reason`` on its last chunk.
An error after the 200 is a ``data: {"error": {...}}`` frame, then ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NotRequired, Protocol, TypedDict, Unpack

from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from gateway.api.logprobs import LegacyLogprobs, chat_logprobs
from gateway.decode.choices import Delta
from gateway.decode.detokenize import TokenVocab
from gateway.decode.generation import Generation
from gateway.errors import to_gateway_error
from gateway.schema.replies import (
    ChatCompletionChunk,
    ChoiceDelta,
    ChoiceDeltaFunctionCall,
    ChoiceDeltaToolCall,
    ChunkChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionUsage,
)
from gateway.tools.parser import ToolCallParser
from gateway.tools.plan import ToolPlan

logger = logging.getLogger(__name__)

__all__ = [
    "ChatChunkBuilder",
    "ChunkBuilder",
    "CompletionChunkBuilder",
    "DONE",
    "error_frame",
    "event_stream",
]

DONE = "[DONE]"


class ChunkBuilder(Protocol):
    def opening(self) -> list[str]: ...

    def frames(self, delta: Delta) -> list[str]: ...

    def usage(self) -> str | None:
        """The usage frame, or None when the client did not ask for one."""


def error_frame(exc: BaseException) -> str:
    """The ``data:`` payload for an error that happens after the stream's 200 went out."""
    return json.dumps(to_gateway_error(exc).payload(), separators=(",", ":"), ensure_ascii=False)


class _BuilderArgs(TypedDict):
    """The keyword arguments every builder passes on to ``_BaseChunkBuilder``."""

    id: str
    model: str
    prompt_tokens: int
    include_usage: bool
    created: NotRequired[int | None]
    system_fingerprint: NotRequired[str | None]


class _BaseChunkBuilder:
    def __init__(
        self,
        *,
        id: str,
        model: str,
        prompt_tokens: int,
        include_usage: bool,
        created: int | None = None,
        system_fingerprint: str | None = None,
    ):
        self.id = id
        self.model = model
        self.fingerprint = system_fingerprint
        self.created = created if created is not None else int(time.time())
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self._completion_tokens: dict[int, int] = {}

    def _head(self) -> dict[str, Any]:
        """The fields every chunk of this stream repeats."""
        return {"id": self.id, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}

    def _dump(self, chunk: BaseModel) -> str:
        # OpenAI sends "usage": null on every chunk when usage was asked for, and no key otherwise
        exclude = None if self.include_usage else {"usage"}
        return chunk.model_dump_json(exclude=exclude)

    def _count(self, delta: Delta) -> None:
        self._completion_tokens[delta.index] = delta.completion_tokens

    def usage(self) -> str | None:
        if not self.include_usage:
            return None
        completion = sum(self._completion_tokens.values())
        usage = CompletionUsage(
            completion_tokens=completion,
            prompt_tokens=self.prompt_tokens,
            total_tokens=self.prompt_tokens + completion,
        )
        return self._usage_chunk(usage)

    def _usage_chunk(self, usage: CompletionUsage) -> str:
        raise NotImplementedError


class ChatChunkBuilder(_BaseChunkBuilder):
    """Chat chunks; with a ``ToolPlan``, each choice's text goes through its ``ToolCallParser`` and calls
    come out as ``delta.tool_calls`` (id, type and name on a call's first chunk, then argument pieces)."""

    def __init__(
        self,
        *,
        n: int,
        vocab: TokenVocab,
        logprobs: bool,
        tools: ToolPlan | None = None,
        **kw: Unpack[_BuilderArgs],
    ):
        super().__init__(**kw)
        self.n = n
        self.vocab = vocab
        self.logprobs = logprobs
        self.tools = tools
        self._parsers: dict[int, ToolCallParser] = {}

    def _chunk(self, choices: list[ChunkChoice]) -> str:
        return self._dump(
            ChatCompletionChunk(choices=choices, **self._head())
        )

    def opening(self) -> list[str]:
        return [
            self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
            for i in range(self.n)
        ]

    def frames(self, delta: Delta) -> list[str]:
        self._count(delta)
        if self.tools is not None:
            return self._tool_frames(delta, self.tools)
        out = []
        if delta.text or (self.logprobs and delta.logprobs):
            logprobs = chat_logprobs(self.vocab, delta.logprobs) if self.logprobs else None
            out.append(
                self._chunk(
                    [ChunkChoice(index=delta.index, delta=ChoiceDelta(content=delta.text), logprobs=logprobs)]
                )
            )
        if delta.finish_reason is not None:
            out.append(
                self._chunk(
                    [ChunkChoice(index=delta.index, delta=ChoiceDelta(), finish_reason=delta.finish_reason)]
                )
            )
        return out

    def _tool_frames(self, delta: Delta, tools: ToolPlan) -> list[str]:
        parser = self._parsers.setdefault(delta.index, tools.parser())
        events = parser.feed(delta.text)
        if delta.finish_reason is not None:
            events += parser.finish()
        logprobs = chat_logprobs(self.vocab, delta.logprobs) if self.logprobs and delta.logprobs else None
        out = []
        for event in events:
            if isinstance(event, str):
                choice_delta = ChoiceDelta(content=event)
            else:
                function = ChoiceDeltaFunctionCall(name=event.name, arguments=event.arguments)
                call = ChoiceDeltaToolCall(
                    index=event.index, id=event.id, type="function" if event.id else None, function=function
                )
                choice_delta = ChoiceDelta(tool_calls=[call])
            out.append(self._chunk([ChunkChoice(index=delta.index, delta=choice_delta, logprobs=logprobs)]))
            logprobs = None  # on the first chunk of the delta only
        if logprobs is not None:  # tokens whose text the parser holds: their logprobs go out now
            out.append(self._chunk([ChunkChoice(index=delta.index, delta=ChoiceDelta(content=""), logprobs=logprobs)]))
        if delta.finish_reason is not None:
            reason = "tool_calls" if parser.calls and delta.finish_reason == "stop" else delta.finish_reason
            out.append(self._chunk([ChunkChoice(index=delta.index, delta=ChoiceDelta(), finish_reason=reason)]))
        return out

    def _usage_chunk(self, usage: CompletionUsage) -> str:
        chunk = ChatCompletionChunk(
            choices=[], usage=usage, **self._head()
        )
        return chunk.model_dump_json()


class CompletionChunkBuilder(_BaseChunkBuilder):
    def __init__(self, *, vocab: TokenVocab, logprobs: bool, **kw: Unpack[_BuilderArgs]):
        super().__init__(**kw)
        self.vocab = vocab
        self.logprobs = logprobs
        self._legacy: dict[int, LegacyLogprobs] = {}

    def opening(self) -> list[str]:
        return []

    def frames(self, delta: Delta) -> list[str]:
        self._count(delta)
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return []
        logprobs = None
        if self.logprobs:
            legacy = self._legacy.setdefault(delta.index, LegacyLogprobs(self.vocab))
            logprobs = legacy.build(delta.logprobs)
        choice = CompletionChoice(
            finish_reason=delta.finish_reason,
            index=delta.index,
            logprobs=logprobs,
            text=delta.text,
        )
        return [
            self._dump(CompletionChunk(choices=[choice], **self._head()))
        ]

    def _usage_chunk(self, usage: CompletionUsage) -> str:
        return CompletionChunk(
            choices=[], usage=usage, **self._head()
        ).model_dump_json()


async def _frames(generation: Generation, builder: ChunkBuilder) -> AsyncIterator[str]:
    """``data:`` payloads; sse-starlette frames each as ``data: ...`` + blank line."""
    try:
        for frame in builder.opening():
            yield frame
        async for delta in generation:
            for frame in builder.frames(delta):
                yield frame
        usage = builder.usage()
        if usage is not None:
            yield usage
    except Exception as exc:  # the 200 is out: the error goes in the stream
        err = to_gateway_error(exc)
        log = logger.exception if err.status_code == 500 else logger.warning  # a trace only for bugs
        log("stream failed after it started: %s", err.message)
        yield error_frame(err)
    finally:
        await generation.aclose()
    yield DONE


def event_stream(
    generation: Generation, builder: ChunkBuilder, headers: dict[str, str] | None = None
) -> EventSourceResponse:
    """The SSE response for a started generation. A client that disconnects cancels the frame generator,
    whose ``finally`` closes every session; the background task closes them too if the stream never began."""
    return EventSourceResponse(
        _frames(generation, builder),
        headers=headers,
        sep="\n",
        background=BackgroundTask(generation.aclose),
    )
