"""Grammars with bounded cost: llguidance's parser limits, the one-time tokenizer setup, and compiling a
schema or a Lark grammar into a template matcher that each choice copies.

What one grammar may cost is bounded twice. Before compiling, the schema's size (gateway/grammars/schema_limits.py,
a 400 naming the limit). Then every mask, by llguidance's ``LLParserLimits`` (``PARSER_LIMITS``): a step
that would pass them puts the matcher in an error state instead of running on (a 10,000-property object
once spent 101 s in one mask), and the choice ends with a ``GrammarLimitError`` that says so (an error
frame in a stream, a 400 otherwise), never a bare 500. Masks measured under these limits with SmolLM2's 49k
vocabulary: at most ~20 ms.

Everything here runs off the event loop: ``StructuredOutputs`` (gateway/grammars/structured.py) calls it in the
engine's thread pool, and builds the tokenizer (~0.4 s for 49k tokens, more on a loaded machine) once,
in a thread of its own started with the engine (``warm_up``), so the first structured request does not
pay it.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from gateway.errors import InvalidRequestError, UnsupportedParameterError

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)

__all__ = [
    "PARSER_LIMITS",
    "GrammarLimitError",
    "allocate_bitmask",
    "compile_lark",
    "compile_schema",
    "fill_bitmask",
    "llguidance_available",
    "make_tokenizer",
    "parser_limits",
    "require_llguidance",
]

#: llguidance's ``LLParserLimits``, written out (its defaults, which may change with its releases) — what
#: one mask may do before the matcher gives up with an error: Earley items per row (an object's optional
#: properties take ~4 each) and per step (~20k/ms), lexer fuel per step (~14k/ms) and for the initial regex
#: analysis (~50k/ms), lexer states (1-2 kB each), grammar symbols. Errors without the parser's state dump.
PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2_000,
    "step_max_items": 50_000,
    "step_lexer_fuel": 200_000,
    "initial_lexer_fuel": 1_000_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
    "verbose_errors": False,
}
#: compact JSON: no free whitespace between tokens (a model fond of blanks could spend max_tokens on them)
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarLimitError(InvalidRequestError):
    """A choice's grammar failed while generating: a limit of ``PARSER_LIMITS`` was reached (or the matcher
    refused a token). Ends the request: an error frame in a stream, a 400 before one."""

    code = "grammar_limit_exceeded"

    def __init__(self, param: str, reason: str):
        super().__init__(
            f"The grammar of {param} failed during generation: {_first_sentence(reason)}. "
            "It is too complex for this server; simplify the schema (fewer optional properties or alternatives).",
            param=param,
        )


def parser_limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


def llguidance_available() -> bool:
    """Whether llguidance is installed, without importing it (the import is seconds; it happens in a thread)."""
    return importlib.util.find_spec("llguidance") is not None


def require_llguidance(param: str) -> None:
    """A 400 naming ``param`` on a gateway without llguidance (an optional dependency: text still works)."""
    if not llguidance_available():
        raise UnsupportedParameterError(param, "needs the llguidance package, not installed here")


def make_tokenizer(hf_tokenizer: Any) -> llguidance.LLTokenizer:
    """The served tokenizer as llguidance sees it (slow: every token's bytes; once per engine)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))


def allocate_bitmask(vocab_size: int) -> torch.Tensor:
    """A one-row mask, ``[1, ceil(vocab / 32)]`` int32, as ``llguidance.torch`` makes it. Not through that
    module: its import compiles a kernel with ``torch.compile`` (6.4 s here, holding the GIL up to 0.5 s
    at a time: every stream stalls), and ``mask`` needs none of it."""
    return torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_bitmask(matcher: llguidance.LLMatcher, bitmask: torch.Tensor) -> None:
    """``matcher``'s next-token mask into ``bitmask``'s first row (``llguidance.torch.fill_next_token_bitmask``)."""
    row = bitmask[0]
    assert row.is_contiguous() and row.dtype == torch.int32
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def compile_schema(tokenizer: llguidance.LLTokenizer, schema: str, strict: bool, param: str) -> tuple[str, Any]:
    """JSON schema text → (grammar, template matcher); a 400 naming ``param`` when it cannot be compiled,
    or, with ``strict``, when it has a keyword the engine would not enforce."""
    import llguidance

    options = dict(_JSON_OPTIONS) if strict else {**_JSON_OPTIONS, "lenient": True}
    what = f"Invalid schema for {param}"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError, RuntimeError) as e:
        raise _invalid(what, [str(e)], param) from None
    return grammar, _template(tokenizer, grammar, strict, what, param)


def compile_lark(tokenizer: llguidance.LLTokenizer, lark: str, param: str) -> tuple[str, Any]:
    """Lark text (tool calls: gateway/tools/grammar.py) → (grammar, template matcher); a 400 naming ``param``."""
    import llguidance

    what = f"Invalid {param}"
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError, RuntimeError) as e:
        raise _invalid(what, [str(e)], param) from None
    return grammar, _template(tokenizer, grammar, False, what, param)


def _template(tokenizer: llguidance.LLTokenizer, grammar: str, strict: bool, what: str, param: str) -> Any:
    """A matcher at the grammar's start, never advanced: each choice takes a ``deep_copy`` (milliseconds)
    instead of building its own (up to a second for a 5,000-property schema, on the decode thread)."""
    import llguidance

    try:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    except (ValueError, TypeError, RuntimeError) as e:
        raise _invalid(what, [str(e)], param) from None
    if matcher.is_error():
        raise _invalid(what, [matcher.get_error()], param)
    warnings = matcher.get_grammar_warnings()
    if strict and warnings:  # a keyword we would not enforce: strict promises it is
        raise _invalid(what, warnings, param)
    return matcher


def warm_up(outputs: Any) -> None:
    """Build ``outputs``' tokenizer and compile the simplest schema once (imports, caches), in the thread
    this is called in; a failure is logged (the first request will meet it again and answer it)."""
    started = time.perf_counter()
    try:
        outputs.tokenizer  # noqa: B018 — built under its lock: a request arriving meanwhile waits for it
        outputs.compile_sync({"type": "json_object"})
    except Exception as exc:
        logger.warning("structured outputs: warm-up failed: %s: %s", type(exc).__name__, exc)
    else:
        logger.info("structured outputs: grammar engine ready in %.2f s", time.perf_counter() - started)
    finally:
        outputs.ready.set()


def _first_sentence(reason: str) -> str:
    """llguidance's error without its advice for grammar authors and its markers (``<non-verbose/>``)."""
    line = reason.strip().splitlines()[0] if reason.strip() else "unknown error"
    return line.split("; consider")[0].rstrip(".; ")


def _invalid(what: str, messages: list[str], param: str) -> InvalidRequestError:
    why = "; ".join(m.strip() for m in messages if m.strip()) or "unknown error"
    return InvalidRequestError(f"{what}: the grammar engine cannot compile it: {why}", param=param)
