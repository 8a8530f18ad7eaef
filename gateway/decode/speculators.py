"""Which drafter each choice gets: the gateway's speculation settings, the request's choice, the draft model.

``--speculation auto`` (the default) drafts with the draft model when one is loaded (``--draft-model``,
``--draft-layers``), else by prompt lookup, which costs nothing and needs no model; ``off`` drafts only
for requests that ask (the request's ``speculation`` field: ``auto`` = the gateway's setting, ``off``,
``prompt_lookup``, ``draft_model``). Either way the planner (gateway/speculation/verify.py) sends guesses only
while they pay, so speculation on by default never slows a choice down by more than a few exploratory steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from gateway.decode.choices import ChoiceSpec
from gateway.errors import InvalidRequestError
from gateway.settings import GatewaySettings
from gateway.speculation.verify import SPECULATION_MODES, ChoiceSpeculator, StepCosts

__all__ = ["Speculators"]

logger = logging.getLogger(__name__)


class Speculators:
    """Makes each choice's ``ChoiceSpeculator``; owns the draft model and the measured step costs."""

    def __init__(self, settings: GatewaySettings, costs: StepCosts, enabled: bool = True):
        #: False: the backend cannot return every position's logits; every choice decodes plainly
        self.enabled = enabled
        self.mode = settings.speculation
        self.max_draft = settings.max_draft_tokens
        self.costs = costs
        self.draft_model = None
        #: the thread that drafts a draft model's next guesses while a step is on the wire (speculation/draft_ahead.py)
        self.ahead: ThreadPoolExecutor | None = None
        if settings.draft_model and enabled:
            from gateway.speculation.drafting import DraftModel
            from swarm_client.model_source import resolve_model_path

            logger.info(
                "loading the draft model %s%s%s",
                settings.draft_model,
                f" (its first {settings.draft_layers} layers)" if settings.draft_layers else "",
                f", quantized to {settings.draft_quant}" if settings.draft_quant != "none" else "",
            )
            path = str(resolve_model_path(settings.draft_model))
            self.draft_model = DraftModel.load(path, layers=settings.draft_layers, quant=settings.draft_quant)
            self.ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-ahead")

    def check(self, mode: str | None) -> None:
        """A request's ``speculation`` field: one of ``SPECULATION_MODES``, and ``draft_model`` only with one."""
        if mode is None:
            return
        if mode not in SPECULATION_MODES:
            raise InvalidRequestError(
                f"speculation: {mode!r} is not one of {', '.join(SPECULATION_MODES)}.", param="speculation"
            )
        if mode == "draft_model" and self.draft_model is None:
            raise InvalidRequestError(
                "speculation: this gateway has no draft model (start it with --draft-model); use "
                "'prompt_lookup' or 'auto'.",
                param="speculation",
            )

    def drafter_for(self, requested: str) -> str | None:
        """The drafter a choice asking for ``requested`` gets, or None (plain decoding)."""
        mode = self.mode if requested == "auto" else requested
        if mode == "off":
            return None
        if mode == "auto":
            return "draft_model" if self.draft_model is not None else "prompt_lookup"
        return mode

    def for_choice(
        self, spec: ChoiceSpec, admit: Callable[[Sequence[int]], int] | None = None
    ) -> ChoiceSpeculator | None:
        """The choice's speculator (None: plain decoding); ``admit`` truncates guesses to what the choice's
        constraint allows (``Sampler.allowed_prefix``)."""
        name = self.drafter_for(spec.speculation) if self.enabled else None
        if name is None or spec.max_tokens < 2:  # one token: nothing to guess
            return None
        ahead = None
        if name == "draft_model" and self.draft_model is not None:
            drafter, ahead = self.draft_model.drafter(), self.ahead
        else:
            from gateway.speculation.drafting import PromptLookupDrafter

            drafter = PromptLookupDrafter(spec.reference_ids)
        return ChoiceSpeculator(drafter, self.costs, self.max_draft, spec.prompt_ids, spec.max_tokens, ahead, admit)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.shutdown(wait=False, cancel_futures=True)
        self.draft_model = None
