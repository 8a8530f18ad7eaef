"""LoRA on the client's own parts plus deep prompts, trained through the swarm's frozen remote blocks.

    python examples/lora_training.py --model PATH --initial-peers MADDR [--local-blocks 0:1]

What runs where:

- here, in this process: the embeddings, final norm and LM head (``model.head``) and the local blocks
  (``local_blocks="0:1"``: ``model.manager.local.blocks``). PEFT (``peft.inject_adapter_in_model``) puts
  trainable LoRA layers into them in place; their base weights stay frozen;
- on the servers: the other blocks, frozen. Forward is ``rpc_forward`` hop by hop; backward is
  ``rpc_backward``, which returns gradients for the hidden states and the deep prompts
  (``prompts [num_blocks, 1, P, H]``, added to the first ``P`` positions before each block);
- the local blocks' backward recomputes their forward here and accumulates the LoRA gradients into ``.grad``.

The trained adapter is saved PEFT-style (``adapter_config.json`` + ``adapter_model.safetensors``, and the deep
prompts beside them), reloaded into a fresh client and gives the same loss.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from swarm_client import AutoDistributedModelForCausalLM
from swarm_client.model import DistributedModelForCausalLM

TEXTS = ["the swarm serves the model", "every block runs on a server"]
#: PEFT matches these by name suffix: the head's embeddings and LM head, the local blocks' attention projections
TARGETS = ["embeddings", "lm_head", "q_proj", "v_proj", "o_proj"]


def local_parts(model: DistributedModelForCausalLM) -> torch.nn.ModuleDict:
    """One module over everything this client runs itself (the same objects, so LoRA goes in place)."""
    return torch.nn.ModuleDict({"head": model.head, "blocks": model.manager.local.blocks})


def lora_config(rank: int) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)


def load(
    args: argparse.Namespace, adapter: pathlib.Path | None = None
) -> tuple[DistributedModelForCausalLM, torch.nn.ModuleDict]:
    """A client holding ``args.local_blocks`` and its local parts with fresh LoRA layers (or ``adapter``'s)."""
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix, local_blocks=args.local_blocks
    )
    model.requires_grad_(False)  # base weights frozen: only LoRA and the deep prompts train
    parts = local_parts(model)
    parts.requires_grad_(False)
    if adapter is None:
        inject_adapter_in_model(lora_config(args.rank), parts)
    else:
        inject_adapter_in_model(LoraConfig.from_pretrained(str(adapter)), parts)
        set_peft_model_state_dict(parts, load_file(adapter / "adapter_model.safetensors"))
    return model, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local model directory or 🤗 id")
    parser.add_argument("--initial-peers", required=True, nargs="+", help="multiaddr(s) of the swarm's DHT")
    parser.add_argument("--dht-prefix", default=None)
    parser.add_argument("--local-blocks", default="0:1", help="blocks this client runs (and trains LoRA on)")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--prefix-length", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model, parts = load(args)
    try:
        rows = [tokenizer(t).input_ids for t in TEXTS]
        length = min(len(r) for r in rows)
        ids = torch.tensor([r[:length] for r in rows])  # the toy task: continue these texts (equal lengths)
        batch, p = ids.shape[0], args.prefix_length
        inputs = torch.cat([torch.full((batch, p), tokenizer.pad_token_id or 0), ids], dim=1)
        labels = torch.cat([torch.full((batch, p), -100), ids], dim=1)  # P placeholder positions: deep prompts

        deep = torch.nn.Parameter(torch.zeros(len(model.blocks), 1, p, model.config.hidden_size))
        lora = {name: t for name, t in parts.named_parameters() if t.requires_grad}
        block_lora = [t for name, t in lora.items() if name.startswith("blocks.")]
        print(f"trainable: {len(lora)} LoRA tensors ({len(block_lora)} in the local blocks) + deep prompts")
        optimizer = torch.optim.Adam([*lora.values(), deep], lr=args.lr)
        model.train()
        losses = []
        for _ in range(args.steps):
            optimizer.zero_grad()
            loss = model(inputs, labels=labels, prompts=deep).loss
            loss.backward()  # through the head, the remote blocks (rpc_backward) and the local blocks
            if not losses:
                # (lora_B starts at zero, so at step 1 only the lora_B tensors have nonzero gradients)
                got = all(t.grad is not None for t in block_lora) and any(t.grad.any() for t in block_lora)
                print(f"local block LoRA got gradients: {got}")
            optimizer.step()
            losses.append(loss.item())
        print("losses: " + " ".join(f"{v:.4f}" for v in losses))
        verdict = "decreased" if losses[-1] < losses[0] else "did NOT decrease"
        print(f"lora + deep prompts: loss {verdict} ({losses[0]:.4f} -> {losses[-1]:.4f})")

        model.eval()
        with torch.no_grad():
            trained = model(inputs, labels=labels, prompts=deep).loss.item()
        with tempfile.TemporaryDirectory() as tmp:
            adapter = pathlib.Path(tmp)
            lora_config(args.rank).save_pretrained(str(adapter))
            save_file(
                get_peft_model_state_dict(parts, save_embedding_layers=False), adapter / "adapter_model.safetensors"
            )
            torch.save(deep.detach(), adapter / "deep_prompts.pt")
            reloaded, _ = load(args, adapter)
            try:
                with torch.no_grad():
                    prompts = torch.load(adapter / "deep_prompts.pt")
                    again = reloaded(inputs, labels=labels, prompts=prompts).loss.item()
            finally:
                reloaded.shutdown()
        print(f"reloaded adapter gives the same loss: {abs(again - trained) < 1e-4} ({trained:.4f}, {again:.4f})")
    finally:
        model.shutdown()


if __name__ == "__main__":
    main()
