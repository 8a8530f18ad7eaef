"""KV-cache budget: growth, eviction of detached sessions, TTL, errors."""

import time

import pytest
import torch

from swarm_client.errors import (
    CacheExhaustedError,
    InvalidInputError,
    ServerBusyError,
    SessionNotFoundError,
    SessionTooLongError,
)
from swarm_client.families import CacheLayout
from worker.cache import MIN_CAPACITY, CacheManager

LAYOUT = CacheLayout(num_kv_heads=2, head_dim=4)


def manager(tokens=1024, ttl=60.0):
    return CacheManager(tokens, num_layers=2, layout=LAYOUT, dtype=torch.float32, session_ttl=ttl)


def test_cache_grows_on_demand_and_keeps_prefix():
    m = manager()
    c = m.open("a", batch_size=1, max_length=500)
    assert c.capacity == MIN_CAPACITY and m.used_slots == MIN_CAPACITY
    c.kv[0][0][:, :, :10] = 7.0
    c.position = 10
    m.ensure_capacity(c, 200)
    assert c.capacity == 200 and m.used_slots == 200
    assert torch.all(c.kv[0][0][:, :, :10] == 7.0)
    m.free("a")
    assert m.used_slots == 0


def test_session_larger_than_budget_is_rejected_with_advice():
    m = manager(tokens=100)
    with pytest.raises(SessionTooLongError, match="max_length") as e:
        m.open("a", batch_size=2, max_length=80)
    assert e.value.details == {"cache_tokens_total": 100}


def test_full_cache_raises_and_detached_sessions_are_evicted_lru():
    m = manager(tokens=256)
    a = m.open("a", 1, 128)
    m.ensure_capacity(a, 128)
    b = m.open("b", 1, 128)
    m.ensure_capacity(b, 128)
    with pytest.raises(CacheExhaustedError):
        m.open("c", 1, 64)  # both attached sessions hold the whole budget
    assert "c" not in m.sessions and m.used_slots == 256
    m.release("a", keep=True)
    m.release("b", keep=True)
    d = m.open("d", 1, 200)
    m.ensure_capacity(d, 200)
    assert "a" not in m.sessions  # least recently used detached session went first


def test_no_room_and_nothing_to_evict():
    m = manager(tokens=128)
    a = m.open("a", 1, 128)
    m.ensure_capacity(a, 128)
    with pytest.raises(ServerBusyError, match="cache is full") as e:
        m.open("b", 1, 64)
    assert isinstance(e.value, CacheExhaustedError)  # a kind of it: older clients still understand it
    assert e.value.details == {"reason": "cache", "cache_tokens_left": 0, "sessions_left": m.max_sessions - 2}


def test_resume_may_raise_the_cap_within_the_budget():
    m = manager(tokens=256)
    a = m.open("a", 1, 64)
    m.release("a", keep=True)
    with pytest.raises(SessionTooLongError):
        m.resume("a", max_length=1000)
    assert not m.sessions["a"].attached  # still resumable
    assert m.resume("a", max_length=200) is a and a.max_length == 200
    m.ensure_capacity(a, 200)
    assert a.capacity == 200


def test_resume_detached_and_errors():
    m = manager(ttl=0.2)
    m.open("a", 1, 100)
    with pytest.raises(InvalidInputError):
        m.resume("a")  # still attached to its stream
    m.release("a", keep=True)
    assert m.resume("a").attached
    m.release("a", keep=True)
    time.sleep(0.3)
    with pytest.raises(SessionNotFoundError):
        m.resume("a")
    assert m.used_slots == 0


def test_release_without_keep_frees():
    m = manager()
    m.open("a", 1, 100)
    m.release("a", keep=False)
    assert m.sessions == {} and m.used_slots == 0


def test_duplicate_session_id_rejected():
    m = manager()
    m.open("a", 1, 10)
    with pytest.raises(InvalidInputError, match="already exists"):
        m.open("a", 1, 10)


def test_kept_sessions_never_resumed_go_before_resumed_ones():
    """A conversation's session, resumed once, outlives kept one-offs finished after it (a chat UI's title and
    tag requests); among sessions of one kind the least recently used goes first (worker.cache_policy)."""
    m = manager(tokens=256)
    chat = m.open("chat", 1, 96)
    m.ensure_capacity(chat, 96)
    m.release("chat", keep=True)
    m.resume("chat")  # the conversation's second turn
    m.release("chat", keep=True)
    for name in ("title", "tags"):
        one_off = m.open(name, 1, 64)
        m.ensure_capacity(one_off, 64)
        m.release(name, keep=True)
    assert m.used_slots == 96 + 64 + 64
    follow_up = m.open("follow-up", 1, 96)
    m.ensure_capacity(follow_up, 96)  # 64 more slots: the least recently used one-off goes
    assert set(m.sessions) == {"chat", "tags", "follow-up"}
    m.release("follow-up", keep=True)
    big = m.open("big", 1, 160)
    m.ensure_capacity(big, 160)  # every one-off goes before the conversation does
    assert set(m.sessions) == {"chat", "big"}
    assert m.sessions["chat"].resumes == 1
    m.release("big", keep=True)
    m.ensure_capacity(m.open("bigger", 1, 256), 256)  # and the conversation goes when nothing else is left
    assert set(m.sessions) == {"bigger"}
