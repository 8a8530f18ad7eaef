"""Gateway replicas as one service (issue 39): two real ``swarmserve gateway`` processes on one real Redis and
one ``SWARMSERVE_SESSION_SECRET``, behind a real HAProxy (round robin per request, health checks on
``/health``: tests/load_balancer.py), over a real multi-process swarm of the tiny Llama (a DHT and two workers,
blocks 0:2 and 2:4). The client is the official ``openai`` SDK pointed at HAProxy; every answer says which
replica served it (``x-swarm-replica``), and every text is the local 🤗 model's greedy text.

- A chat alternates replicas every turn, and every turn after the first resumes the servers' caches that the
  other replica's previous turn left (``cached_tokens > 0``).
- ``previous_response_id`` resolves on either replica.
- SIGKILL of a replica (its process group: a machine dying) while it streams fails only its own stream: the
  other replica's concurrent stream completes exactly, the client's retry through HAProxy succeeds on the
  survivor with the exact text, a conversation whose last turn the dead replica served continues with its
  caches, and so does the retried one.

Needs ``haproxy`` and ``redis-server`` on PATH (skipped without them, failed under ``SWARMSERVE_REQUIRE``).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import torch

from swarm_client.capabilities import SECRET_ENV
from swarmserve.processes import ChildProcess, child_env
from tests.conftest import RedisServer, free_port, require_or_skip
from tests.gateway_fixtures import (
    QUESTIONS,
    assert_greedy,
    chat_prompt_ids,
    conversation,
    eos_bias,
    greedy_reference,
    greedy_without_eos,
)
from tests.load_balancer import HAProxy

REPLICA = "x-swarm-replica"
NAMES = ("gw-a", "gw-b")
READY = re.compile(r"swarmserve gateway ready: .*OpenAI base URL: (http://\S+/v1)")
#: the long streams of the kill test: EOS banned, so they run this long
LONG = 300
#: the killed conversation's name
K_USER = "lb-killed-conversation"


@dataclass
class Service:
    lb: HAProxy
    gateways: dict[str, ChildProcess]
    model_dir: str
    #: what each test saw, printed at the end of the module (docs/operations.md quotes it)
    figures: dict[str, Any] = field(default_factory=dict)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.lb.url}/v1", api_key="x", timeout=60, max_retries=0)


def _need_haproxy() -> None:
    if HAProxy.available():
        return
    require_or_skip("haproxy", "haproxy is not on PATH (Debian: apt-get install -y haproxy)")


@pytest.fixture(scope="module")
def service(tiny_llama: str, own_redis: RedisServer) -> Iterator[Service]:
    from tests.swarm_fixtures import OFFLINE, swarm

    _need_haproxy()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the local references: on 2 loaded cores, 2 threads made them 10x slower
    env = child_env(1, {**OFFLINE, SECRET_ENV: secrets.token_hex(16)})  # one secret: one service
    ports = {name: free_port() for name in NAMES}
    try:
        with swarm(tiny_llama, ["0:2", "2:4"], "--throughput", "1000") as s, contextlib.ExitStack() as stack:
            gateways = {}
            for name in NAMES:
                args = ["gateway", "--model", tiny_llama, "--initial-peers", s.initial_peers, "--redis-url",
                        own_redis.url, "--port", str(ports[name]), "--replica-id", name]  # fmt: skip
                gateways[name] = ChildProcess.spawn(f"gateway {name}", args, env)
                stack.callback(gateways[name].stop)
            for gw in gateways.values():
                gw.wait_for(READY, 180)
            lb = HAProxy(free_port(), free_port(), {n: f"127.0.0.1:{p}" for n, p in ports.items()}).start()
            stack.callback(lb.stop)
            lb.wait_states(dict.fromkeys(NAMES, "UP"), 60)
            service = Service(lb, gateways, tiny_llama)
            yield service
            print("figures:", service.figures)
    finally:
        torch.set_num_threads(threads)


def _turn(client: openai.OpenAI, model_dir: str, messages: list[dict], max_tokens: int = 12, **kw: Any) -> tuple:
    """One greedy chat turn through HAProxy, checked against the local model: (the replica, the completion)."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )
    reply = raw.parse()
    assert_greedy(reply, chat_prompt_ids(messages, model_dir), max_tokens, model_dir)
    return raw.headers[REPLICA], reply


def _cached(usage: Any) -> int:
    return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_chat_alternates_replicas_and_every_later_turn_reuses_the_caches(service: Service) -> None:
    client, messages, rows = service.client(), conversation("lb-alternate"), []
    for question in QUESTIONS[:4]:
        messages.append({"role": "user", "content": question})
        replica, reply = _turn(client, service.model_dir, messages)
        rows.append((replica, reply.usage.prompt_tokens, _cached(reply.usage)))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    print("turn: replica, prompt tokens, cached tokens:", rows)
    service.figures["alternation"] = rows
    replicas = [r for r, _, _ in rows]
    assert set(replicas) == set(NAMES) and all(a != b for a, b in zip(replicas, replicas[1:], strict=False))
    assert all(cached > 0 for _, _, cached in rows[1:]), rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_previous_response_id_resolves_on_either_replica(service: Service) -> None:
    client, seen, messages, previous = service.client(), [], [], None
    for question in QUESTIONS[:3]:
        raw = client.responses.with_raw_response.create(
            model="tiny-llama", input=question, previous_response_id=previous, max_output_tokens=8, temperature=0
        )
        response = raw.parse()
        messages.append({"role": "user", "content": question})
        prompt = chat_prompt_ids(messages, service.model_dir)
        ref = greedy_reference(prompt, 8, service.model_dir)
        # the replica rendered the whole conversation, stored by the other one, and reused its caches
        assert (response.output_text, response.usage.input_tokens) == (ref.text, len(prompt))
        assert response.previous_response_id == previous
        seen.append((raw.headers[REPLICA], response.usage.input_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": response.output_text})
        previous = response.id
    print("responses turn: replica, cached tokens:", seen)
    service.figures["responses"] = seen
    assert all(a[0] != b[0] for a, b in zip(seen, seen[1:], strict=False)) and all(c > 0 for _, c in seen[1:])
    # either replica reads it (the next two requests land on different replicas)
    read_by = {}
    for _ in NAMES:
        raw = client.responses.with_raw_response.retrieve(previous)
        read_by[raw.headers[REPLICA]] = raw.parse().output_text
    assert read_by.keys() == set(NAMES) and set(read_by.values()) == {messages[-1]["content"]}


@dataclass
class Stream:
    """A long streamed turn through HAProxy: its replica, then what it read and how it ended."""

    replica: str
    chunks: Any
    text: str = ""
    finish: str | None = None
    usage: Any = None
    error: BaseException | None = None
    ended_at: float = 0.0

    @classmethod
    def open(cls, client: openai.OpenAI, messages: list[dict], bias: dict[str, int], **kw: Any) -> Stream:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=messages, max_tokens=LONG, temperature=0, stream=True, logit_bias=bias,
            stream_options={"include_usage": True}, **kw,
        )  # fmt: skip
        return cls(raw.headers[REPLICA], iter(raw.parse()))

    def read(self, until_chars: int | None = None) -> Stream:
        """Read to the end (or until ``until_chars`` of text); an error ends it and is kept."""
        try:
            for chunk in self.chunks:
                self.usage = chunk.usage or self.usage
                for choice in chunk.choices:
                    self.text += choice.delta.content or ""
                    self.finish = choice.finish_reason or self.finish
                if until_chars is not None and len(self.text) >= until_chars:
                    return self
        except (httpx.HTTPError, openai.APIError) as exc:
            self.error = exc
        self.ended_at = time.monotonic()
        return self


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killing_a_replica_mid_stream_fails_only_its_streams(service: Service) -> None:
    client, model_dir, bias = service.client(), service.model_dir, eos_bias(service.model_dir)
    # requests 1-4 alternate: M's first turn and the stream to kill go to one replica (the victim), K's first
    # turn and the concurrent stream to the other (the survivor)
    m = conversation("lb-dead-writer") + [{"role": "user", "content": QUESTIONS[0]}]
    m_replica, m_reply = _turn(client, model_dir, m)
    m.append({"role": "assistant", "content": m_reply.choices[0].message.content})
    # K names itself (``user``), as a chat app names its conversations: its record is found by that name, not by
    # its prompt's prefix (the tiny random model's text does not re-encode to the tokens it came from)
    k = conversation("lb-killed") + [{"role": "user", "content": QUESTIONS[1]}]
    k_replica, k_reply = _turn(client, model_dir, k, user=K_USER)
    k += [{"role": "assistant", "content": k_reply.choices[0].message.content},
          {"role": "user", "content": "Tell me a long story."}]  # fmt: skip
    other = conversation("lb-survivor") + [{"role": "user", "content": "Tell me another long story."}]
    expected = {}
    for name, chat in (("k", k), ("other", other)):
        expected[name] = greedy_without_eos(chat_prompt_ids(chat, model_dir), LONG, model_dir)[1]

    doomed = Stream.open(client, k, bias, user=K_USER)
    survivor = Stream.open(client, other, bias)
    assert (doomed.replica, survivor.replica) == (m_replica, k_replica) and doomed.replica != survivor.replica
    victim, alive = doomed.replica, survivor.replica
    finished = threading.Thread(target=survivor.read, daemon=True)
    finished.start()
    doomed.read(until_chars=40)
    killed_at = time.monotonic()
    service.gateways[victim].kill()  # SIGKILL of its process group: the gateway and its p2pd
    doomed.read()
    # the client retries the cut request at once, through HAProxy, which has not seen the replica die yet: the
    # connection it tries first is refused and it sends the request to the survivor instead
    state_at_retry = service.lb.states()[victim]
    retry = Stream.open(client, k, bias, user=K_USER).read()
    retried_at = time.monotonic()
    finished.join(120)
    assert not finished.is_alive()
    service.lb.wait_states({victim: "DOWN"}, 30)
    victim_stats = service.lb.stats()[victim]  # when HAProxy saw it die, and what it did meanwhile
    down_after = time.monotonic() - killed_at - int(victim_stats["lastchg"])

    # only the victim's stream failed: cut (an error, or an end without a finish reason), its text a prefix
    assert doomed.error is not None or doomed.finish is None, doomed
    assert doomed.text != expected["k"] and expected["k"].startswith(doomed.text)
    assert (survivor.error, survivor.finish, survivor.text) == (None, "length", expected["other"])
    assert service.lb.states()[alive] == "UP"
    if state_at_retry.startswith("UP"):  # HAProxy had not noticed yet: the retry's first connection was refused
        assert int(victim_stats["wredis"]) >= 1, victim_stats
    # the retry: on the survivor, exactly
    assert (retry.replica, retry.error, retry.finish, retry.text) == (alive, None, "length", expected["k"])
    # a conversation whose last turn the dead replica served goes on with the servers' caches it left ...
    m.append({"role": "user", "content": QUESTIONS[1]})
    m_next, m_reply = _turn(client, model_dir, m)
    # ... and so does the retried one, after its retry
    k += [{"role": "assistant", "content": expected["k"]}, {"role": "user", "content": QUESTIONS[2]}]
    k_next, k_reply = _turn(client, model_dir, k, user=K_USER)
    figures = {
        "victim": victim,
        "doomed_chars_before_kill": 40,
        "doomed_error": type(doomed.error).__name__ if doomed.error else None,
        "doomed_failed_after_s": round(doomed.ended_at - killed_at, 2),
        "survivor_ended_after_kill_s": round(survivor.ended_at - killed_at, 2),
        "haproxy_down_after_s": round(down_after),
        "victim_state_at_retry": state_at_retry,
        "haproxy_redispatched": int(victim_stats["wredis"]),
        "retry_replica": retry.replica,
        "retry_done_after_kill_s": round(retried_at - killed_at, 2),
        "retry_cached": _cached(retry.usage),
        "dead_writers_conversation": (m_next, m_reply.usage.prompt_tokens, _cached(m_reply.usage)),
        "retried_conversation_next": (k_next, k_reply.usage.prompt_tokens, _cached(k_reply.usage)),
    }
    print("kill:", figures)
    service.figures["kill"] = figures
    assert m_next == k_next == alive
    assert _cached(m_reply.usage) > 0 and _cached(k_reply.usage) > 0


def test_every_answer_names_its_replica() -> None:
    """``x-swarm-replica`` on every response of a gateway, errors included, from ``--replica-id``."""
    from gateway import LocalBackend
    from swarmserve.cli import build_parser
    from tests.gateway_fixtures import temporary_gateway, tiny_model_dir

    argv = ["gateway", "--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--replica-id", "eu-1"]
    assert build_parser().parse_args(argv).replica_id == "eu-1"

    with temporary_gateway(lambda: LocalBackend(tiny_model_dir()), replica_id="eu-1 gw/2") as gw, gw.http() as http:
        for response in (http.get("/health"), http.get("/v1/models"), http.get("/nothing"),
                         http.post("/v1/chat/completions", content=b"{")):  # fmt: skip
            assert response.headers[REPLICA] == "eu-1_gw_2", response  # made a safe header value


def test_an_unnamed_replica_shows_a_digest_not_its_host_and_pid() -> None:
    """Without ``--replica-id`` the header tells replicas apart by a digest of the default name (host, pid, a
    random suffix): the internet learns neither the host's name nor the gateway's process id."""
    import os
    import socket

    from gateway import LocalBackend
    from tests.gateway_fixtures import temporary_gateway, tiny_model_dir

    with temporary_gateway(lambda: LocalBackend(tiny_model_dir())) as gw, gw.http() as http:
        shown = {http.get("/health").headers[REPLICA], http.get("/v1/models").headers[REPLICA]}
    (name,) = shown
    assert re.fullmatch(r"replica-[0-9a-f]{12}", name), name
    assert socket.gethostname() not in name and str(os.getpid()) not in name
