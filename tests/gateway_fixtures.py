"""Shared pieces of the gateway tests: one tiny model, one real uvicorn server over it, test backends, and
the helpers that read what a gateway answered.

The server is started once per test process (``shared_gateway()``) and stopped at exit; each test module
wraps it in a module fixture. It runs uvicorn in a thread on a pre-bound free port, serving
``LocalBackend`` over a random tiny Llama (``swarm_client.tiny_model``) wrapped in ``InstrumentedBackend``,
which counts sessions and can slow down or break steps on demand.

Readers: ``collect_stream`` (an SDK stream → text, finish reason and usage chunks per choice), ``chat``
(one greedy chat turn → text, usage), ``chat_prompt_ids`` + ``greedy_reference`` (what a gateway must answer,
computed with plain 🤗 ``transformers`` from the same checkpoint), ``assert_greedy`` (an answer is exactly it).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from gateway import BackgroundServer, GatewaySettings, LocalBackend, create_app
from swarm_client.errors import NoRouteError

#: every HTTP call in these tests has a deadline: a hung server fails a test instead of stalling CI
REQUEST_TIMEOUT_S = 30.0


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> Path:
    from swarm_client.tiny_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="swarmserve-gw-tiny-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make_tiny_model(root / "tiny-llama", family="llama", num_layers=4, seed=0)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir())


# ------------------------------------------------------------------------------ what the gateway must say


@functools.lru_cache(maxsize=4)
def _reference(model_dir: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(messages: list[dict], model_dir: str | Path | None = None) -> list[int]:
    """``messages`` rendered by the model's own chat template (generation prompt added), as token ids."""
    _, tokenizer = _reference(str(model_dir or tiny_model_dir()))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def text_prompt_ids(text: str, model_dir: str | Path | None = None) -> list[int]:
    """A text completion's prompt as the model's tokenizer encodes it."""
    _, tokenizer = _reference(str(model_dir or tiny_model_dir()))
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


@dataclass(frozen=True)
class Greedy:
    """A greedy continuation computed with 🤗 ``transformers``: what a gateway at temperature 0 must send."""

    token_ids: list[int]  # the EOS included when it ended on one (it counts as a completion token)
    logprobs: list[float]  # of every token but the EOS, as ``logprobs=True`` reports them
    text: str
    finish_reason: str


def greedy_reference(prompt_ids: list[int], max_tokens: int, model_dir: str | Path | None = None) -> Greedy:
    """Argmax decoding of ``prompt_ids`` with the local model (default: the tiny model), stopping at an EOS
    of the tokenizer or the generation config, as the gateway does."""
    model, tokenizer = _reference(str(model_dir or tiny_model_dir()))
    eos = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    eos |= set(configured) if isinstance(configured, list) else {configured}
    ids, out, logprobs = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(lp.argmax())
            ids.append(token)
            out.append(token)
            if token in eos:
                return Greedy(out, logprobs, tokenizer.decode(out[:-1], skip_special_tokens=True), "stop")
            logprobs.append(float(lp[token]))
    return Greedy(out, logprobs, tokenizer.decode(out, skip_special_tokens=True), "length")


#: the end-of-turn tokens of the tiny tokenizer and SmolLM2: banned, a reply runs to its ``max_tokens``
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


def eos_bias(model_dir: str | Path | None = None) -> dict[str, int]:
    """A ``logit_bias`` banning the model's end tokens: the reply is exactly ``max_tokens`` long (a session
    that grows to its full size, a stream long enough to outlive a kill)."""
    _, tokenizer = _reference(str(model_dir or tiny_model_dir()))
    return {str(tokenizer.convert_tokens_to_ids(t)): -100 for t in EOS_TOKENS}


def greedy_without_eos(
    prompt_ids: list[int], max_tokens: int, model_dir: str | Path | None = None
) -> tuple[list[int], str]:
    """The local model's greedy ids and text of exactly ``max_tokens`` tokens with the end tokens banned
    (what a gateway must stream under ``eos_bias``)."""
    model, tokenizer = _reference(str(model_dir or tiny_model_dir()))
    banned = [int(t) for t in eos_bias(model_dir)]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            suppress_tokens=banned, pad_token_id=banned[0],
        )  # fmt: skip
    ids = out[0, len(prompt_ids) :].tolist()
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def assert_greedy(
    response: Any, prompt_ids: list[int], max_tokens: int, model_dir: str | Path | None = None
) -> Greedy:
    """An SDK chat or text completion served at temperature 0 (one choice) is exactly ``greedy_reference``:
    the same text, finish reason, token counts, and — when it carries logprobs — the same logprobs."""
    ref = greedy_reference(prompt_ids, max_tokens, model_dir)
    (choice,) = response.choices
    message = getattr(choice, "message", None)
    text = message.content if message is not None else choice.text
    assert (text, choice.finish_reason) == (ref.text, ref.finish_reason)
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(ref.token_ids))
    content = getattr(choice.logprobs, "content", None) if choice.logprobs is not None else None
    if content is not None:
        got = [e.logprob for e in content]
        assert len(got) == len(ref.logprobs)
        assert max((abs(a - b) for a, b in zip(got, ref.logprobs, strict=True)), default=0.0) < 1e-4
    return ref


def collect_stream(stream: Any) -> tuple[dict[int, str], dict[int, str], list[Any]]:
    """An OpenAI SDK stream (chat or completions) → text per choice index, finish reason per choice index
    (asserting each is sent once), and the chunks without choices (``include_usage``'s)."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage_chunks = []
    for chunk in stream:
        if not chunk.choices:
            usage_chunks.append(chunk)
        for c in chunk.choices:
            delta = getattr(c, "delta", None)
            piece = delta.content if delta is not None else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                assert c.index not in finishes, "finish_reason sent twice"
                finishes[c.index] = c.finish_reason
    return texts, finishes, usage_chunks


class InstrumentedSession:
    def __init__(self, owner: InstrumentedBackend, inner: Any):
        self.owner = owner
        self.inner = inner
        self.closed = False

    @property
    def position(self) -> int:
        return self.inner.position

    @property
    def token_ids(self) -> list[int]:
        return self.inner.token_ids

    def step(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        owner = self.owner
        with owner.lock:
            if self.closed:
                owner.steps_after_close += 1
            owner.steps += 1
            steps = owner.steps
        if owner.fail_at_step is not None and steps >= owner.fail_at_step:
            raise RuntimeError("injected failure in step()")
        if owner.step_delay_s:
            time.sleep(owner.step_delay_s)
        return self.inner.step(token_ids, all_logits) if all_logits else self.inner.step(token_ids)

    def rollback(self, position: int) -> None:
        self.inner.rollback(position)

    def close(self) -> None:
        with self.owner.lock:
            if self.closed:
                return
            self.closed = True
            self.owner.open_sessions -= 1
        self.inner.close()


class InstrumentedBackend:
    """A ``ModelBackend`` around another one: counts sessions and steps; can delay or fail steps. With
    ``speculate``, its sessions pass ``all_logits`` on, so the engine may decode speculatively."""

    def __init__(self, inner: Any, speculate: bool = False):
        self.inner = inner
        self.supports_all_logits = speculate and bool(getattr(inner, "supports_all_logits", False))
        self.model_id = inner.model_id
        self.tokenizer = inner.tokenizer
        self.max_context = inner.max_context
        self.generation_config = getattr(inner, "generation_config", None)
        self.lock = threading.Lock()
        self.open_sessions = 0
        self.sessions_opened = 0
        self.steps = 0
        self.steps_after_close = 0
        self.step_delay_s = 0.0
        self.fail_at_step: int | None = None
        self.max_lengths: list[int] = []

    def open_session(self, max_length: int, session_id: str | None = None) -> InstrumentedSession:
        session = InstrumentedSession(self, self.inner.open_session(max_length, session_id))
        with self.lock:
            self.open_sessions += 1
            self.sessions_opened += 1
            self.max_lengths.append(max_length)
        return session

    def swarm_state(self) -> dict:
        return self.inner.swarm_state()

    def close(self) -> None:
        self.inner.close()

    @contextmanager
    def tweaked(self, **attrs: Any) -> Iterator[InstrumentedBackend]:
        """Set knobs (``step_delay_s``, ``fail_at_step``) for one test; counters restart from zero."""
        old = {k: getattr(self, k) for k in attrs}
        with self.lock:
            self.steps = 0
        for k, v in attrs.items():
            setattr(self, k, v)
        try:
            yield self
        finally:
            for k, v in old.items():
                setattr(self, k, v)

    def wait_all_closed(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.open_sessions == 0:
                return True
            time.sleep(0.02)
        return self.open_sessions == 0


class NoRouteBackend:
    """A swarm with blocks 2-3 missing: ``open_session`` raises ``NoRouteError``, ``/health`` is 503."""

    def __init__(self, tokenizer: Any, model_id: str = "tiny-llama"):
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.max_context = 2048

    def open_session(self, max_length: int, session_id: str | None = None) -> Any:
        raise NoRouteError("no server holds blocks 2-3", missing_blocks=[2, 3])

    def swarm_state(self) -> dict:
        return {"model": self.model_id, "num_blocks": 4, "missing_blocks": [2, 3]}

    def close(self) -> None:
        pass


class BrokenStateBackend(NoRouteBackend):
    """``swarm_state`` raises something unexpected: /v1/swarm must still answer in the error envelope."""

    def swarm_state(self) -> dict:
        raise ZeroDivisionError("a bug")


@dataclass
class Gateway:
    server: BackgroundServer
    backend: Any

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def model(self) -> str:
        return Path(self.backend.model_id).name

    def client(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("timeout", REQUEST_TIMEOUT_S)
        kw.setdefault("max_retries", 0)
        kw.setdefault("api_key", "x")
        return openai.OpenAI(base_url=self.server.base_url, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S)


#: a conversation of six turns, for the tests that continue chats
QUESTIONS = [
    "Tell me about the swarm.",
    "Which server holds the first blocks?",
    "And what happens when one of them leaves?",
    "How long are caches kept?",
    "Can another gateway continue this chat?",
    "Thanks, summarize it please.",
]


def conversation(tag: str) -> list[dict]:
    """A system message that makes each test's conversation its own (no prefix shared across tests)."""
    return [{"role": "system", "content": f"[{tag}] You answer questions about swarms."}]


def chat(gw: Gateway, messages: list[dict], max_tokens: int = 12, **kw: Any) -> tuple[str, Any]:
    """One greedy chat turn through the SDK: (the reply's text, usage)."""
    r = gw.client().chat.completions.create(
        model=gw.model, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )
    return r.choices[0].message.content or "", r.usage


def start_gateway(backend: Any, **settings: Any) -> Gateway:
    settings.setdefault("default_max_tokens", 32)
    server = BackgroundServer(create_app(backend, GatewaySettings(**settings))).start()
    return Gateway(server, backend)


_shared: dict[str, Gateway] = {}
_shared_lock = threading.Lock()


def shared_gateway() -> Gateway:
    """The process-wide gateway over the tiny model (started on first use, stopped at exit)."""
    with _shared_lock:
        if "gw" not in _shared:
            # decode steps of a tiny model are microseconds of math: intra-op threads only add contention
            torch.set_num_threads(1)
            backend = InstrumentedBackend(LocalBackend(tiny_model_dir()))
            gw = start_gateway(backend)
            _shared["gw"] = gw
            atexit.register(gw.server.stop)
        return _shared["gw"]


@contextmanager
def swarm_gateway(model_path: str, initial_peers: str, **settings: Any) -> Iterator[Gateway]:
    """A gateway over a real swarm (``SwarmBackend``, DHT view refreshed every second), closed on exit."""
    from gateway.backends.swarm import SwarmBackend

    backend = SwarmBackend(model_path, [initial_peers], update_period=1.0)
    gw = start_gateway(backend, **settings)
    try:
        yield gw
    finally:
        gw.server.stop()
        backend.close()


@contextmanager
def temporary_gateway(make_backend: Callable[[], Any], **settings: Any) -> Iterator[Gateway]:
    """A gateway of its own (not waiting for /health: these backends are unhealthy on purpose)."""
    backend = make_backend()
    server = BackgroundServer(create_app(backend, GatewaySettings(**settings))).start(wait_healthy=False)
    try:
        yield Gateway(server, backend)
    finally:
        server.stop()
