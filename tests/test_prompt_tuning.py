"""Prompt tuning through remote blocks: gradients w.r.t. soft prompts and deep prompts equal local autograd.

The reference for deep prompts is the local 🤗 model with a forward pre-hook on every decoder layer that adds
``prompts[i]`` to the first positions of its input — Petals' semantics, independent of our block code. The
swarm's span boundary sits mid-model, so every request's prompts are sliced across two servers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from swarm_client import AutoDistributedModelForCausalLM, InvalidInputError, runtime
from swarm_client.peer_calls import call_stream
from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow

ATOL = 1e-4
PREFIX = 3


@pytest.fixture(scope="module")
def dist(tiny_llama):
    with swarm(tiny_llama, ["0:2", "2:4"]) as s:
        model = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[s.initial_peers])
        model.requires_grad_(False)  # a frozen head: only the prompts train
        try:
            yield model
        finally:
            model.shutdown()


@contextlib.contextmanager
def deep_prompts_on(local, prompts: torch.Tensor, first_layer: int = 0) -> Iterator[None]:
    """Add ``prompts[i]`` to the input of local decoder layer ``first_layer + i`` (first positions)."""

    def make_hook(prompt: torch.Tensor):
        def hook(module, args, kwargs):
            if args:
                hidden = args[0]
                hidden = torch.cat([hidden[:, : prompt.shape[1]] + prompt, hidden[:, prompt.shape[1] :]], 1)
                return (hidden, *args[1:]), kwargs
            hidden = kwargs["hidden_states"]
            kwargs["hidden_states"] = torch.cat(
                [hidden[:, : prompt.shape[1]] + prompt, hidden[:, prompt.shape[1] :]], 1
            )
            return args, kwargs

        return hook

    layers = local.model.layers[first_layer : first_layer + prompts.shape[0]]
    handles = [
        layer.register_forward_pre_hook(make_hook(prompts[i]), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_soft_prompt_gradients_match_local(dist, local_llama) -> None:
    vocab, hidden = local_llama.config.vocab_size, local_llama.config.hidden_size
    ids, labels = _ids(vocab, 2, 6, 0), _ids(vocab, 2, 6, 1)
    init = torch.randn(1, PREFIX, hidden, generator=torch.Generator().manual_seed(2)) * 0.1

    def run(model) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = init.clone().requires_grad_(True)
        embeds = torch.cat([prompt.expand(2, -1, -1), model.get_input_embeddings()(ids)], 1)
        loss = _loss(model(inputs_embeds=embeds).logits[:, PREFIX:], labels)
        loss.backward()
        return loss.detach(), prompt.grad

    (loss, grad), (ref_loss, ref_grad) = run(dist), run(local_llama)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=0)
    assert grad.abs().max() > 1e-3  # a real gradient, not zeros matching zeros
    assert all(p.grad is None for p in dist.parameters())  # the frozen head got none


@pytest.mark.parametrize("prompt_batch", [1, 2], ids=["shared", "per-row"])
def test_deep_prompt_gradients_match_local(dist, local_llama, prompt_batch) -> None:
    cfg = local_llama.config
    ids, labels = _ids(cfg.vocab_size, 2, 7, 3), _ids(cfg.vocab_size, 2, 7, 4)
    shape = (cfg.num_hidden_layers, prompt_batch, PREFIX, cfg.hidden_size)
    init = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 0.1
    init_embeds = local_llama.get_input_embeddings()(ids).detach()

    prompts = init.clone().requires_grad_(True)
    embeds = init_embeds.clone().requires_grad_(True)
    loss = _loss(dist(inputs_embeds=embeds, prompts=prompts).logits, labels)
    loss.backward()

    ref_prompts = init.clone().requires_grad_(True)
    ref_embeds = init_embeds.clone().requires_grad_(True)
    with deep_prompts_on(local_llama, ref_prompts):
        ref_loss = _loss(local_llama(inputs_embeds=ref_embeds).logits, labels)
    ref_loss.backward()

    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(prompts.grad, ref_prompts.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(embeds.grad, ref_embeds.grad, atol=ATOL, rtol=0)
    assert prompts.grad[-1].abs().max() > 1e-3 and prompts.grad[0].abs().max() > 1e-3  # both servers'


def test_deep_prompts_on_a_slice_and_hidden_states(dist, local_llama) -> None:
    cfg = local_llama.config
    ids = _ids(cfg.vocab_size, 1, 6, 6)
    prompts = torch.randn(2, 1, PREFIX, cfg.hidden_size, generator=torch.Generator().manual_seed(7)) * 0.1
    with torch.no_grad():
        x = local_llama(ids, output_hidden_states=True).hidden_states[1]  # input of block 1
        out = dist.blocks[1:3](x, prompts=prompts)  # crosses the 0:2 | 2:4 boundary
        with deep_prompts_on(local_llama, prompts, first_layer=1):
            ref = local_llama(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(out, ref[3], atol=ATOL, rtol=0)

        full = torch.cat([torch.zeros(1, 1, PREFIX, cfg.hidden_size), prompts, torch.zeros_like(prompts[:1])])
        ours = dist(ids, prompts=full, output_hidden_states=True).hidden_states
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_bad_prompts_are_refused(dist, local_llama) -> None:
    cfg = local_llama.config
    x = torch.zeros(1, 4, cfg.hidden_size)
    with pytest.raises(InvalidInputError, match="deep prompts"):
        dist.blocks(x, prompts=torch.zeros(3, 1, 2, cfg.hidden_size))  # 4 blocks, 3 prompts
    with pytest.raises(InvalidInputError, match="deep prompts"):
        dist.blocks(x, prompts=torch.zeros(4, 1, 5, cfg.hidden_size))  # prefix longer than the input
    with pytest.raises(InvalidInputError, match="session"), dist.inference_session(max_length=8):
        dist(_ids(cfg.vocab_size, 1, 3, 0), prompts=torch.zeros(4, 1, 1, cfg.hidden_size))

    # the server checks too, for clients that skip the client-side check
    runtime.run(dist.manager.update())
    peer = next(p for p, span in dist.manager.spans.items() if span.start == 0)
    bad = torch.zeros(1, 1, 2, cfg.hidden_size)  # one block's prompts for a two-block request
    with pytest.raises(InvalidInputError, match="prompts of shape"):
        runtime.run(call_stream(dist.manager, peer, "rpc_forward", [x, bad], start_block=0, end_block=2))
    with pytest.raises(InvalidInputError, match="prompts of shape"):
        runtime.run(call_stream(dist.manager, peer, "rpc_backward", [x, x, bad], start_block=0, end_block=2))


def test_prompt_tuning_lowers_the_loss_with_a_frozen_model(dist, local_llama) -> None:
    cfg = local_llama.config
    ids = _ids(cfg.vocab_size, 2, 6, 8)
    prompts = torch.zeros(cfg.num_hidden_layers, 1, PREFIX, cfg.hidden_size, requires_grad=True)
    optimizer = torch.optim.Adam([prompts], lr=0.05)
    dist.train()
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = dist(ids, labels=ids, prompts=prompts).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    dist.eval()
    assert losses[-1] < losses[0]
    assert all(p.grad is None for p in dist.parameters())
