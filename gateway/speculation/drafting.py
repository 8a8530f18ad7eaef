"""Drafters for speculative decoding: cheap guesses at a choice's next tokens, made at the gateway.

The head verifies a drafter's proposal through the swarm in one step, so a good guess turns several round
trips into one and a bad guess costs only the tokens it wasted: drafts never change what is generated, only
how fast. Two kinds, behind one ``Drafter`` protocol:

- ``PromptLookupDrafter`` ("prompt lookup decoding"): the longest recent n-gram that ends the context and
  occurred before, in the context or in reference text (OpenAI "predicted outputs"), proposes what followed
  it. No model; an incremental index keeps each call O(new tokens), so 100k-token contexts stay cheap.
- ``DraftModel`` / ``ModelDrafter``: a small local 🤗 causal LM with the target's tokenizer, greedy. With
  ``layers=N`` it is the target's own first N blocks plus its final norm and head ("self-speculation"):
  no second model, and only those blocks' weights are read from the checkpoint. The model is loaded once and
  shared; each choice's ``ModelDrafter`` keeps its own KV cache and reuses it across calls (cropped back to
  what still agrees with the context).

A drafter serves one choice and is not thread-safe: one call at a time.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

__all__ = ["Drafter", "DraftModel", "ModelDrafter", "PromptLookupDrafter"]

log = logging.getLogger(__name__)


@runtime_checkable
class Drafter(Protocol):
    """One choice's drafter (not thread-safe; one call at a time)."""

    name: str  # "prompt_lookup" or "draft_model"

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k token ids likely to follow ``context`` (the prompt + every token accepted so far); may be
        fewer or empty (nothing worth guessing). ``context`` only grows between calls of one choice, except
        that a caller may pass a context that is not an extension of the previous one (then rebuild)."""
        ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ prompt lookup

#: the most context tokens indexed at once (a rebuild indexes the last ones): bounds the index's memory and the
#: first call's time (≈ 10 µs a token) for a choice with a very long prompt; what follows is indexed as it comes
MAX_INDEXED_TOKENS = 32768

#: how many of the previous context's last tokens must reappear in a new context for it to count as an
#: extension (checking them all would make every call O(context))
_TAIL_CHECK = 16


class PromptLookupDrafter:
    """Proposes the continuation of the longest n-gram (``max_ngram`` down to ``min_ngram`` tokens) that ends
    the context and occurred earlier in it (the most recent occurrence wins) or, failing that, in
    ``reference_ids`` (the first occurrence wins).

    Index: one dict from ``hash(n-gram)`` to where that n-gram last ended, for every n and every end position
    with at least one token after it (so the context's own suffix is never its match). It keeps hashes, not
    tuples, to save memory; a lookup compares the tokens themselves, so a hash collision only loses a draft.
    A new context that extends the previous one indexes just its new tokens; one whose length or last known
    tokens disagree rebuilds. A context that differs only further back keeps a stale
    index: worse guesses, never wrong output (the head verifies every draft).
    """

    name = "prompt_lookup"

    def __init__(self, reference_ids: Sequence[int] = (), max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._reference = list(reference_ids)
        #: built by the first ``propose`` (the engine primes the drafter in a worker thread, never on its loop)
        self._reference_index: dict[int, int] | None = None
        self._tokens: list[int] = []  # the context the index describes
        self._index: dict[int, int] = {}
        #: work done, for tests and metrics: end positions indexed (per n-gram size) and full rebuilds
        self.positions_indexed = 0
        self.rebuilds = 0

    def _ngram_sizes(self) -> range:
        return range(self.max_ngram, self.min_ngram - 1, -1)

    def _index_reference(self) -> dict[int, int]:
        if self._reference_index is None:
            self._reference_index = {}
            # first occurrence wins: index last to first, so earlier ends overwrite later ones
            for n in self._ngram_sizes():
                ends = _ngram_ends(self._reference, n, n, len(self._reference) - 1)
                self._reference_index.update(reversed(list(ends)))
        return self._reference_index

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self._sync(context)
        reference_index = self._index_reference()
        tokens = self._tokens
        if k <= 0 or not tokens:
            return []
        for n in self._ngram_sizes():
            if n > len(tokens):
                continue
            suffix = tokens[-n:]
            key = hash(tuple(suffix))
            end = self._index.get(key)
            if end is not None and tokens[end - n : end] == suffix:
                return tokens[end : end + k]
            end = reference_index.get(key)
            if end is not None and self._reference[end - n : end] == suffix:
                return self._reference[end : end + k]
        return []

    def _sync(self, context: Sequence[int]) -> None:
        """Bring the index up to ``context``: index its new tokens, or rebuild if it is not an extension."""
        old = len(self._tokens)
        tail = min(old, _TAIL_CHECK)
        if len(context) < old or list(context[old - tail : old]) != self._tokens[old - tail :]:
            self._tokens, self._index, old = [], {}, 0
            self.rebuilds += 1
        if len(context) == old:
            return
        self._tokens.extend(context[old:])
        # n-grams ending at old..len-1 now have a token after them (the first call: at 1..len-1, or only the
        # last MAX_INDEXED_TOKENS of a longer context)
        last = len(self._tokens) - 1
        start = max(old, len(self._tokens) - MAX_INDEXED_TOKENS) if old == 0 else old
        for n in self._ngram_sizes():
            self._index.update(_ngram_ends(self._tokens, n, max(start, n), last))
            self.positions_indexed += max(0, last - max(start, n) + 1)

    def close(self) -> None:
        self._tokens, self._index = [], {}


def _ngram_ends(tokens: list[int], n: int, first: int, last: int) -> Iterable[tuple[int, int]]:
    """``(hash(tokens[e-n:e]), e)`` for every end ``e`` in ``first..last`` (inclusive), in order."""
    if first > last:
        return iter(())
    grams = zip(*(tokens[first - n + i : last - n + i + 1] for i in range(n)), strict=True)
    return zip(map(hash, grams), range(first, last + 1), strict=True)


# ---------------------------------------------------------------------------------------------- draft model

#: prefill long contexts in chunks, so attention's [chunk, context] scores stay small
_PREFILL_CHUNK = 512

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class DraftModel:
    """A small local causal LM, loaded once and shared by every choice's ``ModelDrafter``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.num_layers = int(model.config.num_hidden_layers)
        max_positions = getattr(model.config, "max_position_embeddings", None)
        #: the longest context + drafts it can place (None: no limit in its config, e.g. ALiBi)
        self.max_positions: int | None = int(max_positions) if max_positions else None

    @classmethod
    def load(
        cls,
        path: str,
        layers: int | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        quant: str = "none",
    ) -> DraftModel:
        """The 🤗 checkpoint at ``path`` (offline), or with ``layers=N`` only its first N blocks + final norm
        and head. Truncation loads the checkpoint with a config of N layers, so the later blocks' tensors,
        never being parameters of the model, are never read (transformers reads safetensors lazily).
        ``quant`` (``int8``, ``nf4``; CPU only): the blocks' projections on the workers' quantized kernels."""
        if quant != "none" and torch.device(device).type != "cpu":
            raise ValueError(f"draft quantization {quant!r} runs on CPU drafts only, not {device}")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        total = int(config.num_hidden_layers)
        if layers is not None and not 1 <= layers <= total:
            raise ValueError(f"draft layers must be between 1 and the model's {total} layers, got {layers}")
        truncated = layers is not None and layers < total
        if truncated:
            config.num_hidden_layers = layers  # BLOOM's attribute_map writes n_layer
            layer_types = getattr(config, "layer_types", None)
            if isinstance(layer_types, list):  # per-layer attention kinds (sliding or full), where a family has them
                config.layer_types = layer_types[:layers]
        # transformers' load report would list the dropped blocks as "unexpected"; the check below says it
        # better (a filter, not a level: an ERROR level turns on its tensor-parallel plan warnings)
        loader = logging.getLogger("transformers.modeling_utils")
        quiet = _DropLoadReport() if truncated else None
        if quiet is not None:
            loader.addFilter(quiet)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, local_files_only=True, output_loading_info=True
            )
        finally:
            if quiet is not None:
                loader.removeFilter(quiet)
        unexpected = [key for key in info["unexpected_keys"] if not truncated or not _in_dropped_layer(key, layers)]
        if info["missing_keys"] or unexpected:
            log.warning(
                "draft model %s: missing weights %s, unexpected weights %s",
                path,
                sorted(info["missing_keys"]),
                sorted(unexpected),
            )
        model = model.to(device).eval()
        model.requires_grad_(False)
        if quant != "none":
            _quantize(model, quant, path)
        return cls(model)

    def drafter(self) -> ModelDrafter:
        """A drafter for one choice, with its own KV cache."""
        return ModelDrafter(self)


def _quantize(model: torch.nn.Module, quant: str, path: str) -> None:
    """The blocks' projections and the LM head on the workers' quantized kernels (same package, loaded on
    demand). The head too: a small model's head is a large part of its time per token (SmolLM2-135M's int8
    draft: 54 ms per token with a float head, 35 ms with an int8 one, the same guesses kept)."""
    from swarm_client.kernels.quantized import quantize_linear, quantize_linears

    if not quantize_linears(model, quant):
        log.warning("draft model %s: no block projection it knows to quantize; only its head is %s", path, quant)
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:  # a tied head gets its own quantized copy; the embeddings stay as they are
        model.set_output_embeddings(quantize_linear(head, quant))


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def _in_dropped_layer(key: str, layers: int | None) -> bool:
    """``key`` names a weight of block ``layers`` or later (its first number is the block index)."""
    match = _LAYER_INDEX.search(key)
    return layers is not None and match is not None and int(match.group(1)) >= layers


class ModelDrafter:
    """Greedy drafts from a ``DraftModel``, reusing the KV cache of the tokens it has already run."""

    name = "draft_model"

    def __init__(self, draft: DraftModel):
        self.draft = draft
        self._cache: DynamicCache | None = DynamicCache(config=draft.model.config)
        self._tokens: list[int] = []  # what the cache holds, in order
        self.closed = False

    @property
    def cached_tokens(self) -> int:
        return len(self._tokens)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if self.closed or self._cache is None:
            raise RuntimeError("propose() on a closed drafter")
        if not context:
            return []
        if k <= 0:  # priming: run all but the context's last token now, so the next call has little to do
            self._run_up_to(list(context), len(context) - 1)
            return []
        if self.draft.max_positions is not None:
            k = min(k, self.draft.max_positions - len(context))
        if k <= 0:
            return []
        context = list(context)
        # keep what still agrees with the context, but rerun at least its last token: its logits come next
        keep = self._rollback(min(_common_prefix(self._tokens, context), len(context) - 1))
        try:
            with torch.inference_mode():
                for start in range(keep, len(context), _PREFILL_CHUNK):
                    logits = self._forward(context[start : start + _PREFILL_CHUNK])
                drafts = [int(logits.argmax())]
                while len(drafts) < k:
                    drafts.append(int(self._forward(drafts[-1:]).argmax()))
        except BaseException:
            self._reset()  # a forward that failed may have written some layers' cache and not others
            raise
        return drafts

    def _run_up_to(self, context: list[int], end: int) -> None:
        """Have the cache hold exactly ``context[:end]``."""
        keep = self._rollback(min(_common_prefix(self._tokens, context), end))
        try:
            with torch.inference_mode():
                for start in range(keep, end, _PREFILL_CHUNK):
                    self._forward(context[start : min(start + _PREFILL_CHUNK, end)])
        except BaseException:
            self._reset()
            raise

    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        """Run ``token_ids`` after the cached tokens; the logits after the last one ([vocab])."""
        model = self.draft.model
        start = len(self._tokens)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)  # [1, T]
        positions = torch.arange(start, start + len(token_ids), device=model.device)  # [T]
        out = model(
            input_ids=input_ids, position_ids=positions[None], cache=self._cache, use_cache=True, logits_to_keep=1
        )
        self._tokens.extend(token_ids)
        return out.logits[0, -1]

    def _rollback(self, keep: int) -> int:
        """Drop all but the first ``keep`` cached tokens; how many are left (0 where the cache cannot crop)."""
        if keep == 0:
            self._reset()
        elif keep < len(self._tokens):
            assert self._cache is not None
            try:
                self._cache.crop(keep - len(self._tokens))  # transformers 5: a negative count of tokens to drop
            except RuntimeError:  # a sliding-window layer past its window has forgotten what is needed
                self._reset()
                return 0
            del self._tokens[keep:]
        return keep

    def _reset(self) -> None:
        self._cache = DynamicCache(config=self.draft.model.config)
        self._tokens = []

    def close(self) -> None:
        self.closed = True
        self._cache = None
        self._tokens = []


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (the context extends what was run), at C speed
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
