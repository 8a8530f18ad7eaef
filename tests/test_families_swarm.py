"""Mistral, Qwen2, Mixtral, Falcon and BLOOM served by a real 2-worker swarm, against the local 🤗 model
(Llama has its own swarm tests: ``test_swarm_core``).

One swarm per family, shared by its checks: the span boundary sits mid-model, so hidden states (and for
BLOOM the ALiBi positions, for Falcon, Mistral and Qwen2 the rotary ones) cross a server hop on every step.
Forward logits agree within 1e-4 in float32, greedy tokens exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarm_client import AutoDistributedModelForCausalLM
from swarm_client.tiny_model import make_tiny_model
from swarmserve.launcher import wait_ready
from tests.swarm_fixtures import Swarm

pytestmark = pytest.mark.slow

ATOL = 1e-4


@pytest.fixture(scope="module", params=["mistral", "qwen2", "mixtral", "falcon", "bloom"])
def served(request, tmp_path_factory) -> Iterator[tuple[Any, Any]]:
    """(distributed model over two workers holding blocks 0:2 and 2:4, local 🤗 model); the workers start
    together."""
    model_dir = str(make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", family=request.param))
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with Swarm(model_dir) as s:
        wait_ready([s.add_worker(blocks=span, wait=False) for span in ("0:2", "2:4")], timeout=120.0)
        dist = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=[s.initial_peers])
        try:
            yield dist, local
        finally:
            dist.shutdown()


def _ids(config: Any, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=g)


def test_forward_logits_match_local(served) -> None:
    dist, local = served
    ids = _ids(local.config, 2, 13, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(dist(ids).logits, local(ids).logits, atol=ATOL, rtol=0)


def test_greedy_generate_identical(served) -> None:
    dist, local = served
    ids = _ids(local.config, 1, 7, seed=1)
    ours = dist.generate(ids, max_new_tokens=16, do_sample=False)
    assert ours.tolist() == local.generate(ids, max_new_tokens=16, do_sample=False).tolist()


def test_three_generate_calls_in_one_session_equal_one_local_call(served) -> None:
    dist, local = served
    ids = _ids(local.config, 1, 6, seed=2)
    with dist.inference_session(max_length=64):
        out = ids
        for _ in range(3):
            out = dist.generate(out, max_new_tokens=6, do_sample=False)
    assert out.tolist() == local.generate(ids, max_new_tokens=18, do_sample=False).tolist()
