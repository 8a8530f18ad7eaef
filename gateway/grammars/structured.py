"""Structured outputs: OpenAI's ``response_format`` as a token mask on the head's logits (llguidance).

``{"type": "json_object"}`` constrains a choice to one JSON object; ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}`` to an instance of ``schema``. With ``strict: true`` every keyword of the schema
must be enforced, so one the engine does not support is a 400; without it unsupported keywords are ignored
(llguidance's lenient mode), as OpenAI does for non-strict schemas. JSON is generated compactly (no free
whitespace between tokens: a model that likes whitespace could otherwise spend ``max_tokens`` on it).

``StructuredOutputs.compile`` (one per engine) checks and compiles a ``response_format`` in the engine's thread
pool and returns a factory of ``GrammarConstraint``s, one per choice; the ``Sampler`` (gateway/decode/sampling.py)
masks each step's logits with it before sampling and feeds it each sampled token, in the thread that ran the
step. EOS is allowed exactly when the grammar accepts; the engine ends a choice with ``"stop"`` once the
grammar allows nothing more.

Bounded: a schema past the size limits is a 400 before compiling (gateway/grammars/schema_limits.py); each mask runs
under llguidance's parser limits, and one that reaches them ends the choice with a ``GrammarLimitError``;
the tokenizer is built once, in a thread, when the engine is made (gateway/grammars/compile.py).
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

from gateway.errors import InvalidRequestError
from gateway.grammars.compile import (
    GrammarLimitError,
    allocate_bitmask,
    compile_lark,
    compile_schema,
    fill_bitmask,
    llguidance_available,
    make_tokenizer,
    parser_limits,
    require_llguidance,
    warm_up,
)
from gateway.grammars.schema_limits import check_schema

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarConstraint", "StructuredOutputs", "parse_response_format"]

PARAM = "response_format"


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
    """The engine's grammar compiler: its tokenizer as llguidance sees it (built once, in a thread started
    here: ~0.4 s for a 50k vocabulary, seconds on a loaded machine) and a cache of compiled grammars. All
    of it runs off the event loop, with bounded cost (gateway/grammars/compile.py,
    gateway/grammars/schema_limits.py)."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], executor: Executor, *, warm: bool = True):
        self._hf_tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.executor = executor
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        #: set once the warm-up thread is done (or there is none)
        self.ready = threading.Event()
        if warm and llguidance_available():
            threading.Thread(target=warm_up, args=(self,), name="llguidance-warm-up", daemon=True).start()
        else:
            self.ready.set()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (off the loop) at most ``timeout_s`` for the warm-up; whether it is done. The app waits for it
        before serving: building the tokenizer holds the GIL ~1 s in one piece, which would stall every
        stream already running."""
        return await asyncio.to_thread(self.ready.wait, timeout_s)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = make_tokenizer(self._hf_tokenizer)
            return self._tokenizer

    async def compile(self, response_format: dict[str, Any] | None) -> Callable[[], GrammarConstraint] | None:
        """A factory of per-choice constraints for ``response_format`` (None: unconstrained text); a schema
        past the size limits or that the engine cannot compile is a 400 naming the problem. The checks and
        the compilation run in ``executor``."""
        if response_format is None or response_format.get("type", "text") == "text":
            return None
        require_llguidance(PARAM)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.compile_sync, response_format)

    def compile_sync(self, response_format: dict[str, Any]) -> Callable[[], GrammarConstraint] | None:
        """``compile``, in the calling thread."""
        parsed = parse_response_format(response_format)
        if parsed is None:
            return None
        spec = response_format.get("json_schema")
        if isinstance(spec, dict):
            check_schema(spec.get("schema", {}), PARAM)  # before compiling: a 400 naming the limit
        grammar, template = self._compile(*parsed)
        return self._factory(grammar, template, PARAM)

    async def compile_lark(self, lark: str, *, param: str) -> Callable[[], GrammarConstraint]:
        """Like ``compile``, for a grammar in llguidance's Lark syntax (tool calls: gateway/tools/grammar.py;
        their schemas are checked by the caller, gateway/grammars/schema_limits.py); one it cannot compile is a 400
        naming ``param``."""
        require_llguidance(param)
        loop = asyncio.get_running_loop()
        grammar, template = await loop.run_in_executor(self.executor, self._compile_lark, lark, param)
        return self._factory(grammar, template, param)

    def _factory(self, grammar: str, template: Any, param: str) -> Callable[[], GrammarConstraint]:
        tokenizer = self._tokenizer  # built: compiling needed it
        assert tokenizer is not None
        return functools.partial(GrammarConstraint, tokenizer, grammar, self.eos_ids, template=template, param=param)

    @functools.lru_cache(maxsize=64)  # noqa: B019 — one compiler per engine, kept as long as the engine
    def _compile(self, schema: str, strict: bool) -> tuple[str, Any]:
        return compile_schema(self.tokenizer, schema, strict, PARAM)

    @functools.lru_cache(maxsize=64)  # noqa: B019 — as above
    def _compile_lark(self, lark: str, param: str) -> tuple[str, Any]:
        return compile_lark(self.tokenizer, lark, param)


class GrammarConstraint:
    """One choice's position in its grammar. ``mask`` and ``consume`` run in the engine's worker threads;
    the matcher itself is made on first use there too (the ``Sampler`` is made on the event loop)."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        grammar: str,
        eos_ids: frozenset[int],
        *,
        template: llguidance.LLMatcher | None = None,
        param: str = PARAM,
    ):
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._eos_ids = eos_ids
        #: the compiled matcher at the grammar's start, copied on first use (StructuredOutputs made it)
        self._template = template
        #: the request parameter the grammar came from, for the error that ends a choice
        self._param = param
        self._matcher: llguidance.LLMatcher | None = None
        self._bitmask: torch.Tensor | None = None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            import llguidance

            if self._template is not None:
                self._matcher = self._template.deep_copy()
            else:
                self._matcher = llguidance.LLMatcher(
                    self._tokenizer, self._grammar, log_level=0, limits=parser_limits()
                )
            self._bitmask = allocate_bitmask(self._tokenizer.vocab_size)
        return self._matcher

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [vocab]`` (a copy the caller owns) with every token the grammar forbids at -inf."""
        matcher = self.matcher
        assert self._bitmask is not None  # allocated with the matcher
        fill_bitmask(matcher, self._bitmask)
        if matcher.is_error():  # a limit of PARSER_LIMITS reached: end the choice, saying so
            raise GrammarLimitError(self._param, matcher.get_error())
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
            raise GrammarLimitError(self._param, f"at token {token_id}: {self.matcher.get_error()}")

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
