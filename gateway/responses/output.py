"""The output items of one Responses API reply, built from its text as it comes: ``message`` items for what
the model says, ``function_call`` items for the calls it makes (parsed by the chat path's
``ToolCallParser``), and the stream events that open, fill and close each one.

A streamed and a non-streamed reply go through the same builder (the latter all at once, its events
dropped), so both have the same items. Without tools the one message item opens at once, as before any
text; with tools an item opens with what it holds: a message with its first text that is not blank (blanks
before a call are dropped), a call with its name. A reply with neither is one empty message.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from gateway.responses.schema import FunctionCallItem, OutputItem, OutputMessage, OutputText
from gateway.tools.parser import ToolCallDelta
from gateway.tools.plan import ToolPlan

__all__ = ["OutputItems", "dump"]

#: makes one stream event from its type and fields (``responses_stream._Sequencer``)
Emit = Callable[..., Any]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


@dataclass
class _Open:
    """The item being written: a message (``call_id`` None) or a call."""

    id: str
    index: int
    call_id: str | None = None
    name: str = ""
    parts: list[str] = field(default_factory=list)

    def item(self, status: ItemStatus) -> OutputItem:
        text = "".join(self.parts)
        if self.call_id is None:
            return OutputMessage(id=self.id, status=status, content=[OutputText(text=text)])
        return FunctionCallItem(id=self.id, call_id=self.call_id, name=self.name, arguments=text, status=status)


class OutputItems:
    """Feed it the reply's text; it keeps the items and returns the events each piece makes."""

    def __init__(self, plan: ToolPlan | None, message_id: str, emit: Emit | None = None):
        self.plan = plan
        #: the items closed so far
        self.items: list[OutputItem] = []
        self._parser = plan.parser() if plan is not None else None
        self._emit = emit
        self._message_id: str | None = message_id  # the first message's id (the caller names it)
        self._open: _Open | None = None
        self._blank = ""  # blanks not yet in an item
        self._out: list[Any] = []

    def start(self) -> list[Any]:
        """Without tools, the message item opens before any text comes."""
        if self.plan is None:
            self._open_message()
        return self._flush()

    def feed(self, text: str) -> list[Any]:
        if self._parser is None:
            self._text(text)
        else:
            self._events(self._parser.feed(text))
        return self._flush()

    def finish(self, status: str) -> list[Any]:
        """The end of the reply: held text and calls come out, the open item closes in ``status``
        (``incomplete`` when the reply was cut short), and a reply of nothing is one empty message."""
        if self._parser is not None:
            self._events(self._parser.finish())
        if self._open is None and not self.items:
            self._open_message()
            blank, self._blank = self._blank, ""
            self._text(blank)
        self._close(status)
        return self._flush()

    def snapshot(self, status: ItemStatus) -> list[OutputItem]:
        """The items so far, the open one (if any) in ``status``: what a failed response shows."""
        return [*self.items, self._open.item(status)] if self._open is not None else list(self.items)

    def assistant_message(self) -> dict[str, Any]:
        """The reply as a chat assistant message (what a follow-up's prompt renders)."""
        text = "".join(i.content[0].text for i in self.items if isinstance(i, OutputMessage))
        calls = [
            {"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
            for i in self.items
            if isinstance(i, FunctionCallItem)
        ]
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text or None, "tool_calls": calls}

    # ---------------------------------------------------------------------------------------- machinery

    def _event(self, type_: str, **fields: Any) -> None:
        if self._emit is not None:
            self._out.append(self._emit(type_, **fields))

    def _flush(self) -> list[Any]:
        out, self._out = self._out, []
        return out

    def _events(self, events: list[str | ToolCallDelta]) -> None:
        for event in events:
            if isinstance(event, str):
                self._text(event)
            elif event.id is not None:
                self._open_call(event.id, event.name or "")
                self._arguments(event.arguments)
            else:
                self._arguments(event.arguments)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self._open.call_id is not None:
            if text.isspace():
                self._blank += text
                return
            self._close("completed")
            self._open_message()
            text, self._blank = self._blank + text, ""
        ids = self._ids()
        self._open.parts.append(text)  # type: ignore[union-attr]  # a message is open
        self._event("response.output_text.delta", **ids, content_index=0, delta=text, logprobs=[])

    def _arguments(self, text: str) -> None:
        if text and self._open is not None and self._open.call_id is not None:
            self._open.parts.append(text)
            self._event("response.function_call_arguments.delta", **self._ids(), delta=text)

    def _ids(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": self._open.index}

    def _open_message(self) -> None:
        message_id, self._message_id = self._message_id or f"msg_{uuid.uuid4().hex}", None
        self._open = _Open(message_id, len(self.items))
        added = OutputMessage(id=message_id, status="in_progress", content=[])
        self._event("response.output_item.added", output_index=self._open.index, item=dump(added))
        self._event("response.content_part.added", **self._ids(), content_index=0, part=dump(OutputText(text="")))

    def _open_call(self, call_id: str, name: str) -> None:
        self._close("completed")
        self._blank = ""
        self._open = _Open(f"fc_{uuid.uuid4().hex}", len(self.items), call_id, name)
        added = self._open.item("in_progress")
        self._event("response.output_item.added", output_index=self._open.index, item=dump(added))

    def _close(self, status: str) -> None:
        opened, self._open = self._open, None
        if opened is None:
            return
        item = opened.item("completed" if status == "completed" else "incomplete")
        ids = {"item_id": opened.id, "output_index": opened.index}
        if isinstance(item, OutputMessage):
            text = item.content[0].text
            self._event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
            self._event("response.content_part.done", **ids, content_index=0, part=dump(item.content[0]))
        else:
            self._event("response.function_call_arguments.done", **ids, arguments=item.arguments)
        self._event("response.output_item.done", output_index=opened.index, item=dump(item))
        self.items.append(item)
