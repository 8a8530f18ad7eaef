"""How many of a chat prompt's tokens are its tool definitions, said in the 400 for a prompt too long.

A chat UI sends its tools with every message (Open WebUI: dozens, ~7k tokens), tokens its user never wrote
and cannot see: "the prompt is 16,285 tokens" alone leaves them shortening a conversation that is mostly
tools. The count is the preamble the tools add to a one-line conversation, rendered as the prompt is
(the template's own tools, or the instructions taught in the system message), and is made only on the
error path.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from gateway.api.chat_messages import with_instructions
from gateway.api.request_parts import CACHE_CAPACITY_EXCEEDED
from gateway.decode.engine import Engine
from gateway.errors import GatewayError, InvalidRequestError
from gateway.tools.plan import ToolPlan, tool_instructions

__all__ = ["naming_tool_share", "tool_preamble_tokens"]

#: the errors of a prompt that does not fit: the model's context window, the swarm's largest KV cache
TOO_LONG = {"context_length_exceeded", CACHE_CAPACITY_EXCEEDED}
_PROBE = ({"role": "user", "content": "?"},)


async def tool_preamble_tokens(engine: Engine, plan: ToolPlan) -> int | None:
    """Tokens ``plan``'s tools add to a prompt; None when the template renders no one-line conversation.
    Tools too long for the context window on their own raise its ``ContextLengthExceededError``."""
    try:
        bare = await engine.render_chat(list(_PROBE))
    except GatewayError:
        return None
    if plan.fmt.native:
        full = await engine.render_chat(list(_PROBE), plan.tools)
    else:
        full = await engine.render_chat(with_instructions(list(_PROBE), tool_instructions(plan.tools, plan.fmt)))
    return max(len(full) - len(bare), 0)


@contextlib.asynccontextmanager
async def naming_tool_share(engine: Engine, plan: ToolPlan | None) -> AsyncIterator[None]:
    """Around a chat request's prompt and admission: a 400 for a prompt too long also says how many of its
    tokens are the tool definitions (and that fewer tools would help)."""
    try:
        yield
    except InvalidRequestError as error:
        if plan is None or error.code not in TOO_LONG:
            raise
        try:
            tokens = await tool_preamble_tokens(engine, plan)
        except InvalidRequestError:
            note = f" The {len(plan.tools)} tool definitions alone are longer than that."
        else:
            note = (
                f" {tokens} of the prompt's tokens are the {len(plan.tools)} tool definitions sent with it (tools):"
                " sending fewer tools leaves more room for the conversation."
                if tokens
                else ""
            )
        error.message += note
        error.args = (error.message,)
        raise
