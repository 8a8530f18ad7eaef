"""Selective safetensors loading: only the tensors (and shards) a block or head needs."""

from __future__ import annotations

import json
import pathlib

import pytest
import safetensors
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swarm_client.tiny_model import FAMILIES, make_tiny_model
from swarm_client.weights import (
    INDEX_FILE,
    TensorNotFoundError,
    layer_prefix,
    list_tensor_names,
    load_tensors,
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("w") / "llama", family="llama", num_layers=4)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory, llama_dir: pathlib.Path) -> pathlib.Path:
    out = tmp_path_factory.mktemp("w") / "sharded"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(out, max_shard_size="100KB")
    return out


def _state_dict(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def test_loads_exactly_one_layer(llama_dir: pathlib.Path) -> None:
    config = AutoConfig.from_pretrained(llama_dir)
    prefix = layer_prefix(config, 2)
    assert prefix == "model.layers.2."
    tensors = load_tensors(llama_dir, [prefix], progress=False)
    expected = [n for n in list_tensor_names(llama_dir) if n.startswith("model.layers.2.")]
    assert sorted(tensors) == expected
    assert len(expected) == 9  # q, k, v, o, gate, up, down, 2 norms
    reference = _state_dict(llama_dir)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, reference[name]), name


def test_several_prefixes_and_dtype(llama_dir: pathlib.Path) -> None:
    tensors = load_tensors(
        llama_dir, ["model.embed_tokens.", "model.norm.", "lm_head."], dtype=torch.bfloat16, progress=False
    )
    assert sorted(tensors) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_progress_bar_does_not_break(llama_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = load_tensors(llama_dir, ["model.layers.0."], progress=True)
    assert len(tensors) == 9
    capsys.readouterr()


def test_tied_head_prefix_missing_is_fine(tmp_path: pathlib.Path) -> None:
    qwen2 = make_tiny_model(tmp_path / "qwen2", family="qwen2", num_layers=1)
    names = list_tensor_names(qwen2)
    assert "lm_head.weight" not in names  # tied: stored once, as the embedding
    tensors = load_tensors(qwen2, ["model.embed_tokens.", "lm_head."], progress=False)
    assert list(tensors) == ["model.embed_tokens.weight"]


def test_sharded_checkpoint_opens_only_needed_shards(
    sharded_dir: pathlib.Path, llama_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = json.loads((sharded_dir / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 2, "the fixture should be split into several shards"
    assert list_tensor_names(sharded_dir) == list_tensor_names(llama_dir)

    opened: list[str] = []
    real_safe_open = safetensors.safe_open

    def spy(path: str, *args: object, **kwargs: object) -> object:
        opened.append(pathlib.Path(path).name)
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    tensors = load_tensors(sharded_dir, ["model.layers.3."], progress=False)
    assert sorted(tensors) == sorted(n for n in index if n.startswith("model.layers.3."))
    assert set(opened) == {index[n] for n in tensors}
    assert len(set(opened)) < len(set(index.values()))
    reference = _state_dict(llama_dir)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, reference[name]), name


def test_missing_shard_is_a_clear_error(sharded_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    for file in sharded_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    victim = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (broken / victim).unlink()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_tensors(broken, ["model.layers.1."], progress=False)


def test_no_match_is_a_key_error(llama_dir: pathlib.Path) -> None:
    with pytest.raises(KeyError) as info:
        load_tensors(llama_dir, ["model.layers.99."], progress=False)
    assert isinstance(info.value, TensorNotFoundError)
    assert "model.layers.99." in str(info.value) and "layer_prefix" in str(info.value)
    assert load_tensors(llama_dir, ["model.layers.99."], progress=False, missing_ok=True) == {}


def test_missing_directory_and_non_safetensors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="tiny-model"):
        load_tensors(tmp_path / "nope", ["model."])
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="save_pretrained") as info:
        list_tensor_names(legacy)
    assert "pytorch_model.bin" in str(info.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_prefix_matches_saved_keys(tmp_path: pathlib.Path, family: str) -> None:
    path = make_tiny_model(tmp_path / family, family=family, num_layers=2, hidden_size=32)
    config = AutoConfig.from_pretrained(path)
    names = list_tensor_names(path)
    for index in range(2):
        prefix = layer_prefix(config, index)
        assert prefix.endswith(f".{index}.")
        block = [n for n in names if n.startswith(prefix)]
        assert block, (family, prefix)
    # every tensor is either in a block or in the head
    in_blocks = {n for n in names for i in range(2) if n.startswith(layer_prefix(config, i))}
    head = sorted(set(names) - in_blocks)
    assert all("layers" not in n and ".h." not in n for n in head), head
    as_dict = json.loads((path / "config.json").read_text())
    assert layer_prefix(as_dict, 1) == layer_prefix(config, 1)


def test_layer_prefix_errors(llama_dir: pathlib.Path) -> None:
    config = AutoConfig.from_pretrained(llama_dir)
    with pytest.raises(IndexError, match="4 blocks"):
        layer_prefix(config, 4)
    with pytest.raises(IndexError):
        layer_prefix(config, -1)
    with pytest.raises(ValueError, match="gpt2"):
        layer_prefix({"model_type": "gpt2", "n_layer": 2}, 0)
