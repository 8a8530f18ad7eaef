"""Every layer's hidden states of a swarm-served model, and a slice of its blocks run on your own tensors.

    python examples/hidden_states.py --model PATH --initial-peers MADDR

``model(..., output_hidden_states=True)`` returns what the local 🤗 model would: the embeddings, each block's
output, and the last one after the final norm. ``model.blocks[a:b]`` is a module over blocks ``a..b-1``
only, so a probe or an intervention can start from any layer.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from swarm_client import AutoDistributedModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory or 🤗 id")
    parser.add_argument("--initial-peers", required=True, nargs="+", help="multiaddr(s) of the swarm's DHT")
    parser.add_argument("--dht-prefix", default=None)
    parser.add_argument("--text", default="The swarm serves every layer of this model.")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix
    )
    try:
        ids = tokenizer(args.text, return_tensors="pt").input_ids
        with torch.no_grad():
            states = model(ids, output_hidden_states=True).hidden_states
        shape = tuple(states[0].shape)
        print(f"hidden states: {len(states)} tensors for {len(model.blocks)} blocks, each {shape}")
        for i, h in enumerate(states):
            label = "embeddings" if i == 0 else f"after block {i - 1}"
            if i == len(states) - 1:
                label += " + final norm"
            print(f"  {i:2d} {label:28s} mean |h| = {h.abs().mean():.4f}")

        # a slice fed block 0's output (end < num_blocks: states[end] carries no final norm)
        end = min(3, len(model.blocks) - 1)
        if end > 1:
            with torch.no_grad():
                out, per_block = model.blocks[1:end].forward_with_states(states[1])
            diff = (out - states[end]).abs().max().item()
            print(f"blocks[1:{end}] on block 0's output: {len(per_block)} states, max diff {diff:.2e}")
            print("slice matches full run:", diff < 1e-3)
    finally:
        model.shutdown()


if __name__ == "__main__":
    main()
