"""How a model family writes tool calls, and how the gateway finds out which one the served model uses.

A ``ToolFormat`` says how calls look in the model's output and what the grammar that forces a call
(``tool_choice`` ``required`` or a named function) must produce:

- ``hermes`` — Hermes 2/3, Qwen 2/2.5/3, our tiny ChatML models: ``<tool_call>\\n{"name": …, "arguments":
  {…}}\\n</tool_call>``, one block per call;
- ``llama3_json`` — Llama 3.1 / 3.2 / 3.3 JSON tool calling: the whole reply is ``{"name": …, "parameters":
  {…}}`` (optionally after ``<|python_tag|>``), several calls separated by ``; ``;
- ``mistral`` — Mistral / Mixtral v3 tokenizers: ``[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]``, call
  ids of 9 letters and digits (their templates refuse any other id);
- ``prompt`` — a chat template that knows nothing of tools (SmolLM2, many older models): the gateway writes
  the tool list and the ``hermes`` call syntax into the system message itself, renders earlier calls and
  their results as text, and parses ``hermes`` blocks.

``detect_tool_format`` reads the chat template; ``GatewaySettings.tool_format`` overrides it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "JSON_SEPARATORS",
    "TOOL_FORMATS",
    "ToolFormat",
    "ToolFormatName",
    "detect_tool_format",
    "format_call_json",
    "tool_call_id",
]

ToolFormatName = Literal["hermes", "llama3_json", "mistral", "prompt"]

#: JSON as Python's ``json.dumps`` and jinja's ``tojson`` write it (``", "`` and ``": "``), so a call the
#: grammar made renders back into the next turn's prompt as the same text and its cache is reused
JSON_SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class ToolFormat:
    name: ToolFormatName
    #: the text that opens the calls in the model's output (None: a reply that starts with ``{``)
    opener: str | None
    #: the text that closes one call (``hermes``); None: calls end with their JSON
    closer: str | None
    #: the key of a call's arguments object
    arguments_key: str
    #: the calls are one JSON array after the opener (``mistral``), not one object each
    array: bool = False
    #: what separates two calls written one after another (not in an array)
    separator: str = "\n"
    #: the chat template gets ``tools=`` and tool messages as they are (else the gateway writes them as text)
    native: bool = True


TOOL_FORMATS: dict[ToolFormatName, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments"),
    "llama3_json": ToolFormat("llama3_json", None, None, "parameters", separator="; "),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None, "arguments", array=True),
    "prompt": ToolFormat("prompt", "<tool_call>", "</tool_call>", "arguments", native=False),
}


def detect_tool_format(chat_template: str | None) -> ToolFormat:
    """The format the chat template teaches, from the markers it writes; ``prompt`` when it has no tools."""
    template = chat_template or ""
    if "tools" not in template:
        return TOOL_FORMATS["prompt"]
    if "[TOOL_CALLS]" in template:
        return TOOL_FORMATS["mistral"]
    if "<tool_call>" in template:
        return TOOL_FORMATS["hermes"]
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return TOOL_FORMATS["llama3_json"]
    return TOOL_FORMATS["prompt"]  # it mentions tools, but in no syntax we can parse: teach ours


_ALNUM = string.ascii_letters + string.digits


def tool_call_id(fmt: ToolFormat, seed: str | None = None) -> str:
    """A new call id (``seed`` None) or the id a client's ``seed`` id becomes for this format: OpenAI's
    ``call_…`` shape, or 9 letters and digits for ``mistral`` (the same seed always gives the same id, so
    an assistant's call and the tool result that answers it still match)."""
    if fmt.name != "mistral":
        return seed if seed is not None else "call_" + _random_hex(24)
    if seed is not None and len(seed) == 9 and seed.isalnum():
        return seed
    digest = hashlib.sha256((seed if seed is not None else _random_hex(32)).encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


def _random_hex(n: int) -> str:
    return secrets.token_hex(n // 2)


def format_call_json(name: str, arguments: Any, fmt: ToolFormat) -> str:
    """One call as the model would write it (the JSON, without opener or closer)."""
    return json.dumps({"name": name, fmt.arguments_key: arguments}, separators=JSON_SEPARATORS, ensure_ascii=False)
