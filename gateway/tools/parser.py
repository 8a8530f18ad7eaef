"""Tool calls out of a model's text as it streams: ``ToolCallParser.feed(text)`` returns content text and
``ToolCallDelta``s in OpenAI's streaming shape (a call's id and name once, then its arguments in pieces as
the model writes them); ``finish()`` flushes what is held. A whole reply parses through the same code
(``parse_tool_calls``), so a streamed and a non-streamed answer always agree.

The parser follows the call syntax of a ``ToolFormat`` (gateway/tools/formats.py): an opener
(``<tool_call>``, ``[TOOL_CALLS]``, or a reply that starts with ``{``), one JSON object per call with a
``name`` and an ``arguments`` (or ``parameters``) member in either order, and a closer or separator.
Text that looks like the start of a call but never names a function comes back as content. A model
writing freely (``tool_choice: auto``) can still stop inside a call or write broken JSON after the name:
those arguments are returned as written; with ``required`` or a named function the grammar
(gateway/tools/grammar.py) makes every call complete and valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway.tools.formats import ToolFormat, tool_call_id

__all__ = ["ParsedCall", "ToolCallDelta", "ToolCallParser", "parse_tool_calls"]

_ARGUMENT_KEYS = ("arguments", "parameters")
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first piece carries ``id`` and ``name``, every piece some arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


Event = str | ToolCallDelta


class _CallObject:
    """One call's JSON object, scanned a character at a time: finds the top-level ``name`` and arguments
    members and passes the arguments' text on as it comes (once the name is known)."""

    def __init__(self) -> None:
        self.raw: list[str] = []
        self.depth = 0
        self.in_string = self.escaped = False
        self.expect_key = False
        self.key_start: int | None = None
        self.key: str | None = None
        self.value_start: int | None = None
        self.name: str | None = None
        self.arguments: list[str] = []  # the arguments' text so far
        self.arguments_done = False
        self.arguments_is_string = False
        self.done = False

    def push(self, ch: str) -> None:
        i = len(self.raw)
        self.raw.append(ch)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.key_start is not None:  # a key ends
                    self.key = _loads_str("".join(self.raw[self.key_start : i + 1]))
                    self.key_start = None
                elif self.depth == 1 and self.key == "name" and self.value_start is not None:
                    self.name = _loads_str("".join(self.raw[self.value_start : i + 1]))
            self._argument_char(ch)
            return
        if self.depth == 1 and self.value_start is None and self.key is not None and not ch.isspace() and ch != ":":
            self.value_start = i  # a member's value begins
            self.arguments_is_string = self.key in _ARGUMENT_KEYS and ch == '"'
        if ch == '"':
            self.in_string = True
            if self.depth == 1 and self.expect_key:
                self.key_start, self.expect_key, self.key = i, False, None
        elif ch in "{[":
            self.depth += 1
            if self.depth == 1:
                self.expect_key = True
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._end_member()
                self.done = True
                return
        elif ch == "," and self.depth == 1:
            self._end_member()
            self.expect_key = True
            return
        self._argument_char(ch)

    def _argument_char(self, ch: str) -> None:
        if self.key in _ARGUMENT_KEYS and self.value_start is not None and not self.arguments_done:
            if self.depth >= 2 or self.arguments_is_string or not ch.isspace():
                self.arguments.append(ch)
            if self.depth == 1 and not self.in_string and ch in "}]":
                self.arguments_done = True  # an object or array value just closed

    def _end_member(self) -> None:
        if self.key in _ARGUMENT_KEYS:
            self.arguments_done = True
        self.key = None
        self.value_start = None

    @property
    def arguments_text(self) -> str:
        """The arguments as OpenAI sends them: a JSON text (a string value is the JSON already)."""
        text = "".join(self.arguments).strip()
        if self.arguments_is_string:
            decoded = _loads_str(text)
            return decoded if decoded is not None else text
        return text


def _loads_str(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolCallParser:
    """One choice's output → content text and tool call deltas, for ``fmt``."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None):
        """``max_calls``: the most calls the reply may make (``parallel_tool_calls: false``: one); whatever
        the model writes after that many complete calls is dropped."""
        self.fmt = fmt
        self.max_calls = max_calls
        self.calls: list[ParsedCall] = []
        #: start (llama3_json: before the first character that counts) · plain (no calls can follow) · text
        #: (looking for the opener) · opened (after the opener) · array (inside mistral's array) · object
        #: (inside a call) · after (after a call: closer, separator, blanks or text) · done (``max_calls`` made)
        self._state = "start" if fmt.opener is None else "text"
        self._held = ""  # text that may still open a call, or blanks around calls
        self._call: _CallObject | None = None
        self._current: ParsedCall | None = None  # the call being written, once it has a name
        self._sent = 0  # characters of the current call's arguments already sent
        self._prefix = ""  # what came before the current call's object (text again if it is no call)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            self._push(ch, out)
        return _merged(out)

    def finish(self) -> list[Event]:
        """The end of the output: held text comes out; a call cut short keeps what it has."""
        out: list[Event] = []
        if self._call is not None:
            self._close_call(out, complete=False)
        if self._held and self._state != "done" and not (self.calls and self._held.isspace()):
            out.append(self._held)
        self._held = ""
        return _merged(out)

    # ------------------------------------------------------------------------------------------ machinery

    def _push(self, ch: str, out: list[Event]) -> None:
        state = self._state
        if state == "done":
            return
        if state == "plain":
            out.append(ch)
        elif state == "text":
            self._text_char(ch, out)
        elif state == "object":
            self._object_char(ch, out)
        elif state == "start":
            self._start_char(ch, out)
        elif state == "opened":  # after <tool_call>: blanks, then the call's object
            self._held += ch
            if ch.isspace():
                return
            if ch == "{" and not self.fmt.array:
                self._prefix, self._held = (self.fmt.opener or "") + self._held[:-1], ""
                self._start_object(ch, out)
            elif ch == "[" and self.fmt.array:
                self._held, self._state = "", "array"
            else:  # not a call after all
                held, self._held, self._state = (self.fmt.opener or "") + self._held, "", "text"
                out.append(held)
        elif state == "array":  # mistral: objects separated by commas until "]"
            if ch == "{":
                self._start_object(ch, out)
            elif ch == "]":
                self._state = "text"
        elif state == "after":
            self._after_char(ch, out)

    def _start_char(self, ch: str, out: list[Event]) -> None:
        """llama3_json: a reply that opens with "{" (after blanks or ``<|python_tag|>``) is calls."""
        self._held += ch
        stripped = self._held.lstrip()
        if stripped.startswith(_PYTHON_TAG):
            stripped = stripped[len(_PYTHON_TAG) :].lstrip()
        elif _PYTHON_TAG.startswith(stripped):
            return  # blanks, or the tag's first characters
        if not stripped:
            return
        if stripped == "{":
            self._prefix, self._held = self._held[:-1], ""
            self._start_object(stripped, out)
        else:
            held, self._held, self._state = self._held, "", "plain"
            out.append(held)

    def _text_char(self, ch: str, out: list[Event]) -> None:
        opener = self.fmt.opener
        assert opener is not None
        self._held += ch
        if self._held.endswith(opener):
            before = self._held[: -len(opener)]
            if before and not (self.calls and before.isspace()):
                out.append(before)
            self._held, self._state = "", "opened"
            return
        emit = self._held[: len(self._held) - _partial_suffix(self._held, opener)]
        if emit and not (self.calls and emit.isspace()):  # blanks between calls wait for text to follow
            out.append(emit)
            self._held = self._held[len(emit) :]

    def _start_object(self, first: str, out: list[Event]) -> None:
        self._call = _CallObject()
        self._sent = 0
        if self._state != "opened" and self._state != "start":
            self._prefix = ""
        self._state = "object"
        self._object_char(first, out)

    def _object_char(self, ch: str, out: list[Event]) -> None:
        call = self._call
        assert call is not None
        call.push(ch)
        if call.name is not None:
            if self._current is None:  # the name is known: the call's first delta
                self._current = ParsedCall(tool_call_id(self.fmt), call.name)
                self.calls.append(self._current)
                out.append(ToolCallDelta(len(self.calls) - 1, "", self._current.id, call.name))
            if not call.arguments_is_string and len(call.arguments) > self._sent:
                out.append(ToolCallDelta(len(self.calls) - 1, "".join(call.arguments[self._sent :])))
                self._sent = len(call.arguments)
        if call.done:
            self._close_call(out, complete=True)

    def _close_call(self, out: list[Event], *, complete: bool) -> None:
        call, current = self._call, self._current
        assert call is not None
        self._call = self._current = None
        if current is None:  # it never named a function: text after all
            out.append(self._prefix + "".join(call.raw))
            self._state = "plain" if self.fmt.opener is None else "text"
            return
        if call.arguments_is_string or not call.arguments:
            rest = call.arguments_text if call.arguments else ("{}" if complete else "")
            if rest:
                out.append(ToolCallDelta(len(self.calls) - 1, rest))
            current.arguments = rest
        else:
            current.arguments = call.arguments_text
        self._state = "array" if self.fmt.array else "after"
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self._state, self._held = "done", ""

    def _after_char(self, ch: str, out: list[Event]) -> None:
        """After a call: the closer (hermes), "; " and the next call (llama3_json), blanks, or text."""
        self._held += ch
        stripped = self._held.lstrip()
        if not stripped:
            return
        closer = self.fmt.closer
        if closer is not None and closer.startswith(stripped):
            if stripped == closer:
                self._held, self._state = "", "text"
            return
        if closer is None and self.fmt.opener is None and stripped[0] == ";":
            rest = stripped[1:].lstrip()
            if rest.startswith("{"):
                self._held = ""
                self._start_object(rest, out)
            return
        held, self._held = self._held, ""
        self._state = "plain" if self.fmt.opener is None else "text"
        for c in held:
            self._push(c, out)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may still become the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent text pieces and argument pieces of the same call joined (fewer, larger stream chunks)."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, str):
            if not e:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += e
                continue
        elif (
            out
            and isinstance(out[-1], ToolCallDelta)
            and out[-1].id is None
            and e.id is None
            and out[-1].index == e.index
        ):
            out[-1] = ToolCallDelta(e.index, out[-1].arguments + e.arguments, out[-1].id, out[-1].name)
            continue
        out.append(e)
    return out


@dataclass
class ParsedReply:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def parse_tool_calls(text: str, fmt: ToolFormat, max_calls: int | None = None) -> ParsedReply:
    """A whole reply → its content (None when only calls, or nothing) and its calls (at most ``max_calls``)."""
    parser = ToolCallParser(fmt, max_calls)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    if parser.calls and not content.strip():
        return ParsedReply(None, parser.calls)
    return ParsedReply(content, parser.calls)
