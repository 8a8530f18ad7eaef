"""The SSE answer of ``POST /v1/responses``: ``response.created``, ``response.in_progress``, then each output
item's events (gateway/responses/output.py: ``response.output_item.added``, its text or call arguments in
deltas, their ``….done``, ``response.output_item.done``), then ``response.completed`` — or
``response.incomplete`` when ``max_output_tokens`` cut it short. Every SSE frame has ``event: <type>`` and
a ``sequence_number`` counting from 0. An error after the 200 is an ``error`` event and ``response.failed``
(with the items so far). The response is stored before its last event, so a follow-up sent the moment the
stream ends finds it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from gateway.decode.choices import ChoiceResult
from gateway.decode.generation import Generation
from gateway.errors import to_gateway_error
from gateway.responses.output import OutputItems, dump
from gateway.responses.store import ResponseStore
from gateway.responses.turn import Turn

logger = logging.getLogger(__name__)

__all__ = ["response_events"]


class _Sequencer:
    """SSE frames ``event: <type>`` + ``data: {..., "sequence_number": n}``, n counting from 0."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, type_: str, **fields: Any) -> dict[str, str]:
        payload = {"type": type_, "sequence_number": self.n, **fields}
        self.n += 1
        return {"event": type_, "data": json.dumps(payload, separators=(",", ":"), ensure_ascii=False)}


async def response_events(turn: Turn, generation: Generation, store: ResponseStore) -> AsyncIterator[dict[str, str]]:
    event = _Sequencer()
    items = OutputItems(turn.plan, turn.message_id, emit=event)
    result = ChoiceResult(0)
    try:
        yield event("response.created", response=dump(turn.response("in_progress")))
        yield event("response.in_progress", response=dump(turn.response("in_progress")))
        for frame in items.start():
            yield frame
        async for delta in generation:
            result.add(delta)
            for frame in items.feed(delta.text):
                yield frame
        status = turn.status_of(result)
        for frame in items.finish(status):
            yield frame
        final = turn.response(status, items.items, result)
        await turn.remember(store, items, final)
        yield event(f"response.{status}", response=dump(final))
    except Exception as exc:  # the 200 is out: the error goes in the stream
        err = to_gateway_error(exc)
        log = logger.exception if err.status_code == 500 else logger.warning  # a trace only for bugs
        log("response stream failed after it started: %s", err.message)
        yield event("error", code=err.code or err.type, message=err.message, param=err.param)
        failed = turn.response("failed", items.snapshot("incomplete"), result, err)
        yield event("response.failed", response=dump(failed))
    finally:
        await generation.aclose()
