"""Incremental detokenization never emits half a character, and adds up to a one-shot decode."""

import pytest

from gateway.decode.detokenize import IncrementalDetokenizer, TokenVocab


@pytest.fixture(scope="module")
def tokenizer():
    from swarm_client.tiny_model import build_tokenizer

    return build_tokenizer("llama")


TEXTS = [
    "Plain ASCII text, with punctuation!",
    "Héllo wörld — naïve café",
    "日本語のテキスト and 中文",
    "emoji 😀🎉 flags 🇫🇷 and ZWJ 👩‍👩‍👧",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_and_never_hold_a_broken_char(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer("Prompt: ", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_an_incomplete_sequence_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer("😀", add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        pytest.skip("the emoji is a single token in this vocabulary")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[0]) == ""
    assert "\ufffd" in detok.flush()


def test_special_tokens_are_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = [detok.push(t) for t in tokenizer("ab", add_special_tokens=False)["input_ids"] + [im_end]]
    assert "".join(out) + detok.flush() == "ab"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_utf8_text(tokenizer, text):
    vocab = TokenVocab(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(bytes(vocab.bytes(t)) for t in ids) == text.encode()
    assert vocab.bytes(tokenizer.convert_tokens_to_ids("<|im_end|>")) == list(b"<|im_end|>")
