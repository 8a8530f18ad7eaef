"""A bfloat16 worker gets its activations as bfloat16 on the wire in inference sessions, first hop included.

The hop fed by the client's float32 embeddings used to travel as float32 (4 bytes a value) and be cast on
arrival; ``_ServerSession`` now casts every step to the server's announced dtype, as ``rpc_forward`` does.
Every tensor the client serializes is watched (``protocol.serialize``: stream steps and step bundles both
go through it), with one real ``swarmserve worker --dtype bfloat16`` process holding every block.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarm_client import AutoDistributedModelForCausalLM, protocol
from swarm_client.tiny_model import make_tiny_model
from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow


def test_inference_steps_cross_the_wire_as_bfloat16(tmp_path, monkeypatch) -> None:
    model_dir = str(make_tiny_model(tmp_path / "model", family="llama", num_layers=4, seed=0))
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hidden_size = local.config.hidden_size
    ids = torch.randint(0, local.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = local(ids).logits

    sent: list[tuple[str, int, int]] = []  # (wire dtype, buffer bytes, values) per activation sent
    real_serialize = protocol.serialize

    def watching(tensor: torch.Tensor, compression: str = "none"):
        message = real_serialize(tensor, compression)
        if tensor.is_floating_point() and tensor.ndim == 3 and tensor.shape[-1] == hidden_size:
            sent.append((message.dtype, len(message.buffer), tensor.numel()))
        return message

    with swarm(model_dir, ["0:4"], "--dtype", "bfloat16") as s:
        dist = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=[s.initial_peers])
        try:
            monkeypatch.setattr(protocol, "serialize", watching)
            with torch.no_grad(), dist.inference_session(max_length=32) as session:
                prefill = dist(ids[:, :6]).logits  # one prefill step (its own stream message)
                steps = [dist(ids[:, i : i + 1]).logits for i in range(6, 9)]  # decode steps (step bundles)
                assert [h.peer_id for h in session.route] == [s.workers[0].peer_id]
        finally:
            monkeypatch.undo()
            dist.shutdown()

    assert len(sent) == 4, sent  # the prefill and three decode steps, each sent once to the only (first) hop
    for dtype, nbytes, values in sent:
        assert dtype == "bfloat16", sent
        assert nbytes == 2 * values, sent  # 2 bytes a value on the wire, not 4
    ours = torch.cat([prefill, *steps], dim=1)
    # bfloat16 keeps 8 bits of mantissa: the tiny model's logits (|x| ~ 1) agree to a few 1e-2
    scale = reference.abs().max().item()
    assert (ours - reference).abs().max().item() <= 0.03 * max(scale, 1.0)
    assert (ours - reference).abs().max().item() > 0  # it did compute in bfloat16
    assert ours.argmax(-1).tolist() == reference.argmax(-1).tolist()
