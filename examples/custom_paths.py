"""Custom paths through remote blocks: your own tensors, skipped or repeated blocks, local modules in between.

    python examples/custom_paths.py --model PATH --initial-peers MADDR

``model.blocks`` is a torch module (``RemoteSequential``) that slices like a list; each slice runs on
whichever servers hold those blocks. Compose slices with local modules as you would local layers —
autograd flows through all of it, so the local module below trains while the remote blocks stay frozen.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from swarm_client import AutoDistributedModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory or 🤗 id")
    parser.add_argument("--initial-peers", required=True, nargs="+", help="multiaddr(s) of the swarm's DHT")
    parser.add_argument("--dht-prefix", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix
    )
    model.requires_grad_(False)
    blocks, n = model.blocks, len(model.blocks)
    hidden = model.config.hidden_size
    try:
        x = torch.randn(2, 5, hidden) * 0.5  # your own tensors: [batch, tokens, hidden]
        with torch.no_grad():
            full = blocks(x)
            halves = blocks[n // 2 :](blocks[: n // 2](x))
        same = torch.allclose(full, halves, atol=1e-4)
        print(f"blocks[:{n // 2}] then blocks[{n // 2}:] equals blocks(x): {same}")

        with torch.no_grad():
            skipped = blocks[2:](blocks[0:1](x))  # block 1 skipped
            repeated = blocks[1:](blocks[1](blocks[:2](x)))  # block 1 run twice
        for name, out in (("skip block 1", skipped), ("repeat block 1", repeated)):
            differs = not torch.allclose(out, full)
            print(f"{name}: output {tuple(out.shape)}, differs from the full path: {differs}")

        # a local adapter between remote blocks, trained through the second half's backward pass
        adapter = nn.Linear(hidden, hidden)
        nn.init.eye_(adapter.weight)
        nn.init.zeros_(adapter.bias)
        target = torch.zeros_like(full)
        optimizer = torch.optim.Adam(adapter.parameters(), lr=0.01)
        with torch.no_grad():
            middle = blocks[: n // 2](x)  # the first half is fixed: compute it once
        losses = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = (blocks[n // 2 :](adapter(middle)) - target).pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        print("adapter losses:", " ".join(f"{v:.4f}" for v in losses))
        print("local module between remote blocks trained:", losses[-1] < losses[0])
    finally:
        model.shutdown()


if __name__ == "__main__":
    main()
