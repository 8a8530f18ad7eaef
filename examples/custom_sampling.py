"""A sampling loop of your own over ``model(...)`` logits, inside an inference session.

    python examples/custom_sampling.py --model PATH --initial-peers MADDR

Inside ``with model.inference_session(max_length=...)`` every ``model(ids)`` call sends only the new tokens:
the servers keep the attention caches, exactly like passing ``past_key_values`` to a local model. So any
decoding rule — here temperature + nucleus (top-p) sampling with a repetition penalty — is a plain loop.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from swarm_client import AutoDistributedModelForCausalLM


def sample_next(
    logits: torch.Tensor, seen: torch.Tensor, generator: torch.Generator, temperature: float, top_p: float
) -> torch.Tensor:
    """One token per row from ``logits [B, V]``: repetition penalty, temperature, then top-p."""
    logits = logits.clone()
    penalized = logits.gather(1, seen)
    logits.scatter_(1, seen, torch.where(penalized > 0, penalized / 1.3, penalized * 1.3))
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the smallest set whose mass reaches top_p
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(-1, keepdim=True), 1, generator=generator)
    return order.gather(1, choice)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory or 🤗 id")
    parser.add_argument("--initial-peers", required=True, nargs="+", help="multiaddr(s) of the swarm's DHT")
    parser.add_argument("--dht-prefix", default=None)
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix
    )
    try:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        max_length = ids.shape[1] + args.max_new_tokens

        generator = torch.Generator().manual_seed(0)
        tokens = ids
        with torch.no_grad(), model.inference_session(max_length=max_length) as session:
            logits = model(ids).logits[:, -1]
            for _ in range(args.max_new_tokens):
                next_token = sample_next(logits, tokens, generator, temperature=0.8, top_p=0.9)
                tokens = torch.cat([tokens, next_token], dim=1)
                logits = model(next_token).logits[:, -1]  # only the new token travels
            print(f"session holds {session.position} tokens")
        print("sampled:", repr(tokenizer.decode(tokens[0, ids.shape[1] :])))

        # the same loop with argmax is greedy decoding: it must equal generate()
        greedy = ids
        with torch.no_grad(), model.inference_session(max_length=max_length):
            logits = model(ids).logits[:, -1]
            for _ in range(args.max_new_tokens):
                greedy = torch.cat([greedy, logits.argmax(-1, keepdim=True)], dim=1)
                logits = model(greedy[:, -1:]).logits[:, -1]
        reference = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        same = greedy[:, : reference.shape[1]].tolist() == reference.tolist()  # generate() may stop at EOS
        print("greedy:", repr(tokenizer.decode(greedy[0, ids.shape[1] :])))
        print("greedy loop matches generate():", same)
    finally:
        model.shutdown()


if __name__ == "__main__":
    main()
