"""Tiny random models: every family loads with plain transformers, offline, deterministically."""

from __future__ import annotations

import json
import pathlib
import unicodedata

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from swarm_client.tiny_model import FAMILIES, build_tokenizer, main, make_tiny_model

UNICODE_SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "Ünïcödé — “quotes” … ½ € ß",
    "日本語のテキスト、中文，한국어",
    "emoji 🤖🚀👩‍👩‍👧 and flags 🇫🇷",
    "math ∀x∈ℝ: x² ≥ 0; code: `print('hi')` {\"a\": [1, 2]}",
    "zero\u200bwidth and null \x00 byte and \x7f",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
]
NON_NFC = "cafe\u0301 and A\u030a"  # decomposed é and Å


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(root / family, family=family, num_layers=2) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_gives_finite_logits(tiny_models: dict[str, pathlib.Path], family: str) -> None:
    path = tiny_models[family]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == family
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.hidden_size <= 128
    assert model.config.num_hidden_layers == 2
    assert model.config.max_position_embeddings == 2048
    ids = tokenizer("The swarm runs a language model.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not degenerate


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_is_not_one_repeated_token(tiny_models: dict[str, pathlib.Path], family: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a robot."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 1


def test_family_specific_config(tiny_models: dict[str, pathlib.Path]) -> None:
    llama = AutoConfig.from_pretrained(tiny_models["llama"])
    assert (llama.num_attention_heads, llama.num_key_value_heads) == (4, 2)
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert llama.tie_word_embeddings is False
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"])
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    assert qwen2.config.tie_word_embeddings is True
    mixtral = AutoConfig.from_pretrained(tiny_models["mixtral"])
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    falcon = AutoConfig.from_pretrained(tiny_models["falcon"])
    assert falcon.new_decoder_architecture and falcon.parallel_attn and not falcon.alibi
    assert falcon.num_kv_heads == 2
    bloom = AutoConfig.from_pretrained(tiny_models["bloom"])
    assert bloom.model_type == "bloom" and bloom.n_head == 4


def test_biases_and_norms_are_not_trivial(tiny_models: dict[str, pathlib.Path]) -> None:
    """A server that skipped loading a bias or a norm weight must not match the reference by luck."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["bloom"])
    for name, param in model.named_parameters():
        if param.dim() == 1:
            constant = torch.zeros_like(param) if name.endswith("bias") else torch.ones_like(param)
            assert not torch.equal(param, constant), name


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_config_and_special_tokens(tiny_models: dict[str, pathlib.Path], family: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1
    generation = json.loads((tiny_models[family] / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == sorted([im_end, endoftext])
    assert generation["pad_token_id"] == endoftext


def test_same_seed_same_bytes(tmp_path: pathlib.Path) -> None:
    for family in ("llama", "mixtral"):
        a = make_tiny_model(tmp_path / f"a-{family}", family=family, num_layers=2, seed=7)
        b = make_tiny_model(tmp_path / f"b-{family}", family=family, num_layers=2, seed=7)
        c = make_tiny_model(tmp_path / f"c-{family}", family=family, num_layers=2, seed=8)
        weights = (a / "model.safetensors").read_bytes()
        assert weights == (b / "model.safetensors").read_bytes()
        assert weights != (c / "model.safetensors").read_bytes()
        assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_chat_template_renders_chatml(tiny_models: dict[str, pathlib.Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>system\nAnswer in English.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tokenizer.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips_unicode(tiny_models: dict[str, pathlib.Path], family: str) -> None:
    loaded = AutoTokenizer.from_pretrained(tiny_models[family])
    built = build_tokenizer(family)
    samples = UNICODE_SAMPLES + ([] if family == "qwen2" else [NON_NFC])
    for text in samples:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == built(text, add_special_tokens=False)["input_ids"], text
        assert loaded.decode(ids) == text
        assert all(0 <= i < len(loaded) for i in ids)
    if family == "qwen2":  # transformers forces Qwen2Tokenizer (NFC) on qwen2 checkpoints
        ids = loaded(NON_NFC, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == unicodedata.normalize("NFC", NON_NFC)


def test_tokenizer_is_deterministic_and_sized() -> None:
    a, b = build_tokenizer(), build_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert 1000 <= len(a) <= 2000
    words = a("Hello! How are you today?", add_special_tokens=False)["input_ids"]
    assert len(words) <= 8  # common words are single tokens


def test_cli_main(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main([str(tmp_path / "m"), "--family", "falcon", "--layers", "1", "--seed", "3", "--hidden", "32"])
        == 0
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["family"] == "falcon"
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.num_hidden_layers, config.hidden_size) == (1, 32)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--family", "gpt2"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--hidden", "256"])
