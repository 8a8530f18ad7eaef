"""Which chat requests are *one-offs*: their session neither resumes a kept one nor is kept for a later request.

Chat UIs send, right after each reply, background requests whose prompt embeds the conversation under a
task template — Open WebUI 0.12 asks for follow-up suggestions, a title and tags, each one non-streamed user
message (``{"messages": [{"role": "user", "content": "### Task: … <chat_history>…</chat_history>"}],
"stream": false}``). Nobody continues them. Kept, their sessions take the servers' cache room, and when it runs
out the servers evict kept sessions: today's conversation, finished just before them, went first (issue 40).

A chat request is a one-off when nothing in it asks to be continued:

- it names no conversation (no ``X-Session-Id`` header, no ``user`` field: a named one is always kept);
- it is not streamed (interactive replies stream; the UIs' background requests do not);
- its messages are a single user message (no system prompt, no earlier turns) and it offers no tools.

Its choice runs without affinity: nothing is claimed (resuming a conversation's record would roll its caches
back to the shared prefix and then free them with the one-off) and its session is closed, not kept. A wrong
guess costs little: a script's non-streamed one-message request that *is* continued re-sends that message and
its reply on its second turn, which is then kept (it has earlier turns). The workers add their own guard
(``worker.cache_policy.keep_order``): kept sessions that were never resumed go before resumed ones.
"""

from __future__ import annotations

from gateway.schema.requests import ChatCompletionRequest

__all__ = ["is_one_off"]


def is_one_off(req: ChatCompletionRequest, session_key: str | None) -> bool:
    """Whether ``req`` (named by ``session_key``, None: unnamed) is a one-off whose session is not kept."""
    if session_key is not None or req.stream or req.tools or req.functions:
        return False
    return len(req.messages) == 1 and req.messages[0].role == "user"
