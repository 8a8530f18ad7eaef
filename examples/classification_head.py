"""A local classification head trained on top of remote hidden states.

    python examples/classification_head.py --model PATH --initial-peers MADDR

The swarm computes the transformer's hidden states (frozen, ``torch.no_grad``: features once per example);
a small ``nn.Linear`` on the mean-pooled last hidden state trains locally, in milliseconds per step. For
fine-tuning through the blocks instead, drop the ``no_grad`` and add soft/deep prompts (see
``prompt_tuning.py``): gradients flow back through the servers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer

from swarm_client import AutoDistributedModelForCausalLM

POSITIVE = ["great food and friendly staff", "I loved this movie", "a wonderful day", "the best book ever"]
NEGATIVE = ["the service was awful", "I hated every minute", "a boring and bad film", "the worst day ever"]


def features(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """Mean-pooled last hidden state (after the final norm) per text: ``[len(texts), H]``."""
    rows = []
    with torch.no_grad():
        for text in texts:  # one row each: texts differ in length and padding is not supported
            ids = tokenizer(text, return_tensors="pt").input_ids
            last = model(ids, output_hidden_states=True).hidden_states[-1]
            rows.append(last.mean(dim=1))
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory or 🤗 id")
    parser.add_argument("--initial-peers", required=True, nargs="+", help="multiaddr(s) of the swarm's DHT")
    parser.add_argument("--dht-prefix", default=None)
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix
    )
    try:
        x = features(model, tokenizer, POSITIVE + NEGATIVE)
        y = torch.tensor([1] * len(POSITIVE) + [0] * len(NEGATIVE))
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)  # standardize the features
        print(f"features: {tuple(x.shape)} from {len(model.blocks)} remote blocks")

        head = nn.Linear(x.shape[1], 2)
        optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
        first = None
        for _ in range(args.epochs):
            optimizer.zero_grad()
            loss = F.cross_entropy(head(x), y)
            loss.backward()
            optimizer.step()
            first = loss.item() if first is None else first
        accuracy = (head(x).argmax(-1) == y).float().mean().item()
        print(f"classifier loss {first:.4f} -> {loss.item():.4f}; train accuracy {accuracy:.2f}")
        print("loss decreased" if loss.item() < first else "loss did NOT decrease")
    finally:
        model.shutdown()


if __name__ == "__main__":
    main()
