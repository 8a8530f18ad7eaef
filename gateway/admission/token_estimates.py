"""What a generation request will cost in tokens before it runs — its prompt (counted with the served
model's tokenizer, or a tiktoken BPE file) plus its completion budget times its choices — for the per-key
token limit of ``gateway/admission/ratelimit.py``."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Protocol

from gateway.decode.tokenize_thread import encode_lazily, tokens_past

__all__ = [
    "CHAT_PATH",
    "CL100K_PATTERN",
    "COMPLETIONS_PATH",
    "RESPONSES_PATH",
    "ModelTokenCounter",
    "TiktokenCounter",
    "TokenCounter",
    "estimate_tokens",
    "read_tiktoken_bpe",
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
#: chat-template framing per message (role markers, separators) and the assistant turn's opening
_PER_MESSAGE_TOKENS, _REPLY_PRIMING_TOKENS = 4, 3
#: tiktoken's cl100k_base pre-tokenizer pattern (from ``tiktoken_ext.openai_public``)
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s"""
)


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class ModelTokenCounter:
    """Tokens as the served model counts them (what usage reports); the gateway counts on its tokenize
    thread, with that thread's tokenizer (gateway/decode/tokenize_thread.py). With ``max_context``, a text whose
    beginning alone is past it counts as that beginning (the route refuses it anyway: megabytes are not
    worth counting)."""

    def __init__(self, tokenizer: Any, max_context: int | None = None):
        self.tokenizer = tokenizer
        self.max_context = max_context

    def count(self, text: str) -> int:
        if not text:
            return 0
        if self.max_context is not None:
            past = tokens_past(self.tokenizer, text, self.max_context, add_special_tokens=False)
            if past is not None:
                return past
        return encode_lazily(self.tokenizer, text, add_special_tokens=False)[0]


class TiktokenCounter:
    """Tokens of a tiktoken encoding; for a gateway whose limits are set in OpenAI-model tokens."""

    def __init__(self, encoding: Any):
        self.encoding = encoding

    @classmethod
    def from_bpe_file(cls, path: str | Path, pattern: str = CL100K_PATTERN) -> TiktokenCounter:
        """An encoding from a local ``.tiktoken`` file (``tiktoken.get_encoding`` would download one)."""
        import tiktoken

        ranks = read_tiktoken_bpe(path)
        name = Path(path).stem
        return cls(tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={}))

    def count(self, text: str) -> int:
        return len(self.encoding.encode_ordinary(text)) if text else 0


def read_tiktoken_bpe(path: str | Path) -> dict[bytes, int]:
    """``base64(token) rank`` per line, tiktoken's format. Read here rather than with
    ``tiktoken.load.load_tiktoken_bpe``, which caches by path in a temp dir and would keep serving an old
    copy after the file is replaced."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not a tiktoken BPE line ({exc})") from None
    return ranks


def _non_negative_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text_tokens(value: Any, counter: TokenCounter) -> int:
    """Tokens of message content: a string, or content parts with ``text``."""
    if isinstance(value, str):
        return counter.count(value)
    if isinstance(value, list):
        texts = [p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return sum(counter.count(t) for t in texts)
    return 0


def _messages_tokens(messages: Any, counter: TokenCounter | None) -> int:
    """Chat messages: their text plus the template's framing per message."""
    if not isinstance(messages, list):
        return 0
    prompt = _REPLY_PRIMING_TOKENS
    for m in messages:
        if isinstance(m, dict):
            content = _text_tokens(m.get("content"), counter) if counter else 0
            prompt += _PER_MESSAGE_TOKENS + content
    return prompt


def _item_text(item: Any) -> Any:
    """A Responses input item as a message whose content is its text: a message's content, a function
    call's name and arguments, a call output's output."""
    if not isinstance(item, dict) or item.get("type") not in ("function_call", "function_call_output"):
        return item
    if item["type"] == "function_call":
        return {"content": f"{item.get('name', '')} {item.get('arguments', '')}"}
    return {"content": item.get("output")}


def _tools_tokens(tools: Any, counter: TokenCounter | None) -> int:
    """Tool definitions go into the prompt too (Open WebUI sends 36 of them, thousands of tokens)."""
    if not counter or not isinstance(tools, list) or not tools:
        return 0
    return counter.count(json.dumps(tools, ensure_ascii=False))


def _prompt_tokens(prompt: Any, counter: TokenCounter) -> tuple[int, int]:
    """(tokens, number of prompts) of every shape ``/v1/completions`` accepts."""
    if isinstance(prompt, str):
        return counter.count(prompt), 1
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt), 1
    if isinstance(prompt, list):
        total = 0
        for item in prompt:
            if isinstance(item, str):
                total += counter.count(item)
            elif isinstance(item, list):
                total += len(item)
        return total, max(1, len(prompt))
    return 0, 1


def estimate_tokens(
    path: str,
    body: Any,
    counter: TokenCounter | None,
    *,
    default_max_tokens: int,
    max_context: int,
    max_choices: int,
) -> int:
    """Prompt tokens + completion budget × choices of a raw request body; never raises (a malformed body
    costs what can be read of it, and the route answers it with a 400). Budgets and choices are capped at
    what the server would accept, so an absurd ``max_tokens`` is the route's 400, not a 429."""
    if not isinstance(body, dict):
        return 0
    if path == CHAT_PATH:
        prompt, prompts = _messages_tokens(body.get("messages"), counter), 1
        prompt += _tools_tokens(body.get("tools"), counter)
        requested = _non_negative_int(body.get("max_completion_tokens"))
        if requested is None:
            requested = _non_negative_int(body.get("max_tokens"))
    elif path == RESPONSES_PATH:
        given = body.get("input")
        items = [_item_text(i) for i in given] if isinstance(given, list) else [{"content": given}]
        prompt, prompts = _messages_tokens(items, counter), 1
        prompt += _text_tokens(body.get("instructions"), counter) if counter else 0
        prompt += _tools_tokens(body.get("tools"), counter)
        requested = _non_negative_int(body.get("max_output_tokens"))
    else:
        prompt, prompts = _prompt_tokens(body.get("prompt"), counter) if counter else (0, 1)
        requested = _non_negative_int(body.get("max_tokens"))
    budget = min(default_max_tokens if requested is None else requested, max_context)
    n = _non_negative_int(body.get("n")) or 1
    return prompt + budget * min(n * prompts, max_choices)
