"""Structured outputs: OpenAI's ``response_format`` as a token mask on the head's logits (llguidance).

``{"type": "json_object"}`` constrains a choice to one JSON object; ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}`` to an instance of ``schema``. With ``strict: true`` every keyword of the schema
must be enforced, so one the engine does not support is a 400; without it unsupported keywords are ignored
(llguidance's lenient mode), as OpenAI does for non-strict schemas. JSON is generated compactly (no free
whitespace between tokens: a model that likes whitespace could otherwise spend ``max_tokens`` on it).

``StructuredOutputs.compile`` (one per engine) checks and compiles a ``response_format`` in the engine's thread
pool and returns a factory of ``GrammarConstraint``s, one per choice; the ``Sampler`` (gateway/sampling.py)
masks each step's logits with it before sampling and feeds it each sampled token, in the thread that ran the
step. EOS is allowed exactly when the grammar accepts; the engine ends a choice with ``"stop"`` once the
grammar allows nothing more.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gateway.errors import InvalidRequestError, UnsupportedParameterError

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarConstraint", "StructuredOutputs", "parse_response_format"]

PARAM = "response_format"
_OPTIONS = {"whitespace_flexible": False}


def parse_response_format(response_format: dict[str, Any] | None) -> tuple[str, bool] | None:
    """``response_format`` → (the JSON schema to enforce, as text; strict), or None for plain text. Raises a
    400 naming ``response_format`` for any other shape."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"}), False
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}.", param=PARAM
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema: Field required (an object).", param=PARAM)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("response_format.json_schema.name: Field required (a string).", param=PARAM)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema: must be a JSON object.", param=PARAM)
    return json.dumps(schema), bool(spec.get("strict"))  # key order kept: properties come in it


class StructuredOutputs:
    """The engine's grammar compiler: its tokenizer as llguidance sees it (built on first use, ~0.5 s for a
    50k vocabulary) and a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], executor: Executor):
        self._hf_tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.executor = executor
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=len(self._hf_tokenizer))
            return self._tokenizer

    async def compile(self, response_format: dict[str, Any] | None) -> Callable[[], GrammarConstraint] | None:
        """A factory of per-choice constraints for ``response_format`` (None: unconstrained text); a schema
        the engine cannot compile is a 400 naming the problem. The compilation runs in ``executor``."""
        parsed = parse_response_format(response_format)
        if parsed is None:
            return None
        _require_llguidance(PARAM)
        loop = asyncio.get_running_loop()
        grammar = await loop.run_in_executor(self.executor, self._compile, *parsed)
        return functools.partial(GrammarConstraint, self.tokenizer, grammar, self.eos_ids)

    async def compile_lark(self, lark: str, *, param: str) -> Callable[[], GrammarConstraint]:
        """Like ``compile``, for a grammar in llguidance's Lark syntax (tool calls: gateway/tool_grammar.py);
        one it cannot compile is a 400 naming ``param``."""
        _require_llguidance(param)
        loop = asyncio.get_running_loop()
        grammar = await loop.run_in_executor(self.executor, self._compile_lark, lark, param)
        return functools.partial(GrammarConstraint, self.tokenizer, grammar, self.eos_ids)

    @functools.lru_cache(maxsize=64)  # noqa: B019 — one compiler per engine, kept as long as the engine
    def _compile(self, schema: str, strict: bool) -> str:
        import llguidance

        options = dict(_OPTIONS) if strict else {**_OPTIONS, "lenient": True}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError, RuntimeError) as e:
            raise _invalid("Invalid schema for response_format", [str(e)], PARAM) from None
        return self._validated(grammar, strict, "Invalid schema for response_format", PARAM)

    @functools.lru_cache(maxsize=64)  # noqa: B019 — as above
    def _compile_lark(self, lark: str, param: str) -> str:
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError, RuntimeError) as e:
            raise _invalid(f"Invalid {param}", [str(e)], param) from None
        return self._validated(grammar, False, f"Invalid {param}", param)

    def _validated(self, grammar: str, strict: bool, what: str, param: str) -> str:
        import llguidance

        try:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            is_error, messages = True, [str(e)]
        if strict and not is_error and messages:
            is_error = True  # a keyword we would not enforce: strict promises it is
        if is_error:
            raise _invalid(what, messages, param)
        return grammar


def _require_llguidance(param: str) -> None:
    try:  # an optional dependency: a gateway without it still serves text
        import llguidance.torch  # noqa: F401
    except ImportError:
        raise UnsupportedParameterError(param, "needs the llguidance package, not installed here") from None


def _invalid(what: str, messages: list[str], param: str) -> InvalidRequestError:
    why = "; ".join(m.strip() for m in messages if m.strip()) or "unknown error"
    return InvalidRequestError(f"{what}: the grammar engine cannot compile it: {why}", param=param)


class GrammarConstraint:
    """One choice's position in its grammar. ``mask`` and ``consume`` run in the engine's worker threads;
    the matcher itself is made on first use there too (the ``Sampler`` is made on the event loop)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, eos_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._eos_ids = eos_ids
        self._matcher: llguidance.LLMatcher | None = None
        self._bitmask: torch.Tensor | None = None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            import llguidance.torch

            self._matcher = llguidance.LLMatcher(self._tokenizer, self._grammar)
            self._bitmask = llguidance.torch.allocate_token_bitmask(1, self._tokenizer.vocab_size)
        return self._matcher

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [vocab]`` (a copy the caller owns) with every token the grammar forbids at -inf."""
        import llguidance.torch

        matcher = self.matcher
        assert self._bitmask is not None  # allocated with the matcher
        llguidance.torch.fill_next_token_bitmask(matcher, self._bitmask, 0)
        # bitmask [1, ceil(n / 32)] int32 → allowed [n] bool, without llguidance's own apply (it goes through
        # torch.compile: seconds on first use, and a C compiler at run time)
        bits = np.unpackbits(self._bitmask[0].numpy().view(np.uint8), bitorder="little")  # little-endian words
        allowed = torch.from_numpy(bits[: self._tokenizer.vocab_size].view(np.bool_))
        vocab = logits.shape[-1]
        if vocab > len(allowed):  # the model's padding rows: never text
            logits[len(allowed) :] = float("-inf")
        logits[: len(allowed)].masked_fill_(~allowed[:vocab], float("-inf"))
        extra = [i for i in self._eos_ids if i < vocab]
        if extra and not matcher.is_accepting():  # the tokenizer's EOS is the grammar's; others too
            logits[extra] = float("-inf")
        return logits

    def consume(self, token_id: int) -> None:
        if token_id in self._eos_ids:
            return
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id}: {self.matcher.get_error()}")

    def accepted_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` the grammar accepts one after another from here, its state unchanged
        (speculation sends only guesses that could be kept). An end-of-sequence guess ends the count: after
        it nothing is fed."""
        upto = next((i for i, t in enumerate(token_ids) if t in self._eos_ids), len(token_ids))
        return int(self.matcher.validate_tokens(list(token_ids[:upto]))) if upto else 0

    @property
    def done(self) -> bool:
        """The grammar allows no further token (the output is complete)."""
        return self._matcher is not None and self._matcher.is_stopped()
