"""Mistral, Qwen2, Mixtral, Falcon and BLOOM served by a real 2-worker swarm, against the local 🤗 model
(Llama has its own swarm tests: ``test_swarm_core``).

One swarm per family, shared by its checks: the span boundary sits mid-model, so hidden states (and for
BLOOM the ALiBi positions, for Falcon, Mistral and Qwen2 the rotary ones) cross a server hop on every step.
Forward logits agree within 1e-4 in float32, greedy tokens exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from swarm_client import AutoDistributedModelForCausalLM
from swarm_client.tiny_lora import make_random_lora
from swarm_client.tiny_model import make_tiny_model
from swarmserve.launcher import wait_ready
from tests.swarm_fixtures import Swarm

pytestmark = pytest.mark.slow

ATOL = 1e-4


@pytest.fixture(scope="module", params=["mistral", "qwen2", "mixtral", "falcon", "bloom"])
def served(request, tmp_path_factory) -> Iterator[tuple[Any, Any]]:
    """(distributed model over two workers holding blocks 0:2 and 2:4, local 🤗 model); the workers start
    together."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = str(make_tiny_model(root / "model", family=request.param))
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapter = str(make_random_lora(model_dir, root / "lora", seed=1))  # served beside the base blocks
    with Swarm(model_dir) as s:
        starting = [s.add_worker("--adapters", f"a1={adapter}", blocks=span, wait=False) for span in ("0:2", "2:4")]
        wait_ready(starting, timeout=120.0)
        dist = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=[s.initial_peers])
        dist.served_from = (model_dir, s.initial_peers)  # for the gateway engine's checks below
        dist.adapter_path = adapter
        try:
            yield dist, local
        finally:
            dist.shutdown()


def _ids(config: Any, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=g)


def _engine_results(engine: Any, specs: list[Any]) -> list[Any]:
    async def go() -> list[Any]:
        return await (await engine.start(specs)).collect()

    return asyncio.run(go())


def test_gateway_speculation_is_exact(served) -> None:
    """The gateway's engine over this swarm: greedy tokens with guesses (prompt lookup from a prediction wrong
    at every fourth token; self-speculation with the model's first layer + its head, quantized to int8 where
    the family's projections are ones the int8 kernel knows) equal the local 🤗
    model's, with the guessing and the plain choice of one request batched into the same steps
    (``step_many`` mixing one- and many-token steps, rolled back on both servers)."""
    from gateway.backends.swarm import SwarmBackend
    from gateway.decode.choices import ChoiceSpec
    from gateway.decode.engine import Engine
    from gateway.decode.sampling import SamplingParams
    from gateway.settings import GatewaySettings

    dist, local = served
    model_dir, peers = dist.served_from
    prompt = [int(t) for t in _ids(local.config, 1, 5, seed=3)[0]] * 3  # repeated: prompt lookup finds guesses
    expected = local.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    backend = SwarmBackend(model_dir, [peers])
    settings = GatewaySettings(
        model=model_dir, draft_model=model_dir, draft_layers=1, draft_quant="int8", max_draft_tokens=4
    )
    engine = Engine(backend, settings)
    try:
        greedy = SamplingParams(temperature=0.0)
        modes = ["off", "prompt_lookup", "draft_model"]
        noisy = [t if i % 4 else (t + 1) % local.config.vocab_size for i, t in enumerate(expected)]  # a prediction
        specs = [
            ChoiceSpec(i, prompt, 24, greedy, logprobs=0, speculation=m, reference_ids=noisy)
            for i, m in enumerate(modes)
        ]
        results = _engine_results(engine, specs)
        ends = [i for i, t in enumerate(expected) if t in engine.eos_ids]
        expected = expected[: ends[0]] if ends else expected  # the engine stops at EOS and reports no logprob for it
        for r in results:
            assert [lp.token_id for lp in r.logprobs] == expected, r.speculation
        stats = [r.speculation for r in results]
        assert stats[1].accepted > 0 and stats[1].accepted < stats[1].drafted, stats
        assert stats[2].drafted > 0, stats
    finally:
        engine.close()
        backend.close()


def test_forward_logits_match_local(served) -> None:
    dist, local = served
    ids = _ids(local.config, 2, 13, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(dist(ids).logits, local(ids).logits, atol=ATOL, rtol=0)


def test_served_adapter_equals_peft_merged(served) -> None:
    """The workers' LoRA adapter (``--adapters a1=PATH``) against the local model with it merged by PEFT:
    logits within 1e-4, greedy tokens identical, and the adapter does change the output."""
    dist, local = served
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(dist.served_from[0], dtype=torch.float32), dist.adapter_path
    ).merge_and_unload().eval()
    ids = _ids(local.config, 1, 9, seed=3)
    with torch.no_grad(), dist.inference_session(max_length=32, adapter="a1") as session:
        logits = dist(ids, session=session).logits
        expected = merged(ids).logits
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert (expected - local(ids).logits).abs().max() > 0.05
    tokens = []
    with torch.no_grad(), dist.inference_session(max_length=32, adapter="a1") as session:
        step = dist(ids, session=session).logits
        for _ in range(8):
            token = step[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            step = dist(token, session=session).logits
    reference = merged.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert tokens == reference[0, ids.shape[1] :].tolist()


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
