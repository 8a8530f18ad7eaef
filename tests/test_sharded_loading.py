"""Sharded checkpoints: which shards a span needs, per-shard Hub downloads under a disk limit, real workers.

The Hub is never contacted: a directory laid out like a 🤗 cache snapshot holds only the index (as
``resolve_model_path`` leaves it), and the two network calls (file size, file download) are replaced by
copies from a local "remote" directory.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swarm_client import hub_files, model_source
from swarm_client.families import get_family
from swarm_client.model_source import (
    DiskSpaceError,
    HubSnapshot,
    ensure_shards,
    hub_snapshot,
    parse_size,
    resolve_model_path,
)
from swarm_client.weights import INDEX_FILE, load_tensors, shard_files
from worker.compute import SpanRunner
from worker.loading import load_blocks, resolve_dtype

CPU = torch.device("cpu")
REPO = "acme/tiny-sharded"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_llama) -> pathlib.Path:
    """The tiny llama saved in ~100 KB shards (9 files), with its tokenizer."""
    out = tmp_path_factory.mktemp("sharded") / "tiny-sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(out, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (pathlib.Path(tiny_llama) / name).is_file():
            shutil.copy(pathlib.Path(tiny_llama) / name, out / name)
    return out


@pytest.fixture
def fake_hub(tmp_path, sharded, monkeypatch) -> tuple[pathlib.Path, list[str]]:
    """(a snapshot dir holding config + index only, the list of files 'downloaded' into it)."""
    snapshot = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for file in sharded.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, snapshot / file.name)
    downloaded: list[str] = []

    def size(snap: HubSnapshot, filename: str) -> int:
        assert (snap.repo_id, snap.revision) == (REPO, REVISION)
        return (sharded / filename).stat().st_size

    def download(snap: HubSnapshot, filename: str) -> str:
        assert snap.cache_dir == tmp_path / "hub"
        downloaded.append(filename)
        return shutil.copy(sharded / filename, snapshot / filename)

    monkeypatch.setattr(hub_files, "_hub_file_size", size)
    monkeypatch.setattr(hub_files, "_hub_download", download)
    monkeypatch.delenv(model_source.MAX_DISK_SPACE_ENV, raising=False)
    return snapshot, downloaded


def _weight_map(path: pathlib.Path) -> dict[str, str]:
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def _expected_shards(path: pathlib.Path, prefixes: list[str]) -> list[str]:
    return sorted({f for name, f in _weight_map(path).items() if name.startswith(tuple(prefixes))})


def test_shard_selection_reads_only_the_index(fake_hub) -> None:
    snapshot, downloaded = fake_hub
    assert not list(snapshot.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(snapshot)
    family = get_family(config)
    span = [family.layer_prefix(i) for i in (2, 3)]
    assert shard_files(snapshot, span) == _expected_shards(snapshot, span)
    all_files = set(_weight_map(snapshot).values())
    assert 0 < len(shard_files(snapshot, span)) < len(all_files)
    head = family.head_prefixes(config)
    assert set(shard_files(snapshot, head)) == {
        _weight_map(snapshot)[n] for n in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight")
    }
    assert downloaded == []


def test_hub_snapshot_is_read_from_the_cache_layout(fake_hub, tmp_path) -> None:
    snapshot, _ = fake_hub
    assert hub_snapshot(snapshot) == HubSnapshot(REPO, REVISION, tmp_path / "hub")
    assert hub_snapshot(tmp_path) is None


def test_worker_downloads_only_its_span_then_loads_it(fake_hub, sharded, local_llama) -> None:
    snapshot, downloaded = fake_hub
    config = AutoConfig.from_pretrained(snapshot)
    family = get_family(config)
    blocks = load_blocks(str(snapshot), config, family, 2, 4, torch.float32, CPU)
    span = [family.layer_prefix(i) for i in (2, 3)]
    assert sorted(downloaded) == _expected_shards(sharded, span)
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == sorted(downloaded)

    # the head (a client) then fetches only the shards it lacks
    head_tensors = load_tensors(snapshot, family.head_prefixes(config), progress=False)
    head = family.build_head(config, head_tensors)
    expected = set(_expected_shards(sharded, span)) | set(
        _expected_shards(sharded, family.head_prefixes(config))
    )
    assert set(downloaded) == expected and len(downloaded) == len(expected)

    ids = torch.randint(0, config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = local_llama(ids, output_hidden_states=True).hidden_states
        out = SpanRunner(blocks, torch.float32, CPU).forward(ref[2])  # input of block 2
        torch.testing.assert_close(head.final(out), local_llama(ids).logits, atol=1e-4, rtol=0)


def test_disk_limit_refuses_before_downloading(fake_hub, sharded, monkeypatch) -> None:
    snapshot, downloaded = fake_hub
    config = AutoConfig.from_pretrained(snapshot)
    span = [get_family(config).layer_prefix(i) for i in range(4)]
    needed = sum((sharded / f).stat().st_size for f in _expected_shards(sharded, span))
    with pytest.raises(DiskSpaceError, match="max disk space") as info:
        ensure_shards(snapshot, span, max_disk_space=needed - 1)
    assert "model-0000" in str(info.value) and "--max-disk-space" in str(info.value)
    assert downloaded == []
    monkeypatch.setenv(model_source.MAX_DISK_SPACE_ENV, "1KB")  # the environment sets the default
    with pytest.raises(DiskSpaceError):
        load_blocks(str(snapshot), config, get_family(config), 0, 1, torch.float32, CPU)
    assert downloaded == []
    assert ensure_shards(snapshot, span, max_disk_space=needed) == _expected_shards(sharded, span)
    assert len(downloaded) == len(_expected_shards(sharded, span))


def test_hub_resolution_fetches_metadata_only_for_sharded_repos(fake_hub, monkeypatch) -> None:
    snapshot, downloaded = fake_hub
    monkeypatch.setattr(model_source, "_snapshot_download", lambda repo_id, cache_dir: str(snapshot))
    assert resolve_model_path(REPO) == snapshot
    assert downloaded == []
    assert "*.safetensors" not in model_source.HUB_ALLOW_PATTERNS


def test_local_directories_are_never_fetched_into(sharded, tmp_path) -> None:
    broken = shutil.copytree(sharded, tmp_path / "copy")
    victim = _weight_map(broken)["model.layers.1.mlp.up_proj.weight"]
    (broken / victim).unlink()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_tensors(broken, ["model.layers.1."], progress=False)


def test_parse_size() -> None:
    assert parse_size("20GB") == 20 * 10**9
    assert parse_size("1.5 GiB") == int(1.5 * 2**30)
    assert parse_size("500mb") == 500 * 10**6
    assert parse_size("4096") == 4096 and parse_size(7) == 7
    with pytest.raises(ValueError, match="20GB"):
        parse_size("lots")


def test_dtype_auto_is_float32_on_cpu_bfloat16_on_gpu() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", CPU)


# ------------------------------------------------------------------------------------------ real workers
@pytest.fixture(scope="module")
def sharded_swarm(sharded):
    """Two float32 workers over the sharded checkpoint, plus one bfloat16 worker under its own DHT prefix."""
    from tests.swarm_fixtures import swarm

    with swarm(str(sharded), ["0:2", "2:4"]) as s:
        s.add_worker("--dtype", "bfloat16", "--dht-prefix", "tiny-bf16", blocks="0:4")
        yield s


@pytest.fixture
def wire(monkeypatch) -> list[tuple[str, str, int]]:
    """Every tensor this process (de)serializes: (direction, dtype, hivemind compression type)."""
    from swarm_client import protocol

    seen: list[tuple[str, str, int]] = []
    real_serialize, real_deserialize = protocol.serialize, protocol.deserialize

    def serialize(tensor, compression="none"):
        message = real_serialize(tensor, compression)
        seen.append(("sent", message.dtype, message.compression))
        return message

    def deserialize(message):
        seen.append(("received", message.dtype, message.compression))
        return real_deserialize(message)

    monkeypatch.setattr(protocol, "serialize", serialize)
    monkeypatch.setattr(protocol, "deserialize", deserialize)
    return seen


def _client(sharded, s, **options):
    from swarm_client import AutoDistributedModelForCausalLM

    return AutoDistributedModelForCausalLM.from_pretrained(
        str(sharded), initial_peers=[s.initial_peers], **options
    )


def _ids(vocab_size: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_sharded_checkpoint_served_by_real_workers(sharded, sharded_swarm, local_llama) -> None:
    model = _client(sharded, sharded_swarm)
    try:
        ids = _ids(local_llama.config.vocab_size, 2, 11, seed=0)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, local_llama(ids).logits, atol=1e-4, rtol=0)
        ids = ids[:1, :5]
        ours = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert ours.tolist() == local_llama.generate(ids, max_new_tokens=12, do_sample=False).tolist()
    finally:
        model.shutdown()


@pytest.mark.slow
def test_float16_compression_both_directions(sharded, sharded_swarm, local_llama, wire) -> None:
    from hivemind.proto import runtime_pb2

    model = _client(sharded, sharded_swarm, compression="float16")
    try:
        ids = _ids(local_llama.config.vocab_size, 2, 11, seed=1)
        wire.clear()
        with torch.no_grad():
            logits = model(ids).logits
        float16 = runtime_pb2.CompressionType.FLOAT16
        assert {c for d, _, c in wire if d == "sent"} == {float16}
        assert {c for d, _, c in wire if d == "received"} == {float16}
        ref = local_llama(ids).logits
        torch.testing.assert_close(logits, ref, atol=2e-2, rtol=0)  # float16 activations: ~1e-3 apart
        assert (logits - ref).abs().max() > 0  # it really went through float16
        # an inference session and backward work under compression too
        out = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 8)
        embeds = local_llama.get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeds).logits.sum().backward()
        assert embeds.grad is not None and torch.isfinite(embeds.grad).all()
    finally:
        model.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "float16"])
def test_bfloat16_server_gets_activations_in_its_dtype(
    sharded, sharded_swarm, local_llama, wire, compression
) -> None:
    model = _client(sharded, sharded_swarm, dht_prefix="tiny-bf16", compression=compression)
    try:
        ids = _ids(local_llama.config.vocab_size, 2, 9, seed=2)
        wire.clear()
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.dtype == torch.float32
        assert {dtype for _, dtype, _ in wire} == {"bfloat16"}  # both ways, 2 bytes a value
        # the same blocks run in bfloat16 in process: the wire adds nothing to bfloat16's own rounding
        config = AutoConfig.from_pretrained(sharded)
        blocks = load_blocks(str(sharded), config, get_family(config), 0, 4, torch.bfloat16, CPU)
        ref = model.head.final(SpanRunner(blocks, torch.bfloat16, CPU).forward(model.head.embed(ids)).float())
        torch.testing.assert_close(logits, ref, atol=1e-3, rtol=0)
        assert (logits - local_llama(ids).logits).abs().mean() < 0.1
        embeds = local_llama.get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeds).logits.sum().backward()
        assert embeds.grad is not None and embeds.grad.dtype == torch.float32
    finally:
        model.shutdown()
