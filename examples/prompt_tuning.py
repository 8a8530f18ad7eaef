"""Prompt tuning through remote blocks: the servers' weights stay frozen, only your prompts train.

    python examples/prompt_tuning.py --model PATH --initial-peers MADDR [--mode soft|deep|both]

- ``soft``: a trainable prompt ``[1, P, H]`` prepended to ``inputs_embeds`` (Lester et al., 2021);
- ``deep``: a trainable prefix per block, ``prompts [num_blocks, 1, P, H]``, which each server adds to the
  first ``P`` positions of the hidden states before that block (Petals' deep prompt tuning, P-tuning v2).

Backward runs hop by hop on the servers (``rpc_backward``), returning gradients for the hidden states and
the deep prompts; the local head is frozen with ``requires_grad_(False)``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from swarm_client import AutoDistributedModelForCausalLM

TEXTS = ["the swarm serves the model", "every block runs on a server"]


def train(name: str, params: list[torch.Tensor], loss_fn, steps: int, lr: float) -> bool:
    optimizer = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"{name} losses: " + " ".join(f"{v:.4f}" for v in losses))
    decreased = losses[-1] < losses[0]
    verdict = "decreased" if decreased else "did NOT decrease"
    print(f"{name}: loss {verdict} ({losses[0]:.4f} -> {losses[-1]:.4f})")
    return decreased


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory or 🤗 id")
    parser.add_argument("--initial-peers", required=True, nargs="+", help="multiaddr(s) of the swarm's DHT")
    parser.add_argument("--dht-prefix", default=None)
    parser.add_argument("--mode", choices=["soft", "deep", "both"], default="both")
    parser.add_argument("--prefix-length", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix
    )
    model.requires_grad_(False)  # freeze the local head: only the prompts below train
    model.train()
    try:
        rows = [tokenizer(t).input_ids for t in TEXTS]
        length = min(len(r) for r in rows)
        ids = torch.tensor([r[:length] for r in rows])  # equal-length rows (no padding)
        batch, hidden, p = ids.shape[0], model.config.hidden_size, args.prefix_length
        ok = True

        if args.mode in ("soft", "both"):
            soft = torch.nn.Parameter(torch.randn(1, p, hidden) * 0.02)

            def soft_loss() -> torch.Tensor:
                embeds = torch.cat([soft.expand(batch, -1, -1), model.get_input_embeddings()(ids)], dim=1)
                logits = model(inputs_embeds=embeds).logits[:, p:]  # predictions for the real tokens
                return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

            ok &= train("soft prompt", [soft], soft_loss, args.steps, args.lr)

        if args.mode in ("deep", "both"):
            deep = torch.nn.Parameter(torch.zeros(len(model.blocks), 1, p, hidden))
            prefix_ids = torch.full((batch, p), tokenizer.pad_token_id or 0)
            inputs = torch.cat([prefix_ids, ids], dim=1)  # P placeholder positions carry the deep prompts
            labels = torch.cat([torch.full((batch, p), -100), ids], dim=1)

            def deep_loss() -> torch.Tensor:
                return model(inputs, labels=labels, prompts=deep).loss

            ok &= train("deep prompts", [deep], deep_loss, args.steps, args.lr)

        assert all(param.grad is None for param in model.parameters()), "the frozen head got gradients"
        print("all modes: loss decreased" if ok else "some mode did not improve")
    finally:
        model.shutdown()


if __name__ == "__main__":
    main()
