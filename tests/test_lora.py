"""LoRA adapters on a span of blocks (swarm_client/lora.py), in process: against 🤗 + PEFT, batched rows of
different adapters each equal their own run, and adapters that cannot be served refused with the reason."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from swarm_client.families import get_family
from swarm_client.lora import AdapterError, AdapterSpec, adapter_rows, adapters_of, parse_adapter_specs
from swarm_client.tiny_lora import make_random_lora
from swarm_client.tiny_model import main as tiny_model_main
from worker.cache import CacheManager
from worker.compute import SpanRunner, StepItem
from worker.loading import load_blocks

ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {name: str(make_random_lora(tiny_llama, root / name, seed=seed)) for name, seed in (("a1", 1), ("a2", 2))}


def _blocks(model_dir: str, adapters: dict[str, str], cpu_kernels: str = "torch", start: int = 0, end: int = 4):
    config = AutoConfig.from_pretrained(model_dir)
    specs = [AdapterSpec(name, path) for name, path in adapters.items()]
    return load_blocks(
        model_dir, config, get_family(config), start, end, torch.float32, torch.device("cpu"), cpu_kernels=cpu_kernels,
        adapters=specs,
    )  # fmt: skip


def _merged(model_dir: str, adapter: str | None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def _last_block_output(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings, the last block's output) of the 🤗 model on ``ids``."""
    got = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: got.update(out=o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        embeds = model.model.embed_tokens(ids)
        model(ids)
    hook.remove()
    return embeds, got["out"]


@pytest.mark.parametrize("cpu_kernels", ["torch", "panels"])
def test_span_with_adapter_equals_peft_merged(tiny_llama, adapters, cpu_kernels) -> None:
    blocks = _blocks(tiny_llama, adapters, cpu_kernels)
    assert all(adapters_of(b) == {"a1", "a2"} for b in blocks)
    ids = torch.tensor([[5, 17, 33, 2, 9, 11, 40]])
    for name in (None, "a1", "a2"):
        embeds, expected = _last_block_output(_merged(tiny_llama, adapters.get(name)), ids)
        x = embeds
        with torch.no_grad(), adapter_rows(name):
            for block in blocks:
                x = block(x, 0, None)
        torch.testing.assert_close(x, expected, atol=ATOL, rtol=0)
    # the adapters change the outputs (a random LoRA that did nothing would prove nothing)
    base = _last_block_output(_merged(tiny_llama, None), ids)[1]
    assert (expected - base).abs().max() > 0.1


def test_rows_of_different_adapters_batched_equal_each_alone(tiny_llama, adapters) -> None:
    config = AutoConfig.from_pretrained(tiny_llama)
    runner = SpanRunner(_blocks(tiny_llama, adapters), torch.float32, torch.device("cpu"))
    layout = get_family(config).cache_layout(config)
    names = ["a1", "a2", None, "a1"]

    def sessions():
        caches = CacheManager(100_000, 4, layout, torch.float32)
        out = []
        for n, name in enumerate(names):
            cache = caches.open(f"s{n}", 1, 64)
            cache.adapter = name
            caches.ensure_capacity(cache, 64)
            runner.inference_step(cache, torch.randn(1, 3 + n, 64, generator=torch.Generator().manual_seed(n)), 0)
            out.append(cache)
        return out

    alone, together = sessions(), sessions()
    for step in range(3):
        tokens = [
            torch.randn(1, 1 + i % 2, 64, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(4)
        ]
        expected = [runner.inference_step(c, t, c.position) for c, t in zip(alone, tokens, strict=True)]
        got = runner.inference_batch([StepItem(c, t, c.position) for c, t in zip(together, tokens, strict=True)])
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
    # and the adapters did differ: a1's and a2's rows on the same input are not equal
    same = torch.randn(1, 1, 64)
    outs = runner.inference_batch([StepItem(c, same, c.position) for c in together[:3]])
    assert (outs[0] - outs[1]).abs().max() > 1e-2 and (outs[0] - outs[2]).abs().max() > 1e-2


def test_forward_and_backward_run_the_adapter(tiny_llama, adapters) -> None:
    runner = SpanRunner(_blocks(tiny_llama, adapters, start=0, end=2), torch.float32, torch.device("cpu"))
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    base, tuned = runner.forward(x), runner.forward(x, adapter="a1")
    assert (base - tuned).abs().max() > 1e-2
    with torch.no_grad(), adapter_rows("a1"):
        y = x
        for block in runner.blocks:
            y = block(y, 0, None)
    torch.testing.assert_close(tuned, y, atol=1e-6, rtol=0)
    grad_out = torch.randn_like(x)
    g_base, _ = runner.backward(x, grad_out)
    g_tuned, _ = runner.backward(x, grad_out, adapter="a1")
    assert (g_base - g_tuned).abs().max() > 1e-3
    # the gradient of the adapter's function, checked against autograd on the same computation
    x0 = x.clone().requires_grad_(True)
    with adapter_rows("a1"):
        y = x0
        for block in runner.blocks:
            y = block(y, 0, None)
    (expected,) = torch.autograd.grad(y, x0, grad_out)
    torch.testing.assert_close(g_tuned, expected, atol=1e-5, rtol=0)
    assert not any(p.requires_grad for b in runner.blocks for p in b.parameters())  # servers never train


def test_only_the_spans_adapter_weights_are_read(tiny_llama, adapters) -> None:
    from swarm_client.lora import read_adapter

    family = get_family(AutoConfig.from_pretrained(tiny_llama))
    loaded = read_adapter(AdapterSpec("a1", adapters["a1"]), [family.layer_prefix(i) for i in (2, 3)])
    assert loaded.tensors and all(k.startswith(("model.layers.2.", "model.layers.3.")) for k in loaded.tensors)


def test_unservable_adapters_are_refused(tiny_llama, adapters, tmp_path: pathlib.Path) -> None:
    with pytest.raises(AdapterError, match="NAME=PATH"):
        parse_adapter_specs(["no-path"])
    with pytest.raises(AdapterError, match="invalid adapter name"):
        parse_adapter_specs(["bad name=/x"])
    with pytest.raises(AdapterError, match="unique"):
        parse_adapter_specs(["a=/x", "a=/y"])
    with pytest.raises(AdapterError, match="is not a directory"):
        _blocks(tiny_llama, {"x": str(tmp_path / "missing")})
    # an adapter of the LM head: the client runs the head, so servers cannot serve it
    head = tmp_path / "head"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    from peft import LoraConfig, get_peft_model

    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "lm_head"])).save_pretrained(str(head))
    with pytest.raises(AdapterError, match="outside the transformer blocks"):
        _blocks(tiny_llama, {"head": str(head)})
    dora = tmp_path / "dora"
    (dora).mkdir()
    config = json.loads((pathlib.Path(adapters["a1"]) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(
        (pathlib.Path(adapters["a1"]) / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match="use_dora"):
        _blocks(tiny_llama, {"dora": str(dora)})


def test_tiny_model_cli_writes_random_adapters(tmp_path: pathlib.Path, capsys) -> None:
    assert tiny_model_main([str(tmp_path / "m"), "--layers", "2", "--lora", "x", "--lora", "y"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(out["adapters"]) == ["x", "y"]
    for path in out["adapters"].values():
        assert (pathlib.Path(path) / "adapter_model.safetensors").is_file()
    a = (pathlib.Path(out["adapters"]["x"]) / "adapter_model.safetensors").read_bytes()
    b = (pathlib.Path(out["adapters"]["y"]) / "adapter_model.safetensors").read_bytes()
    assert a != b
