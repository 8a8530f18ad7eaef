"""The official OpenAI SDK against a real uvicorn gateway over a tiny random Llama (LocalBackend)."""

import pytest

from swarm_client.dht_records import PROTOCOL_VERSION
from tests.gateway_fixtures import (
    Gateway,
    assert_greedy,
    chat_prompt_ids,
    collect_stream,
    shared_gateway,
    tiny_tokenizer,
)

HELLO = [{"role": "user", "content": "Tell me about the swarm."}]


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return shared_gateway()


@pytest.fixture(scope="module")
def client(gw):
    return gw.client()


def test_chat_completion(gw, client):
    r = client.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == gw.model  # the directory's name: never the path (issue 35)
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    # text, finish reason and both token counts: what 🤗 transformers decodes greedily from the same prompt
    assert_greedy(r, chat_prompt_ids(HELLO), 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert gw.backend.wait_all_closed()


def test_full_model_id_and_developer_role_and_content_parts(gw, client):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more."}]},
    ]
    r = client.chat.completions.create(
        model=gw.backend.model_id, messages=messages, max_tokens=4, temperature=0, logprobs=True
    )
    assert r.model == gw.model  # the path still names the model; the answer shows its name only
    # the developer message is the system prompt and the parts are one user text: exactly this prompt (its
    # token count, and every logprob of the reply, which depends on each prompt token)
    rendered = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me\nmore."}]
    assert_greedy(r, chat_prompt_ids(rendered), 4)
    same = client.chat.completions.create(model=gw.model, messages=rendered, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == same.choices[0].message.content
    assert r.usage.prompt_tokens == same.usage.prompt_tokens
    without_developer = client.chat.completions.create(model=gw.model, messages=messages[1:], max_tokens=1)
    assert without_developer.usage.prompt_tokens < r.usage.prompt_tokens  # the system text was counted


def test_streamed_chat_equals_non_streamed_for_greedy(gw, client):
    kw = dict(model=gw.model, messages=HELLO, max_tokens=24, temperature=0, n=2)
    full = client.chat.completions.create(**kw)
    texts, finishes, usage_chunks = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert usage_chunks == []
    for c in full.choices:
        assert texts[c.index] == c.message.content
        assert finishes[c.index] == c.finish_reason
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy: n copies


def test_stream_include_usage(gw, client):
    kw = dict(model=gw.model, messages=HELLO, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    texts, finishes, usage_chunks = collect_stream(stream)
    (last,) = usage_chunks
    assert last.choices == []
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == full.usage.total_tokens
    assert texts[0] == full.choices[0].message.content


def test_stop_sequence_found_in_greedy_output(gw, client):
    kw = dict(model=gw.model, messages=HELLO, max_tokens=32, temperature=0)
    text = client.chat.completions.create(**kw).choices[0].message.content
    # a stop string from the middle of what the model writes anyway, free of replacement chars
    candidates = [text[i : i + 3] for i in range(len(text) // 3, len(text) - 3)]
    candidates = [s for s in candidates if "\ufffd" not in s and s.strip()]
    assert candidates, f"greedy output too short for this test: {text!r}"
    stop = candidates[0]
    expected = text[: text.find(stop)]

    r = client.chat.completions.create(stop=[stop, "never-in-output-xyz"], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == expected
    texts, finishes, _ = collect_stream(client.chat.completions.create(stop=stop, stream=True, **kw))
    assert texts[0] == expected
    assert finishes[0] == "stop"


def test_seeded_sampling_reproduces_and_seeds_differ(gw, client):
    kw = dict(model=gw.model, messages=HELLO, max_tokens=16, temperature=1.0, n=2)
    a = client.chat.completions.create(seed=7, **kw)
    b = client.chat.completions.create(seed=7, **kw)
    c = client.chat.completions.create(seed=8, **kw)
    texts = lambda r: [ch.message.content for ch in r.choices]  # noqa: E731
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    assert texts(a)[0] != texts(a)[1]  # each choice has its own seed
    streamed, _, _ = collect_stream(client.chat.completions.create(seed=7, stream=True, **kw))
    assert [streamed[0], streamed[1]] == texts(a)


def test_sampling_extras_are_accepted(gw, client):
    r = client.chat.completions.create(
        model=gw.model,
        messages=HELLO,
        max_completion_tokens=6,
        temperature=0.7,
        top_p=0.9,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={"5": 1.0},
        user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
        seed=1,
    )
    assert r.usage.completion_tokens <= 6


def test_logprobs_match_the_tokens(gw, client):
    r = client.chat.completions.create(
        model=gw.model, messages=HELLO, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    entries = choice.logprobs.content
    eos_counted = 1 if choice.finish_reason == "stop" else 0
    assert len(entries) == r.usage.completion_tokens - eos_counted
    specials = set(tiny_tokenizer().all_special_tokens)
    raw = b"".join(bytes(e.bytes) for e in entries if e.token not in specials)
    assert raw.decode("utf-8", errors="replace") == choice.message.content
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy picks the raw argmax
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )

    stream = client.chat.completions.create(
        model=gw.model,
        messages=HELLO,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completions_prompt_shapes(gw, client):
    tok = tiny_tokenizer()
    ids = tok("The swarm is", add_special_tokens=False)["input_ids"]
    kw = dict(model=gw.model, max_tokens=8, temperature=0)
    by_text = client.completions.create(prompt="The swarm is", **kw)
    assert by_text.object == "text_completion"
    assert by_text.id.startswith("cmpl-")
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)

    many = client.completions.create(prompt=["The swarm is", "A server"], n=2, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == by_text.choices[0].text
    ids2 = tok("A server", add_special_tokens=False)["input_ids"]
    assert many.usage.prompt_tokens == len(ids) + len(ids2)
    many_ids = client.completions.create(prompt=[ids, ids2], **kw)
    assert [c.text for c in many_ids.choices] == [many.choices[0].text, many.choices[2].text]


def test_completions_streaming_equals_non_streaming(gw, client):
    kw = dict(model=gw.model, prompt=["The swarm is", "A server"], max_tokens=16, temperature=0)
    full = client.completions.create(**kw)
    texts, finishes, usage_chunks = collect_stream(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert {c.index: c.text for c in full.choices} == texts
    assert {c.index: c.finish_reason for c in full.choices} == finishes
    assert usage_chunks[0].usage.completion_tokens == full.usage.completion_tokens


def test_completions_echo_and_legacy_logprobs(gw, client):
    prompt = "The swarm is"
    r = client.completions.create(
        model=gw.model, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2
    )
    plain = client.completions.create(model=gw.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # the generated part is scored the same way with and without echo
    # scored token by token vs in one prefill: the same float32 math in other shapes (the quality bar's 1e-4)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    for tok, top, val in zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True):
        assert top[tok] == pytest.approx(val)
        assert 2 <= len(top) <= 3


def test_models_endpoints(gw, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [gw.model]
    assert client.models.retrieve(gw.backend.model_id).id == gw.model
    assert client.models.retrieve(gw.model).owned_by == "swarmserve"


def test_health_and_swarm(gw):
    with gw.http() as http:
        health = http.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        swarm = http.get("/v1/swarm").json()
        assert swarm["num_blocks"] == 4
        assert swarm["missing_blocks"] == []


def test_sessions_are_sized_to_the_request_and_all_closed(gw, client):
    gw.backend.max_lengths.clear()
    r = client.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=5, n=3)
    assert gw.backend.max_lengths == [r.usage.prompt_tokens + 5] * 3
    default = client.chat.completions.create(model=gw.model, messages=HELLO)  # default_max_tokens=32
    assert default.usage.completion_tokens <= 32
    assert gw.backend.max_lengths[-1] == r.usage.prompt_tokens + 32
    assert gw.backend.wait_all_closed()
    assert gw.backend.steps_after_close == 0


def test_system_fingerprint_names_release_protocol_and_model(gw, client):
    chat = client.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=2)
    stream = list(client.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=2, stream=True))
    completion = client.completions.create(model=gw.model, prompt="Hi", max_tokens=2)
    fingerprint = chat.system_fingerprint
    assert fingerprint.startswith("swarmserve-") and f"-p{PROTOCOL_VERSION}-" in fingerprint
    assert fingerprint.endswith(gw.model)
    assert {c.system_fingerprint for c in stream} == {fingerprint} == {completion.system_fingerprint}


def test_unknown_fields_are_named_in_a_header(gw):
    body = {"model": gw.model, "messages": HELLO, "max_tokens": 2, "temprature": 0.5, "ünïcode name": 1}
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json=body)
        plain = http.post("/v1/completions", json={"model": gw.model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    assert r.headers["x-swarmserve-ignored-fields"] == "temprature,%C3%BCn%C3%AFcode%20name"
    assert "x-swarmserve-ignored-fields" not in plain.headers
