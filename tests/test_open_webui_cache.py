"""An Open WebUI conversation keeps its cache while Open WebUI's background requests come and go (issue 40),
over a real swarm (``slow``): a DHT and two worker processes over the tiny Llama (blocks 0:2 and 2:4), each
with a cache of ``CACHE_TOKENS`` slots — room for the conversation and one background request, as the issue's
16k-token workers held a 14–16k-token chat — and a gateway with its default flags on a real Redis.

The replay sends what Open WebUI 0.12 sends for each turn (``open_webui_turns``): the chat request as
recorded (tests/data/, streamed, tools and all — the first two of its 36 tools, ~840 tokens here, since all
36 outgrow the tiny model's 2k context), then after the reply its follow-up, title and tags requests, in the
order its ``background_tasks_handler`` sends them: each one non-streamed user message that embeds the chat's
last messages under a task template. Two deviations bound the run time on a CPU, as in test_open_webui.py:
the random model never stops by itself, so the title asks for ``TASK_TOKENS`` tokens, not Open WebUI's 1000
(a real model's title is a few tokens), and the gateway's default ``max_tokens`` is the test gateways' 32.

Before this fix the workers kept every background request's session and evicted kept sessions least
recently used first, so the title request evicted the conversation: turn 2 and later prefilled the whole
tool preamble again (``cached_tokens`` 0). Now the gateway closes one-offs instead of keeping them
(gateway/affinity/one_off.py), and a worker evicts kept sessions never resumed before resumed ones
(worker/cache_policy.py ``keep_order``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.affinity.one_off import is_one_off
from gateway.api.chat_messages import chat_messages
from gateway.schema.requests import ChatCompletionRequest
from gateway.tools.plan import plan_tools
from tests.gateway_fixtures import REQUEST_TIMEOUT_S, Gateway, swarm_gateway
from tests.test_tool_calling import open_webui_request

SPANS = ["0:2", "2:4"]
#: per worker: the conversation (~870 slots at turn 1, ≤ ~1,200 by turn 6) and one background request (≤ ~550)
#: fit; the conversation and two background requests (~870 + ~350 + ~300 + ~360 at turn 1) do not
CACHE_TOKENS = 1792
TOOLS = 2
TASK_TOKENS = 32
QUESTIONS = [
    "What time is it in Lisbon?",
    "And how long until midnight there?",
    "Which knowledge bases do I have?",
    "Search them for opening hours.",
    "Ask me which one I meant.",
    "Thanks, write it down.",
]

# Open WebUI's task prompts, in its shape: a task, guidelines, an output format, then the chat's last messages
# rendered "ROLE: content" (its {{MESSAGES:END:n}}) inside <chat_history> (our wording, its structure)
TASKS = {
    "follow_up": (
        6,
        "### Task:\nSuggest 3-5 follow-up questions the user could ask next in this conversation, written from "
        "the user's point of view, to continue or deepen the discussion.\n### Guidelines:\n- Keep them concise "
        "and about the topics discussed.\n- Do not repeat what was already covered.\n- Use the chat's language; "
        "English if it is mixed.\n- Answer with a JSON object only.\n### Output:\nJSON format: "
        '{ "follow_ups": ["Question 1?", "Question 2?", "Question 3?"] }\n',
    ),
    "title": (
        2,
        "### Task:\nGenerate a concise, 3-5 word title with an emoji that sums up the chat history.\n"
        "### Guidelines:\n- The title says what the conversation is about.\n- No quotation marks or special "
        "formatting.\n- Use the chat's language; English if it is mixed.\n- Accurate before creative.\n"
        "### Output:\nOnly the title text, nothing else.\n",
    ),
    "tags": (
        6,
        "### Task:\nGenerate 1-3 broad tags for the main themes of the chat history, and 1-3 more specific "
        "subtopic tags.\n### Guidelines:\n- Start with high-level domains (Science, Technology, Arts, Business, "
        "Health, Education...).\n- Add subfields when they run through the conversation.\n- Too short or too "
        'diverse: only ["General"].\n### Output:\nJSON format: { "tags": ["tag1", "tag2", "tag3"] }\n',
    ),
}


def task_request(model: str, task: str, messages: list[dict]) -> dict:
    """Open WebUI's request for one background task over the chat's ``messages`` (its /api/v1/tasks router:
    one user message, not streamed, the title capped by ``max_completion_tokens``)."""
    last, template = TASKS[task]
    history = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages[-last:])
    content = f"{template}### Chat History:\n<chat_history>\n{history}\n</chat_history>"
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "stream": False}
    if task == "title":
        body["max_completion_tokens"] = TASK_TOKENS
    return body


def chat_body(gw: Gateway, messages: list[dict], tools: slice = slice(TOOLS)) -> dict:
    """Open WebUI's recorded chat request over ``messages`` with the ``tools`` of its 36 (and usage asked for,
    to read ``cached_tokens``)."""
    recorded = open_webui_request()
    body = {**recorded, "model": gw.model, "messages": messages, "tools": recorded["tools"][tools]}
    if not body["tools"]:
        del body["tools"]
    return {**body, "stream_options": {"include_usage": True}}


def stream_chat(gw: Gateway, body: dict, timeout: float = REQUEST_TIMEOUT_S, refusals: bool = False) -> dict[str, Any]:
    """POST a streamed chat as Open WebUI does; the reply's text, usage, and seconds to its first token. A
    refusal (a non-200, or an error frame in the stream) fails the test, or with ``refusals`` is returned:
    its status and ``error``."""
    started = time.perf_counter()
    first: float | None = None
    text, usage = "", None
    with (
        httpx.Client(base_url=gw.url, timeout=timeout) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        status = r.status_code
        if refusals and status != 200:
            return {"status": status, "error": json.loads(r.read())["error"], "total": time.perf_counter() - started}
        assert status == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if refusals and "error" in chunk:
                return {"status": status, "error": chunk["error"], "total": time.perf_counter() - started}
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"].get("content") or ""
                if (delta or choice["delta"].get("tool_calls")) and first is None:
                    first = time.perf_counter() - started
                text += delta
    return {"status": status, "text": text, "usage": usage, "ttft": first, "total": time.perf_counter() - started}


class OpenWebUIChat:
    """One Open WebUI conversation replayed turn by turn (``turn``): per request, its kind, status, usage and
    timings."""

    def __init__(
        self, gw: Gateway, tools: slice = slice(TOOLS), questions: list[str] = QUESTIONS, timeout: float = 0.0
    ):
        self.gw = gw
        self.tools = tools
        self.questions = questions
        #: seconds an HTTP call may take (0: the tests' ``REQUEST_TIMEOUT_S``)
        self.timeout = timeout or REQUEST_TIMEOUT_S
        self.messages: list[dict] = []

    def replay(self, turns: int) -> list[dict[str, Any]]:
        return [row for question in self.questions[:turns] for row in self.turn(question)]

    def turn(self, question: str) -> list[dict[str, Any]]:
        """The chat request with ``question``, then the follow-up, title and tags requests."""
        turn = len(self.messages) // 2 + 1
        self.messages.append({"role": "user", "content": question})
        reply = stream_chat(self.gw, chat_body(self.gw, self.messages, self.tools), self.timeout)
        rows = [{"turn": turn, "kind": "chat", **reply}]
        self.messages.append({"role": "assistant", "content": reply["text"]})
        with httpx.Client(base_url=self.gw.url, timeout=self.timeout) as http:
            for task in TASKS:
                started = time.perf_counter()
                r = http.post("/v1/chat/completions", json=task_request(self.gw.model, task, self.messages))
                took = time.perf_counter() - started
                assert r.status_code == 200, (task, r.text)
                rows.append({"turn": turn, "kind": task, "status": r.status_code, "usage": r.json()["usage"],
                             "ttft": None, "total": took})  # fmt: skip
        return rows


def preamble_tokens(gw: Gateway, which: slice = slice(TOOLS)) -> int:
    """The tokens every turn's prompt starts with, up to the conversation's first message: the tool preamble,
    rendered as the gateway renders it (in the template's own tool format, or taught in the system message)."""
    engine = gw.server.app.state.engine
    tools = open_webui_request()["tools"][which]
    prompts = []
    for question in ("a", "b"):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": question}], tools=tools)
        plan = plan_tools(req, engine.tool_format)
        native = plan.tools if plan is not None and engine.tool_format.native else None
        text = engine.tokenizer.apply_chat_template(
            chat_messages(req.messages, engine.tool_format, plan),
            add_generation_prompt=True,
            tokenize=False,
            **({"tools": native} if native else {}),
        )
        prompts.append(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    return next(i for i, (x, y) in enumerate(zip(*prompts, strict=False)) if x != y)


def print_rows(rows: list[dict[str, Any]], preamble: int, cache_tokens: int = CACHE_TOKENS) -> None:
    print(f"\ntool preamble: {preamble} tokens; worker cache: {cache_tokens} slots each")
    print("turn | request   | status | prompt | cached | completion | first token s | total s")
    for r in rows:
        u = r["usage"]
        ttft = f"{r['ttft']:.2f}" if r["ttft"] is not None else "-"
        cached = u["prompt_tokens_details"]["cached_tokens"]
        print(f"{r['turn']:4} | {r['kind']:9} | {r['status']:6} | {u['prompt_tokens']:6} | {cached:6} | "
              f"{u['completion_tokens']:10} | {ttft:>13} | {r['total']:.2f}")  # fmt: skip


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def small_cache_gw(tiny_llama: str, redis_url: str) -> Iterator[tuple[Gateway, Any]]:
    from tests.swarm_fixtures import swarm

    cache = ("--cache-tokens", str(CACHE_TOKENS))
    with (
        swarm(tiny_llama, SPANS, "--throughput", "1000", *cache) as s,
        swarm_gateway(tiny_llama, s.initial_peers, redis_url=redis_url, replica_id="open-webui-cache") as gw,
    ):
        yield gw, s


def long_system_chat(gw: Gateway, tag: str, tokens: int) -> list[dict]:
    """A first turn whose system prompt makes its prompt about ``tokens`` tokens long."""
    tokenizer = gw.server.app.state.engine.tokenizer
    facts: list[str] = []
    while True:
        messages = [{"role": "system", "content": " ".join(facts)}, {"role": "user", "content": f"[{tag}] Hi"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if len(ids["input_ids"] if hasattr(ids, "keys") else ids) >= tokens:
            return messages
        facts.append(f"Fact {len(facts)} of {tag}: a server keeps the blocks it serves.")


def detached_sessions(gw: Gateway, s: Any) -> list[int]:
    return [gw.backend.server_info(w.peer_id)["sessions_detached"] for w in s.workers]


# ------------------------------------------------------------------------------------------------ tests


def test_background_task_shapes_are_one_offs() -> None:
    """Open WebUI's background requests are one-offs; its chat, a named conversation, a streamed reply or any
    request with a system prompt, earlier turns or tools is not."""
    messages = [{"role": "user", "content": "Hello"}]
    task = ChatCompletionRequest(**task_request("m", "title", messages))
    assert is_one_off(task, None)
    assert not is_one_off(task, "conversation-7")  # X-Session-Id or user: the client says it continues
    chat = ChatCompletionRequest(**{**open_webui_request(), "messages": messages})
    assert not is_one_off(chat, None)
    assert not is_one_off(ChatCompletionRequest(messages=messages, stream=True), None)
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert not is_one_off(ChatCompletionRequest(messages=system), None)
    turns = [*messages, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "More"}]
    assert not is_one_off(ChatCompletionRequest(messages=turns), None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_open_webui_background_requests_keep_the_conversations_cache(
    small_cache_gw: tuple[Gateway, Any],
) -> None:
    """Six turns of an Open WebUI chat, each followed by its follow-up, title and tags requests: every
    request 200; turns 2 to 6 resume the conversation's cache (``cached_tokens`` ≥ the tool preamble); the
    background requests' sessions are closed (each worker keeps the conversation's alone)."""
    gw, s = small_cache_gw
    preamble = preamble_tokens(gw)
    chat = OpenWebUIChat(gw)
    rows = chat.turn(QUESTIONS[0])
    kept_after_turn_1 = detached_sessions(gw, s)
    for question in QUESTIONS[1:]:
        rows += chat.turn(question)
    print_rows(rows, preamble)
    chats = [r for r in rows if r["kind"] == "chat"]
    assert chats[0]["usage"]["prompt_tokens"] > preamble
    for r in chats[1:]:
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= preamble, (r["turn"], cached, preamble)
    assert kept_after_turn_1 == [1, 1], "the background requests' sessions were kept"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resumed_conversation_outlives_newer_kept_sessions(small_cache_gw: tuple[Gateway, Any]) -> None:
    """The workers' own guard, for kept sessions the gateway cannot tell from a conversation's: conversation A
    (a ~700-token system prompt), resumed once, stays while B (another client's first turn, ~600 tokens: kept,
    never resumed) makes way for C — least recently used first, A would have gone. (A's system prompt, not
    the tools: a conversation with the replay's tool preamble would resume the replay's kept session.)"""
    gw, _ = small_cache_gw
    a = long_system_chat(gw, "A", 700)
    for question in QUESTIONS[1:3]:
        a.append({"role": "assistant", "content": stream_chat(gw, chat_body(gw, a, slice(0)))["text"]})
        a.append({"role": "user", "content": question})
    # A has been resumed once (its second turn) and is kept; B and C are other conversations' first turns
    b = stream_chat(gw, chat_body(gw, long_system_chat(gw, "B", 600), slice(0)))
    c = stream_chat(gw, chat_body(gw, long_system_chat(gw, "C", 600), slice(0)))
    last = stream_chat(gw, chat_body(gw, a, slice(0)))  # A's third turn
    sizes = [r["usage"]["prompt_tokens"] for r in (b, c, last)]
    cached = last["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"\nB, C, A's third turn: prompt tokens {sizes}; A's third turn cached {cached}")
    assert cached >= 700, "A's kept session was evicted"
