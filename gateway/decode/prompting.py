"""Prompts and their limits, the request-level checks that need the model but no session: which model a
request may name, chat messages → prompt ids through the tokenizer's chat template, text ↔ ids, the
completion budget within the context window (a 400 naming both numbers, before any stream starts), and the
ids that end a generation (``eos_token_ids``).

``PromptRules`` is the base of ``Engine`` (gateway/decode/engine.py), so the request handlers (gateway/api/serving.py)
ask the engine. Request text is tokenized on the engine's tokenize thread (gateway/decode/tokenize_thread.py), never
on the event loop: the ``*_sync`` methods run there (each takes the thread's own tokenizer copy, which it
refuses to hand out anywhere else), the async ones send them there. ``tokenizer`` itself, the backend's
object, stays with the event loop (detokenizing streams, logprobs): HF fast tokenizers are not safe to
share across threads.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import os
from collections.abc import Sequence
from typing import Any

from gateway.backends.adapters import ServedModel, parse_adapter_aliases, public_model_id, select_model, served_models
from gateway.backends.base import AdapterBackend, ModelBackend
from gateway.backends.swarm_view import backend_room
from gateway.decode.detokenize import TokenVocab
from gateway.decode.tokenize_thread import TokenizeThread, encode_lazily, tokens_past
from gateway.errors import ContextLengthExceededError, InvalidRequestError, ModelNotFoundError
from gateway.settings import GatewaySettings
from gateway.tools.formats import TOOL_FORMATS, ToolFormat, detect_tool_format
from swarm_client.dht_records import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

__all__ = ["PromptRules", "PromptTooLongError", "eos_token_ids"]


class PromptTooLongError(ContextLengthExceededError):
    """A prompt whose beginning alone is past the context window (``tokens_past``): it was not counted
    whole, so the message gives a lower bound."""

    def __init__(self, *, max_context: int, at_least: int, chars: int, param: str):
        where = "messages" if param == "messages" else "prompt"
        InvalidRequestError.__init__(
            self,
            f"This model's maximum context length is {max_context} tokens. However, the {where} alone "
            f"({chars} characters) are more than {at_least} tokens. Please reduce the length of the {where}.",
            param=param,
        )


def _prediction_too_long(tokens: str, chars: int, limit: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"prediction: its content is {tokens} tokens ({chars} characters), more than the model's context "
        f"window ({limit}); send the part of it the answer may repeat.",
        param="prediction",
    )


def eos_token_ids(backend: ModelBackend) -> frozenset[int]:
    """The tokenizer's EOS and the model's generation_config EOS ids (chat models often end on a turn
    token such as ``<|im_end|>`` that only the generation config names). A backend may expose
    ``generation_config``; the protocol does not require it."""
    ids: set[int] = set()
    candidates = [
        getattr(backend.tokenizer, "eos_token_id", None),
        getattr(getattr(backend, "generation_config", None), "eos_token_id", None),
    ]
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value if v is not None)
    return frozenset(ids)


class PromptRules:
    """The served model's name, tokenizer and context window, and the checks a request must pass."""

    def __init__(self, backend: ModelBackend, settings: GatewaySettings):
        self.backend = backend
        self.settings = settings
        #: the event loop's tokenizer (token ids → text); request text goes to ``tokenize``
        self.tokenizer = backend.tokenizer
        self.vocab = TokenVocab(self.tokenizer)
        self.vocab_size = len(self.tokenizer)  # read here once: the tokenize thread asks too
        #: the thread (and tokenizer copy) for request text: prompts of megabytes never hold the event loop
        self.tokenize = TokenizeThread(self.tokenizer)
        self._special_ids: dict[str, int | None] = {}
        #: model name → the LoRA adapter it selects (``--adapter-alias NAME=ALIAS``; gateway/backends/adapters.py)
        self.adapter_aliases = parse_adapter_aliases(settings.adapter_aliases)

    @property
    def model_id(self) -> str:
        """The served model's public name (never a filesystem path: gateway/backends/adapters.py)."""
        return public_model_id(self.backend.model_id)

    async def served_models(self) -> list[ServedModel]:
        """The base model, then each LoRA adapter the backend can run now (``BASE:NAME``) and its aliases.
        A backend that cannot say (the swarm unreachable) serves the base model only, for now."""
        adapters: list[str] = []
        if isinstance(self.backend, AdapterBackend):
            try:
                adapters = await asyncio.to_thread(self.backend.served_adapters)
            except Exception as exc:
                logger.warning("could not read the served adapters: %s", exc)
        return served_models(self.model_id, adapters, self.adapter_aliases)

    async def select_model(self, requested: str | None) -> ServedModel:
        """The served model the request's ``model`` names (None: the base model), a 404 ``model_not_found``
        listing those that exist otherwise. The base model's names need no look at the swarm. The backend's
        own id (a path) still names it, as before, though no answer shows it."""
        private, public = self.backend.model_id, self.model_id
        if (
            requested is not None
            and private != public
            and (requested == private or requested.startswith(private + ":"))
        ):
            requested = public + requested[len(private) :]
        try:
            return select_model(requested, [ServedModel(public)])
        except ModelNotFoundError:
            if not isinstance(self.backend, AdapterBackend):
                raise
        return select_model(requested, await self.served_models())

    def max_tokens_for(self, prompt_len: int, requested: int | None, *, param: str) -> int:
        """The completion budget: ``requested`` if it fits the context window (else a 400 naming both), or
        ``min(default_max_tokens, what is left)`` when the request names none — what is left of the context
        window and of the largest KV cache one server of the swarm holds: a user who set no ``max_tokens``
        gets a shorter reply, not a 400 telling them a ``max_tokens`` they never chose is too large."""
        limit = self.backend.max_context
        if requested is not None:
            if prompt_len + requested > limit:
                raise ContextLengthExceededError(
                    max_context=limit, prompt_tokens=prompt_len, completion_tokens=requested, param=param
                )
            return requested
        if prompt_len >= limit:
            raise ContextLengthExceededError(
                max_context=limit, prompt_tokens=prompt_len, completion_tokens=1, param=param
            )
        budget = min(self.settings.default_max_tokens, limit - prompt_len)
        room = backend_room(self.backend)
        if room is not None and 0 < room.largest - prompt_len < budget:
            return room.largest - prompt_len
        return budget

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: what produced an answer — the swarmserve release, the swarm's
        protocol version and the served model (a change in any may change outputs for the same seed)."""
        try:
            release = importlib.metadata.version("swarmserve")
        except importlib.metadata.PackageNotFoundError:
            release = "0.0.0+unknown"
        model = os.path.basename(self.backend.model_id.rstrip("/")) or self.backend.model_id
        return f"swarmserve-{release}-p{PROTOCOL_VERSION}-{model}"

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How the served model writes tool calls: the settings' choice, else what its chat template teaches."""
        name = self.settings.tool_format
        if name != "auto":
            return TOOL_FORMATS[name]
        return detect_tool_format(getattr(self.tokenizer, "chat_template", None))

    async def special_token_id(self, text: str | None) -> int | None:
        """The id of ``text`` when the tokenizer has it as one special token (``[TOOL_CALLS]``: decoding
        drops it unless told to keep special tokens), else None. Asked once per text, then remembered."""
        if not text:
            return None
        if text not in self._special_ids:
            self._special_ids[text] = await self.tokenize.run(self.special_token_id_sync, text)
        return self._special_ids[text]

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        requested: int | None = None,
    ) -> list[int]:
        """``render_chat_sync`` on the tokenize thread."""
        return await self.tokenize.run(self.render_chat_sync, messages, tools, requested=requested)

    async def prediction_ids(self, text: str | None) -> list[int]:
        """The token ids of a request's ``prediction`` content (what the drafter may copy from), on the
        tokenize thread; none for none."""
        return [] if not text else await self.tokenize.run(self.prediction_ids_sync, text)

    # ----------------------------------------------------------------- on the tokenize thread (tokenize.run)

    def prediction_ids_sync(self, text: str) -> list[int]:
        """A prediction longer than the context window is a 400; like a prompt's, one of megabytes is
        refused on the count of its beginning (``tokens_past``: milliseconds, where tokenizing 8 MiB whole
        held this thread, and every other request's prompt behind it, for a minute and a half)."""
        tokenizer, limit = self.tokenize.own(), self.backend.max_context
        past = tokens_past(tokenizer, text, limit, add_special_tokens=False)
        if past is not None:
            raise _prediction_too_long(f"more than {past}", len(text), limit)
        count, ids = encode_lazily(tokenizer, text, add_special_tokens=False)
        if count > limit:
            raise _prediction_too_long(str(count), len(text), limit)
        return ids()

    def special_token_id_sync(self, text: str) -> int | None:
        tokenizer = self.tokenize.own()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=True):
            return None
        return int(ids[0])

    def render_chat_sync(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        requested: int | None = None,
        param: str = "messages",
    ) -> list[int]:
        """Messages → prompt ids through the tokenizer's chat template, ending with the assistant's turn;
        ``tools`` (OpenAI's shape) go to templates that render them (gateway/tools/plan.py). A prompt
        longer than the context window is ``max_tokens_for``'s 400 (with ``requested``) before its ids
        are made."""
        tokenizer = self.tokenize.own()
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("This model has no chat template; use /v1/completions instead.", param="messages")
        extra = {"tools": tools} if tools else {}
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as exc:  # jinja raises TemplateError for conversations the template refuses
            raise InvalidRequestError(f"The chat template rejected these messages: {exc}", param="messages") from None
        # the template already wrote BOS and every special token it wants
        return self._ids(text, add_special_tokens=False, requested=requested, param=param)

    def encode_sync(self, text: str, *, requested: int | None = None, param: str = "prompt") -> list[int]:
        """``text``'s ids (BOS and all); like ``render_chat_sync``, an overlong text is a 400 first."""
        return self._ids(text, add_special_tokens=True, requested=requested, param=param)

    def _ids(self, text: str, *, add_special_tokens: bool, requested: int | None, param: str) -> list[int]:
        tokenizer, limit = self.tokenize.own(), self.backend.max_context
        past = tokens_past(tokenizer, text, limit, add_special_tokens=add_special_tokens)
        if past is not None:  # megabytes: its beginning alone is too long, the rest is not worth counting
            raise PromptTooLongError(max_context=limit, at_least=past, chars=len(text), param=param)
        count, ids = encode_lazily(tokenizer, text, add_special_tokens=add_special_tokens)
        if count > limit:
            self.max_tokens_for(count, requested, param=param)  # raises: no budget fits
        return ids()

    def decode_sync(self, ids: Sequence[int]) -> str:
        tokenizer = self.tokenize.own()
        return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
