"""``DistributedModelForCausalLM.forward`` with ``inputs_embeds`` applies the family's input transform.

BLOOM's 🤗 model layer-normalizes ``inputs_embeds`` whether it computed them or was given them, so
``model(inputs_embeds=model.get_input_embeddings()(ids))`` must equal ``model(ids)``. In process: the remote
blocks are swapped for the same blocks run locally, so only the model's own forward logic is under test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from swarm_client.families import get_family
from swarm_client.model import DistributedModelForCausalLM
from swarm_client.sequence_manager import ClientConfig, SequenceManager
from swarm_client.tiny_model import make_tiny_model
from worker.compute import SpanRunner


class LocalBlocks(nn.Module):
    """Stands in for ``RemoteSequential``: same call signature, blocks run in this process."""

    def __init__(self, runner: SpanRunner):
        super().__init__()
        self.runner = runner

    def forward(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        return self.runner.forward(hidden, prompts=prompts)

    def forward_with_states(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None):
        states = self.runner.forward(hidden, output_hidden_states=True, prompts=prompts)
        return states[-1], list(states.unbind(0))


@pytest.fixture(scope="module", params=["bloom", "llama"])
def pair(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", family=request.param, num_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config, sd = hf.config, hf.state_dict()
    family = get_family(config)
    blocks = []
    for i in range(config.num_hidden_layers):
        prefix = family.layer_prefix(i)
        blocks.append(
            family.build_block(
                config, i, {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
            )
        )
    head = family.build_head(
        config, {k: v for k, v in sd.items() if k.startswith(tuple(family.head_prefixes(config)))}
    )
    manager = SequenceManager(ClientConfig([], "unused", config.num_hidden_layers), dht=object())
    model = DistributedModelForCausalLM(AutoConfig.from_pretrained(path), family, head, manager)
    model.blocks = LocalBlocks(SpanRunner(blocks, torch.float32, torch.device("cpu")))
    return model.eval(), hf


@torch.no_grad()
def test_inputs_embeds_equal_input_ids(pair) -> None:
    model, hf = pair
    ids = torch.randint(0, hf.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    embeds = model.get_input_embeddings()(ids)
    ref = hf(ids).logits
    torch.testing.assert_close(hf(inputs_embeds=embeds).logits, ref, atol=1e-5, rtol=0)  # 🤗's own behaviour
    torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, ref, atol=1e-4, rtol=0)
    ours = model(inputs_embeds=embeds, output_hidden_states=True).hidden_states
    for a, b in zip(ours, hf(inputs_embeds=embeds, output_hidden_states=True).hidden_states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_head_can_be_frozen_or_trained(pair) -> None:
    model, _ = pair
    assert sum(p.numel() for p in model.parameters()) > 0  # the local head's weights are the model's
    model.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())
    model.train()
    assert model.training and model.head.training
    model.eval()
