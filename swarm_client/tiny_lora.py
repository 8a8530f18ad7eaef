"""Random LoRA adapters for tiny models (``swarmserve tiny-model OUT --lora NAME``): tests run offline.

The adapter is a real PEFT checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``) written by
PEFT's own ``save_pretrained``; its B matrices are random (PEFT's ``init_lora_weights=False``), so unlike a
freshly initialised adapter it changes the model's outputs.
"""

from __future__ import annotations

import pathlib

import torch

#: every projection of each family's blocks (the LM head and embeddings stay untouched: the client runs them)
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "falcon": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "bloom": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def make_random_lora(
    model_dir: str | pathlib.Path, out_dir: str | pathlib.Path, seed: int = 0, rank: int = 4, scale: float = 0.1
) -> pathlib.Path:
    """Write a random LoRA adapter of rank ``rank`` for the model in ``model_dir`` to ``out_dir``.

    ``scale`` multiplies the random B matrices: outputs change clearly but stay in a sane range."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    targets = TARGETS.get(model.config.model_type)
    if targets is None:
        raise ValueError(f"no LoRA targets known for model type {model.config.model_type!r}")
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    out = pathlib.Path(out_dir)
    peft_model.save_pretrained(str(out))
    return out
