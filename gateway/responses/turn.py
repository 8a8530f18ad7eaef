"""One ``POST /v1/responses`` request, checked and rendered (``Turn``): its conversation, tools, prompt,
constraint and response objects — everything the JSON answer and the SSE answer (gateway/responses/stream.py)
both need.

The prompt is the previous response's conversation (chat messages: gateway/responses/store.py), then this
request's input (gateway/responses/input.py), with ``instructions`` as a system message in front, rendered
by the chat path: ``chat_messages`` for tool calls and results in the served model's tool format, the chat
template with the tools (gateway/responses/tools.py plans them as chat does). ``truncation: "auto"`` drops
the oldest turns until it fits, and the stored conversation is what was rendered, so a long chain stays as
long as the context window.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import Request

from gateway.api.chat_messages import chat_messages
from gateway.api.request_parts import cache_owner, sampling_params, session_key
from gateway.api.serving import chat_grammar
from gateway.backends.adapters import ServedModel
from gateway.decode.choices import ChoiceResult
from gateway.decode.engine import Engine
from gateway.decode.sampling import SamplingParams, choice_seed
from gateway.errors import ContextLengthExceededError, GatewayError, InvalidRequestError
from gateway.responses.input import called_ids, input_messages
from gateway.responses.output import OutputItems, dump
from gateway.responses.schema import (
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    ResponseCreateRequest,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    response_format_of,
)
from gateway.responses.store import ResponseStore, StoredResponse
from gateway.responses.tools import plan_response_tools
from gateway.schema.requests import ChatCompletionMessageParam, ChatCompletionRequest

logger = logging.getLogger(__name__)

__all__ = ["Turn"]

#: what a reply's token is taken to weigh when a turn's stored size is estimated before it runs, and what its
#: output items, usage and ids add
_REPLY_BYTES_PER_TOKEN = 4
_ENTRY_OVERHEAD_BYTES = 1024


class Turn:
    """One request: its conversation so far, tools, prompt ids, budget and the response objects."""

    def __init__(
        self,
        engine: Engine,
        req: ResponseCreateRequest,
        request: Request,
        served: ServedModel,
        previous: StoredResponse | None,
    ):
        self.engine = engine
        #: the base model or the LoRA adapter the request's ``model`` names
        self.served = served
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        #: whose it is: the API key's id, else the bearer token's, else the client's address (as affinity)
        self.owner = cache_owner(request)
        #: the tools in play, planned as chat plans them (None: none)
        self.plan = plan_response_tools(req.tools, req.tool_choice, req.parallel_tool_calls, engine.tool_format)
        earlier = previous.messages if previous else []
        #: the conversation without instructions: what a follow-up continues
        self.conversation = earlier + input_messages(req.input, called_ids(earlier))
        if not self.conversation:
            raise InvalidRequestError("input: must contain at least one item.", param="input")
        if previous is not None:
            self.session_key = previous.session_key
        else:
            self.session_key = session_key(request, req.user) or f"responses:{self.owner}:{self.id}"
        #: the prompt ids and completion budget, set by ``fit``
        self.prompt: list[int] = []
        self.max_tokens = 0
        self.model = served.id
        self.created = ResponseObject(id=self.id, status="in_progress", model=self.model).created_at

    async def fit(self, store: ResponseStore) -> None:
        """Render the prompt on the engine's tokenize thread (never on the event loop: prompts can be
        megabytes) and set ``prompt`` and ``max_tokens``; a conversation the store could not keep is a 400."""
        self.prompt, self.max_tokens = await self.engine.tokenize.run(self._fit, self.engine, store.max_entry_bytes)

    def _fit(self, engine: Engine, max_entry_bytes: int) -> tuple[list[int], int]:
        """The prompt ids and the completion budget; ``truncation: "auto"`` drops the oldest turns (never
        the system messages, never the last item; a call's results with it) until they fit the context
        window. On the tokenize thread."""
        head = [{"role": "system", "content": self.req.instructions}] if self.req.instructions else []
        plan, fmt = self.plan, self.engine.tool_format
        tools = plan.tools if plan is not None and fmt.native else None
        turns = list(self.conversation)
        while True:
            requested = self.req.max_output_tokens
            try:
                messages = chat_messages(
                    [ChatCompletionMessageParam.model_validate(m) for m in head + turns], fmt, plan
                )
                prompt = engine.render_chat_sync(messages, tools, requested=requested, param="input")
                budget = engine.max_tokens_for(len(prompt), requested, param="input")
                break
            except ContextLengthExceededError:
                droppable = [i for i, m in enumerate(turns[:-1]) if m["role"] != "system"]
                if self.req.truncation != "auto" or not droppable:
                    raise
                first = droppable[0]
                del turns[first]
                while first < len(turns) - 1 and turns[first]["role"] == "tool":  # results of a dropped call
                    del turns[first]
        self.conversation = turns
        if self.req.store is not False:
            self._check_storable(max_entry_bytes, budget)
        return prompt, budget

    def _check_storable(self, max_entry_bytes: int, budget: int) -> None:
        """A 400 for a turn whose entry would be over ``max_entry_bytes``: the conversation, the response
        object, and the reply twice (in both) at ``_REPLY_BYTES_PER_TOKEN``."""
        kept = [self.conversation, dump(self.response("completed"))]
        size = len(json.dumps(kept, ensure_ascii=False).encode()) + _ENTRY_OVERHEAD_BYTES
        size += 2 * _REPLY_BYTES_PER_TOKEN * budget
        if size > max_entry_bytes:
            raise InvalidRequestError(
                f"store: this response would be kept with its conversation, about {size} bytes, more than this "
                f"gateway keeps of one response ({max_entry_bytes} bytes). Send store: false (and the whole "
                "conversation as input), or start a new conversation.",
                param="store",
            )

    async def constraint(self) -> Any:
        """What shapes the reply, as chat decides it: calls when ``tool_choice`` forces them, else
        ``text.format``'s grammar (None: free text)."""
        chat = ChatCompletionRequest.model_construct(messages=[], response_format=response_format_of(self.req.text))
        try:
            return await chat_grammar(self.engine, chat, self.plan)
        except InvalidRequestError as exc:  # it speaks of chat's response_format; here it is text.format
            message = exc.message.replace("response_format", "text.format")
            param = "text.format" if exc.param == "response_format" else exc.param
            raise InvalidRequestError(message, param=param, code=exc.code) from None

    async def keeps_special_tokens(self) -> bool:
        """Whether the tool format's opener is one special token that decoding must keep (as chat does)."""
        if self.plan is None:
            return False
        return await self.engine.special_token_id(self.plan.fmt.opener or "<|python_tag|>") is not None

    def stop(self) -> list[str]:
        """Stop strings the tool plan adds, as chat's (a free reply limited to one call ends at its closer)."""
        return self.plan.stop if self.plan is not None else []

    def sampling(self, constraint: Any) -> SamplingParams:
        return sampling_params(self.engine, self.req, choice_seed(self.req.seed, 0), constraint)

    def output(self) -> OutputItems:
        return OutputItems(self.plan, self.message_id)

    def response(
        self,
        status: str,
        output: list[OutputItem] | None = None,
        result: ChoiceResult | None = None,
        error: GatewayError | None = None,
    ) -> ResponseObject:
        """The response object in ``status`` with ``output`` (none yet: empty)."""
        req = self.req
        usage = None
        if result is not None:
            usage = ResponseUsage(
                input_tokens=len(self.prompt),
                input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens),
                output_tokens=result.completion_tokens,
                total_tokens=len(self.prompt) + result.completion_tokens,
            )
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,  # type: ignore[arg-type]  # one of the four, by construction
            error=ResponseError(code=error.code or error.type, message=error.message) if error else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls,
            model=self.model,
            output=output or [],
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            store=req.store is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            text=req.text or {"format": {"type": "text"}},
            tool_choice=req.tool_choice or "auto",
            tools=req.tools or [],
            top_p=1.0 if req.top_p is None else req.top_p,
            truncation=req.truncation or "disabled",
            usage=usage,
            user=req.user,
            metadata=req.metadata or {},
        )

    def status_of(self, result: ChoiceResult) -> str:
        return "incomplete" if result.finish_reason == "length" else "completed"

    async def remember(self, store: ResponseStore, items: OutputItems, response: ResponseObject) -> None:
        """Keep the response and its conversation (``store`` not false). The reply is served either way:
        an entry the store refuses or cannot reach is logged, and a follow-up naming it is a 404."""
        if self.req.store is False:
            return
        messages = [*self.conversation, items.assistant_message()]
        entry = StoredResponse(self.id, self.owner, self.session_key, messages, dump(response))
        try:
            kept = await store.put(entry)
        except GatewayError as exc:  # the Redis store is unreachable
            logger.warning("response %s was not stored: %s", self.id, exc.message)
            return
        if not kept:
            logger.warning("response %s was not stored: over %d bytes with its reply", self.id, store.max_entry_bytes)
